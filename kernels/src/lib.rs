//! Paged decode attention over a mixed-tier block table, in one pass.
//!
//! A decode step attends one query token (all its heads) over every live
//! key of a sequence. In a paged cache those keys sit in blocks: hot pages
//! in the model's dtype (f32 or f16 rows `[tokens][kv_heads][head_dim]`,
//! read in place) and cold pages quantized by `kvforge-quant` (INT8 / INT4
//! / INT2 with f16 group scales and minima, per-token or KIVI per-channel
//! keys, optionally Hadamard-rotated). [`PagedDecode::run`] walks the pages
//! in table order — no gather into one tensor, no write-back of the cold
//! tier — and keeps an online softmax per query head (one pass over the
//! keys, flash-attention's running maximum and sum), optionally split over
//! the context across threads (flash-decoding) and merged at the end.
//!
//! * Grouped-query attention: query head `h` reads KV head
//!   `h / (heads / kv_heads)` (libtorch's `repeat_interleave` convention).
//! * Cold pages are dequantized one page at a time into a per-thread
//!   scratch of one block (it stays in L1/L2), then attended like a hot
//!   page. Rotated keys are not rotated back: the query is rotated once
//!   instead (`q·k = Hq·Hk`, the transform is orthogonal).
//! * On request, the attention mass each table entry received (softmax
//!   weight summed over query heads), from the same pass: every page
//!   keeps its own maximum and sum, rescaled by the final ones at the end.
//! * [`Isa::Scalar`] is the plain-Rust twin every fast path is tested
//!   against; [`Isa::Avx2`] (AVX2 + FMA + F16C, detected at run time; also
//!   what [`Isa::Avx512`] runs here) and
//!   [`Isa::Neon`] (AArch64) use `std::arch` for dot products, the
//!   weighted value sums, f16 widening (AVX2) and a polynomial `exp`.
//!
//! Every input is checked before any page is read ([`KernelError`]): a
//! page whose length does not match its token count, a cold page without
//! a cold format or quantized differently, a head count the grouping does
//! not divide, an entry index past the mass buffer.
//!
//! The crate is pure Rust (no libtorch): the engine hands it slices of the
//! tensors it owns.

#![deny(missing_docs)]

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod isa;
mod pool;
pub mod qmatmul;
pub mod rowwise;

pub use isa::Isa;
pub use pool::{Pool, set_global_threads};
pub use qmatmul::{Activations, QMatrix, WeightFormat};

use half::f16;
use kvforge_quant::{GroupQuantizer, QuantConfig, QuantError, QuantizedBlock, Quantizer};

/// A bad input; nothing was read or written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// Lengths or dimensions that do not fit together.
    #[error("attention kernel: {0}")]
    Shape(String),
    /// Something this kernel does not handle (an instruction set the CPU
    /// lacks, a cold page without a cold format).
    #[error("attention kernel: {0}")]
    Unsupported(String),
    /// A cold page that does not decode.
    #[error("attention kernel: {0}")]
    Quant(#[from] QuantError),
}

/// `Result` with [`KernelError`].
pub type Result<T> = std::result::Result<T, KernelError>;

/// Head counts and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
}

