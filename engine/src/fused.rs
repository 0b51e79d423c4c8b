//! [`FusedBackend`]: decode steps through `kvforge-kernels`' paged
//! attention, reading the block table in place.
//!
//! A decode step (one query token) on the CPU, with hot tensors in f32 or
//! f16, runs the fused kernel: hot pages are read where they sit in the
//! layer's K/V tensors, cold blocks are dequantized one at a time inside
//! the kernel, dropped entries are never visited, aliases read their
//! canonical block, and the attention mass per entry (or per entry and KV
//! head) comes from the same
//! pass, and so does KeyDiff's key novelty (per-entry sums of unit keys
//! against the mean key).
//!
//! A decode step on a GPU whose live keys are all hot (f32, f16 or bf16)
//! runs the CUDA twin (`kvforge_kernels::cuda`, compiled by NVRTC the
//! first time, launched on libtorch's stream over the tensors it owns);
//! the attention mass (per entry, KV head or row) comes from a softmax
//! over the logits the kernel writes. A GPU without NVRTC or a driver the
//! kernels can use falls back to the reference, with one warning.
//!
//! Everything else — prefill chunks (several queries, a causal mask),
//! cold blocks on a GPU, other dtypes, key novelty over Hadamard-rotated
//! cold keys or on a GPU, and CPU signals per token (token-level
//! eviction) — goes to [`ReferenceBackend`].

use std::sync::OnceLock;

use kvforge_kernels::cuda::{self, CudaDecode, DeviceStep, HotKind};
use kvforge_kernels::{Dims, Isa, Page, PagedDecode, Span};
use tch::{Device, Kind, Tensor};

use crate::attention::{
    Attended, AttentionBackend, KvTensors, Observe, PageRef, ReferenceBackend, StepView,
    interleave_heads,
};
use crate::{EngineError, Result};

/// The fused CPU decode kernel, with the reference for the rest.
#[derive(Clone, Copy, Debug)]
pub struct FusedBackend {
    isa: Isa,
    threads: usize,
    min_split: usize,
}

impl Default for FusedBackend {
    /// The fastest instruction set of this CPU, as many threads as
    /// libtorch's intra-op pool (`--threads`), contexts split from
    /// [`DEFAULT_MIN_SPLIT`](kvforge_kernels::DEFAULT_MIN_SPLIT) keys per
    /// thread.
    fn default() -> Self {
        FusedBackend {
            isa: Isa::detect(),
            threads: usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1),
            min_split: kvforge_kernels::DEFAULT_MIN_SPLIT,
        }
    }
}

impl FusedBackend {
    /// Runs with `isa` (an error if this CPU lacks it).
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = isa.check().map_err(kernel)?;
        Ok(self)
    }

    /// Splits contexts of at least `threads × min_split` keys over up to
    /// `threads` threads.
    pub fn with_threads(mut self, threads: usize, min_split: usize) -> Self {
        self.threads = threads.max(1);
        self.min_split = min_split.max(1);
        self
    }

    /// Whether this step runs fused (else the reference runs it).
    fn fits(q: &Tensor, kv: &KvTensors<'_>, layer: usize, observe: Observe) -> bool {
        let Some(k) = kv.k.get(layer) else {
            return false;
        };
        let rotated = kv.cold.is_some_and(|c| c.spec().rotate);
        q.size().first() == Some(&1)
            && !(observe.key_novelty && rotated)
            && !(observe.per_token && (observe.mass || observe.key_novelty))
            && q.device() == Device::Cpu
            && k.device() == Device::Cpu
            && matches!(k.kind(), Kind::Float | Kind::Half)
            && k.is_contiguous()
            && kv.v[layer].is_contiguous()
            && kv.v[layer].kind() == k.kind()
    }
}

/// `len` rows of `row` elements from row `slot` of a contiguous CPU
/// tensor of `T`, bounds-checked.
fn rows<T>(t: &Tensor, slot: usize, len: usize, row: usize) -> Result<&[T]> {
    let slots = t.size().first().copied().unwrap_or(0) as usize;
    if slot.checked_add(len).is_none_or(|end| end > slots) {
        return Err(EngineError::Request(format!(
            "the block table points at slots {slot}..{} of a pool of {slots}",
            slot.saturating_add(len)
        )));
    }
    // SAFETY: `t` is a contiguous CPU tensor whose elements are `T` (the
    // caller matched its kind) with `slots × row` elements; the range is
    // inside it (checked above). Those slots belong to blocks this
    // sequence holds: the step's own were written before attention, and a
    // block with other holders is never written, so nothing writes them
    // while the slice lives.
    Ok(unsafe {
        std::slice::from_raw_parts(
            t.data_ptr().cast::<T>().cast_const().add(slot * row),
            len * row,
        )
    })
}