impl Dims {
    fn check(&self) -> Result<()> {
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(KernelError::Shape(format!(
                "heads, KV heads and head dim must be positive: {self:?}"
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(KernelError::Shape(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }

    /// Elements of one token's K (or V) row: `kv_heads × head_dim`.
    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One block's keys and values as stored.
#[derive(Clone, Copy, Debug)]
pub enum Page<'a> {
    /// Hot rows in f32, `[tokens][kv_heads][head_dim]` each.
    F32 {
        /// Keys, after RoPE.
        k: &'a [f32],
        /// Values.
        v: &'a [f32],
    },
    /// Hot rows in f16.
    F16 {
        /// Keys, after RoPE.
        k: &'a [f16],
        /// Values.
        v: &'a [f16],
    },
    /// A cold block: the keys and values of one layer, quantized as the
    /// kernel's [`ColdFormat`] says. The span reads its first tokens.
    Quant {
        /// Keys.
        k: &'a QuantizedBlock,
        /// Values.
        v: &'a QuantizedBlock,
    },
}

/// The live keys of one table entry: a page and how many of its tokens
/// are attended (from the first).
#[derive(Clone, Copy, Debug)]
pub struct Span<'a> {
    /// Where the keys and values are.
    pub page: Page<'a>,
    /// Tokens attended, at least one.
    pub tokens: usize,
    /// The table entry it belongs to (index into the mass buffer).
    pub entry: usize,
}

/// How the cold tier's pages were quantized.
#[derive(Clone, Copy, Debug)]
pub struct ColdFormat {
    keys: GroupQuantizer,
    values: GroupQuantizer,
    rotated: bool,
}

impl ColdFormat {
    /// Keys quantized with `keys` (Hadamard-rotated per head vector
    /// before, when `rotated`), values with `values`.
    pub fn new(keys: QuantConfig, values: QuantConfig, rotated: bool) -> Self {
        ColdFormat {
            keys: GroupQuantizer::new(keys),
            values: GroupQuantizer::new(values),
            rotated,
        }
    }
}

/// Keys per thread below which the context is not split.
pub const DEFAULT_MIN_SPLIT: usize = 2048;

/// A configured decode-attention kernel.
#[derive(Clone, Copy, Debug)]
pub struct PagedDecode {
    dims: Dims,
    cold: Option<ColdFormat>,
    isa: Isa,
    threads: usize,
    min_split: usize,
    per_head: bool,
}

impl PagedDecode {
    /// A kernel for `dims` with the fastest instruction set of this CPU,
    /// one thread, no cold format.
    pub fn new(dims: Dims) -> Result<Self> {
        dims.check()?;
        Ok(PagedDecode {
            dims,
            cold: None,
            isa: Isa::detect(),
            threads: 1,
            min_split: DEFAULT_MIN_SPLIT,
            per_head: false,
        })
    }

    /// Reads cold pages as `cold` says. Rotated keys need a power-of-two
    /// head dim.
    pub fn with_cold(mut self, cold: ColdFormat) -> Result<Self> {
        if cold.rotated && !self.dims.head_dim.is_power_of_two() {
            return Err(KernelError::Unsupported(format!(
                "rotated keys need a power-of-two head dim, not {}",
                self.dims.head_dim
            )));
        }
        self.cold = Some(cold);
        Ok(self)
    }

    /// Runs with `isa`; an error if this CPU lacks it.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = isa.check()?;
        Ok(self)
    }

    /// Splits contexts of at least `threads × min_split` keys over up to
    /// `threads` threads (at least 1; `min_split` at least 1).
    pub fn with_threads(mut self, threads: usize, min_split: usize) -> Self {
        self.threads = threads.max(1);
        self.min_split = min_split.max(1);
        self
    }

    /// The attention mass and key novelty per entry and KV head
    /// (`entries × kv_heads` slots, at `entry × kv_heads + head`; the mass
    /// summed over the query heads of the KV head's group) instead of over
    /// all heads: for head-wise eviction.
    pub fn with_per_head(mut self, per_head: bool) -> Self {
        self.per_head = per_head;
        self
    }

    /// The instruction set it runs with.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The dimensions it was built for.
    pub fn dims(&self) -> Dims {
        self.dims
    }

    /// Attends `q` (`[heads][head_dim]`, already rotated by RoPE) over the
    /// keys of `spans` in order and writes `[heads][head_dim]` into `out`.
    /// Every key is visible (a decode step's keys are all at or before its
    /// query). With `mass` (one slot per table entry; with
    /// [`with_per_head`](Self::with_per_head), per entry and KV head), adds
    /// to `mass[span.entry]` the softmax weight the span's keys received,
    /// summed over query heads.
    pub fn run(
        &self,
        q: &[f32],
        spans: &[Span<'_>],
        out: &mut [f32],
        mass: Option<&mut [f32]>,
    ) -> Result<()> {
        self.run_observed(q, spans, out, mass, None)
    }

    /// [`run`](Self::run), and with `key_novelty` (one slot per table
    /// entry) KeyDiff's signal from the same pass: adds to
    /// `key_novelty[e]`, for every entry `e` with keys, `1 − cos(key, mean
    /// key)` averaged over the entry's keys and the KV heads (the mean per
    /// KV head over every key of `spans`). Cold keys stored rotated are
    /// refused for it (they would have to be rotated back).
    pub fn run_observed(
        &self,
        q: &[f32],
        spans: &[Span<'_>],
        out: &mut [f32],
        mass: Option<&mut [f32]>,
        key_novelty: Option<&mut [f32]>,
    ) -> Result<()> {
        self.check(q, spans, out, mass.as_deref())?;
        if let Some(nv) = key_novelty.as_deref() {
            self.check_entries(spans, nv.len(), "key novelty")?;
            let rotated = self.cold.is_some_and(|c| c.rotated);
            if rotated && spans.iter().any(|s| matches!(s.page, Page::Quant { .. })) {
                return Err(KernelError::Unsupported(
                    "key novelty over rotated cold keys".into(),
                ));
            }
        }
        match self.isa {
            Isa::Scalar => cpu::run::<cpu::Scalar>(self, q, spans, out, mass, key_novelty),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => {
                // SAFETY: `with_isa` and `Isa::detect` only select AVX2 or
                // AVX-512 on a CPU that has AVX2, FMA and F16C.
                unsafe { cpu::run_avx2(self, q, spans, out, mass, key_novelty) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => Err(KernelError::Unsupported(format!(
                "{} on a non-x86 CPU",
                self.isa.name()
            ))),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => {
                // SAFETY: every AArch64 CPU has NEON.
                unsafe { cpu::run_neon(self, q, spans, out, mass, key_novelty) }
            }
            #[cfg(not(target_arch = "aarch64"))]
            Isa::Neon => Err(KernelError::Unsupported("neon on a non-AArch64 CPU".into())),
        }
    }

    /// Every span's entry indexes a buffer of `len` slots (per KV head
    /// with [`with_per_head`](Self::with_per_head)).
    fn check_entries(&self, spans: &[Span<'_>], len: usize, what: &str) -> Result<()> {
        let h = self.dims.kv_heads;
        if self.per_head && !len.is_multiple_of(h) {
            return Err(KernelError::Shape(format!(
                "a {what} buffer of {len} slots does not hold {h} KV heads per entry"
            )));
        }
        let len = if self.per_head { len / h } else { len };
        match spans.iter().position(|s| s.entry >= len) {
            Some(i) => Err(KernelError::Shape(format!(
                "span {i} belongs to entry {}, past the {len} entries of the {what} buffer",
                spans[i].entry
            ))),
            None => Ok(()),
        }
    }

    /// Everything [`run`](Self::run) relies on, before anything is read.
    fn check(
        &self,
        q: &[f32],
        spans: &[Span<'_>],
        out: &[f32],
        mass: Option<&[f32]>,
    ) -> Result<()> {
        let d = self.dims;
        let want = d.heads * d.head_dim;
        if q.len() != want || out.len() != want {
            return Err(KernelError::Shape(format!(
                "query and output hold {} and {} elements, not heads × head dim = {want}",
                q.len(),
                out.len()
            )));
        }
        if spans.is_empty() {
            return Err(KernelError::Shape("no keys to attend over".into()));
        }
        if let Some(m) = mass {
            self.check_entries(spans, m.len(), "mass")?;
        }
        for (i, s) in spans.iter().enumerate() {
            if s.tokens == 0 {
                return Err(KernelError::Shape(format!("span {i} attends no token")));
            }

            let rows = s.tokens.checked_mul(d.row()).ok_or_else(|| {
                KernelError::Shape(format!("span {i}: {} tokens overflow", s.tokens))
            })?;
            let (k, v) = match s.page {
                Page::F32 { k, v } => (k.len(), v.len()),
                Page::F16 { k, v } => (k.len(), v.len()),
                Page::Quant { k, v } => {
                    let cold = self.cold.ok_or_else(|| {
                        KernelError::Unsupported(format!(
                            "span {i} is a cold page and the kernel has no cold format"
                        ))
                    })?;
                    for (what, b, qz) in [("keys", k, cold.keys), ("values", v, cold.values)] {
                        let shape = b.shape;
                        if shape.heads != d.kv_heads
                            || shape.head_dim != d.head_dim
                            || shape.tokens < s.tokens
                        {
                            return Err(KernelError::Shape(format!(
                                "span {i}: cold {what} of {} tokens × {} heads × {} do not hold {} tokens of {} heads × {}",
                                shape.tokens,
                                shape.heads,
                                shape.head_dim,
                                s.tokens,
                                d.kv_heads,
                                d.head_dim
                            )));
                        }
                        if b.config != qz.config() {
                            return Err(KernelError::Unsupported(format!(
                                "span {i}: cold {what} quantized as {:?}, the kernel reads {:?}",
                                b.config,
                                qz.config()
                            )));
                        }
                    }
                    continue;
                }
            };
            if k != rows || v != rows {
                return Err(KernelError::Shape(format!(
                    "span {i}: keys and values hold {k} and {v} elements, not {} tokens × {} = {rows}",
                    s.tokens,
                    d.row()
                )));
            }
        }
        Ok(())
    }
}