impl AttentionBackend for FusedBackend {
    fn name(&self) -> &'static str {
        "fused"
    }

    fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        view: &StepView,
        kv: &KvTensors<'_>,
        observe: Observe,
    ) -> Result<Attended> {
        if let Some(done) = attend_cuda(layer, q, view, kv, observe)? {
            return Ok(done);
        }
        if !Self::fits(q, kv, layer, observe) {
            return ReferenceBackend.attend(layer, q, view, kv, observe);
        }
        let (k, v) = (&kv.k[layer], &kv.v[layer]);
        let (ks, qs) = (k.size(), q.size());
        let dims = Dims {
            heads: qs[1] as usize,
            kv_heads: ks[1] as usize,
            head_dim: ks[2] as usize,
        };
        if qs[2] != ks[2] {
            return Err(EngineError::Request(format!(
                "query head dim {} differs from the cache's {}",
                qs[2], ks[2]
            )));
        }
        let mut kern = PagedDecode::new(dims)
            .map_err(kernel)?
            .with_isa(self.isa)
            .map_err(kernel)?
            .with_threads(self.threads, self.min_split)
            .with_per_head(observe.per_head);
        if let Some(c) = kv.cold {
            kern = kern.with_cold(c.kernel_format()).map_err(kernel)?;
        }
        let row = dims.kv_heads * dims.head_dim;
        let half = k.kind() == Kind::Half;
        let mut spans = Vec::with_capacity(view.pages.len());
        for (page, entry) in &view.pages {
            let (page, tokens) = match page {
                PageRef::Hot { slot, len } if half => (
                    Page::F16 {
                        k: rows(k, *slot, *len, row)?,
                        v: rows(v, *slot, *len, row)?,
                    },
                    *len,
                ),
                PageRef::Hot { slot, len } => (
                    Page::F32 {
                        k: rows(k, *slot, *len, row)?,
                        v: rows(v, *slot, *len, row)?,
                    },
                    *len,
                ),
                PageRef::Cold { block, len } => {
                    let (qk, qv) = block.layer(layer).ok_or_else(|| {
                        EngineError::Request(format!("a cold block holds no layer {layer}"))
                    })?;
                    (Page::Quant { k: qk, v: qv }, *len)
                }
            };
            spans.push(Span {
                page,
                tokens,
                entry: *entry,
            });
        }
        let qv = Vec::<f32>::try_from(q.f_to_kind(Kind::Float)?.f_flatten(0, -1)?)?;
        let mut out = vec![0f32; qv.len()];
        let per = if observe.per_head { dims.kv_heads } else { 1 };
        let mut mass = observe.mass.then(|| vec![0f32; view.entries() * per]);
        let mut key_novelty = observe
            .key_novelty
            .then(|| vec![0f32; view.entries() * per]);
        kern.run_observed(
            &qv,
            &spans,
            &mut out,
            mass.as_deref_mut(),
            key_novelty.as_deref_mut(),
        )
        .map_err(kernel)?;
        let out = Tensor::f_from_slice(&out)?
            .f_view([1, qs[1], qs[2]])?
            .f_to_kind(q.kind())?;
        Ok(Attended {
            out,
            mass,
            key_novelty,
        })
    }
}

/// A kernel's refusal as the engine's error: what the kernel cannot do
/// here is `Unsupported`, a malformed table or page a `Request` error.
fn kernel(e: kvforge_kernels::KernelError) -> EngineError {
    match e {
        kvforge_kernels::KernelError::Unsupported(s) => EngineError::Unsupported(s),
        other => EngineError::Request(other.to_string()),
    }
}

/// The CUDA kernels of each GPU, compiled and loaded on first use; the
/// reason when they cannot be (reported once, then the reference runs).
static CUDA: [OnceLock<std::result::Result<CudaDecode, String>>; 16] =
    [const { OnceLock::new() }; 16];

fn cuda_init(ordinal: usize) -> std::result::Result<&'static CudaDecode, String> {
    let cell = CUDA
        .get(ordinal)
        .ok_or_else(|| format!("cuda:{ordinal}: the CUDA kernels serve GPUs 0 to 15"))?;
    cell.get_or_init(|| {
        CudaDecode::new(ordinal).map_err(|e| {
            tracing::warn!("cuda:{ordinal}: {e}; decode attention runs through the reference");
            e.to_string()
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn cuda_kernels(ordinal: usize) -> Option<&'static CudaDecode> {
    cuda_init(ordinal).ok()
}

impl FusedBackend {
    /// Whether decode steps on GPU `ordinal` run the CUDA kernel: the
    /// architecture it was compiled for, or why not (then they run the
    /// reference). Compiles and loads the kernels on first call.
    pub fn cuda_status(ordinal: usize) -> std::result::Result<String, String> {
        cuda_init(ordinal).map(|k| k.arch().to_string())
    }
}

/// A decode step on a GPU through the CUDA kernel, when it handles the
/// step (one query, every live key hot in f32 / f16 / bf16, a head dim
/// and grouping it has a kernel for, no key novelty asked); `None` sends
/// the step to the reference.
fn attend_cuda(
    layer: usize,
    q: &Tensor,
    view: &StepView,
    kv: &KvTensors<'_>,
    observe: Observe,
) -> Result<Option<Attended>> {
    let (Some(k), Some(v)) = (kv.k.get(layer), kv.v.get(layer)) else {
        return Ok(None);
    };
    let Device::Cuda(ordinal) = k.device() else {
        return Ok(None);
    };
    let hot = match k.kind() {
        Kind::Float => HotKind::F32,
        Kind::Half => HotKind::F16,
        Kind::BFloat16 => HotKind::Bf16,
        _ => return Ok(None),
    };
    let (qs, ks) = (q.size(), k.size());
    let dims = Dims {
        heads: qs[1] as usize,
        kv_heads: ks[1] as usize,
        head_dim: ks[2] as usize,
    };
    let supported = qs[0] == 1
        && qs[2] == ks[2]
        && q.device() == k.device()
        && !observe.key_novelty
        && v.kind() == k.kind()
        && k.is_contiguous()
        && v.is_contiguous()
        && dims.kv_heads > 0
        && dims.heads % dims.kv_heads == 0
        && dims.heads / dims.kv_heads <= cuda::MAX_GROUP
        && cuda::HEAD_DIMS.contains(&dims.head_dim);
    let Some(slots) = view.hot_slots().filter(|_| supported) else {
        return Ok(None);
    };
    let Some(kern) = cuda_kernels(ordinal) else {
        return Ok(None);
    };
    // The kernel reads the pools at these slots: check them on the host,
    // where the table was resolved, before anything is launched.
    let pool = ks[0] as usize;
    for (page, _) in &view.pages {
        if let PageRef::Hot { slot, len } = page {
            if slot.checked_add(*len).is_none_or(|end| end > pool) {
                return Err(EngineError::Request(format!(
                    "the block table points at slots {slot}..{} of a pool of {pool}",
                    slot.saturating_add(*len)
                )));
            }
        }
    }
    let dev = k.device();
    let keys = view.keys();
    let q32 = q.f_to_kind(Kind::Float)?.f_contiguous()?;
    let out = Tensor::f_empty([qs[1], qs[2]], (Kind::Float, dev))?;
    let floats = kern.scratch_floats(dims, keys);
    let scratch = Tensor::f_empty([floats as i64], (Kind::Float, dev))?;
    let scores = observe
        .mass
        .then(|| Tensor::f_empty([qs[1], keys as i64], (Kind::Float, dev)))
        .transpose()?;
    let ptr = |t: &Tensor| t.data_ptr() as u64;
    let step = DeviceStep {
        dims,
        hot,
        k_pool: ptr(k),
        v_pool: ptr(v),
        table: ptr(slots),
        keys,
        cold: None,
        q: ptr(&q32),
        out: ptr(&out),
        scratch: ptr(&scratch),
        scratch_floats: floats,
        scores: scores.as_ref().map_or(0, ptr),
    };
    // SAFETY: every address is a live, contiguous tensor on this GPU of the
    // size `DeviceStep` documents (the pools `[slots][kv_heads][head_dim]`,
    // `slots` one i64 per live key, `out` and `q32` `[heads][head_dim]`
    // f32, `scratch` as sized, `scores` `[heads][keys]`); every slot is
    // inside the pool (checked above; `slots` was built from the same
    // pages). The launches go to libtorch's stream (the legacy default
    // one), so they run after the writes that produced these tensors and
    // before anything later reads `out` or `scores`; the tensors are
    // freed to libtorch's caching allocator, whose reuse is ordered on
    // that stream.
    unsafe { kern.run(&step) }.map_err(kernel)?;
    let mass = match scores {
        None => None,
        Some(scores) => {
            let w = scores.f_softmax(-1, Kind::Float)?; // [heads, keys]
            Some(if observe.per_head {
                let g = (dims.heads / dims.kv_heads) as i64;
                let w = w
                    .f_view([dims.kv_heads as i64, g, keys as i64])?
                    .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Float)?
                    .f_contiguous()?
                    .f_to_device(Device::Cpu)?;
                interleave_heads(view, &Vec::<f32>::try_from(w.f_flatten(0, -1)?)?, false)
            } else {
                let w = w
                    .f_sum_dim_intlist([0i64].as_slice(), false, Kind::Float)?
                    .f_to_device(Device::Cpu)?;
                let w = Vec::<f32>::try_from(w)?;
                if observe.per_token {
                    view.per_row(&w)
                } else {
                    view.per_entry(&w, false)
                }
            })
        }
    };
    let out = out.f_view([1, qs[1], qs[2]])?.f_to_kind(q.kind())?;
    Ok(Some(Attended {
        out,
        mass,
        key_novelty: None,
    }))
}
