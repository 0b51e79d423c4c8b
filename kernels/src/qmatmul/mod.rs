//! Matmuls over weights kept in their GGUF block formats: `y = x · Wᵀ`
//! with `W` `[n, k]` quantized in blocks along `k`, never dequantized as a
//! whole.
//!
//! llama.cpp's way, with int16 activations: each activation row is
//! quantized to int16 in blocks of 32 (one f32 scale per block, plus the
//! sums of its codes; ggml uses int8, see `act.rs` for why not here), and
//! a weight block meets an activation block in an integer dot product; the
//! block's scales (and minimum) turn the integer sum into floats. One
//! weight row is unpacked once for up to [`TILE`] activation rows, so a
//! batch of rows reads each weight block once per step and batching gets
//! cheaper per token.
//!
//! * [`WeightFormat::Q4_0`], [`Q4_1`](WeightFormat::Q4_1) and
//!   [`Q8_0`](WeightFormat::Q8_0) are read as the file stores them.
//! * The K-quants ([`Q4_K`](WeightFormat::Q4_K), [`Q5_K`](WeightFormat::Q5_K),
//!   [`Q6_K`](WeightFormat::Q6_K)) are repacked once at load into
//!   [`Packed::K16`]: groups of 16 int8 codes with an f32 scale and
//!   minimum, which holds every K-quant value exactly (the 6-bit scales
//!   times the super-block's f16 scale are not f16 values) at 12 bits a
//!   weight instead of 4.5–6.6.
//!
//! [`Isa::Scalar`] is the plain-Rust twin; [`Isa::Avx2`] the x86-64 kernel
//! (codes widened to int16, `madd` integer dots, detected at run time) and
//! [`Isa::Avx512`] the same at 512 bits (a block in one `madd`; chosen by
//! name, `KVFORGE_ISA=avx512`); NEON, for now, runs the scalar twin. Output columns are
//! split over a [`Pool`]'s threads.

use half::f16;

use crate::isa::Isa;
use crate::pool::Pool;
use crate::{KernelError, Result};

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod pack;
mod scalar;

pub use act::Activations;

/// Activation rows one weight row is unpacked for.
pub const TILE: usize = 4;

/// Elements of an activation block (and of every weight block but the
/// K-quants' super-blocks).
pub const BLOCK: usize = 32;

/// A GGUF weight format the matmul reads.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// 32 weights: f16 scale, 4-bit codes minus 8 (18 bytes).
    Q4_0,
    /// 32 weights: f16 scale and minimum, 4-bit codes (20 bytes).
    Q4_1,
    /// 32 weights: f16 scale, int8 codes (34 bytes).
    Q8_0,
    /// 256 weights: f16 scale and minimum, eight 6-bit scale/minimum
    /// pairs, 4-bit codes (144 bytes).
    Q4_K,
    /// Q4_K with a fifth bit per code (176 bytes).
    Q5_K,
    /// 256 weights: 6-bit codes minus 32, sixteen int8 scales, an f16
    /// scale (210 bytes).
    Q6_K,
}

impl WeightFormat {
    /// Every format.
    pub const ALL: [WeightFormat; 6] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q8_0,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ];

    /// Weights per block and bytes per block, as the file stores them.
    pub fn block(self) -> (usize, usize) {
        match self {
            WeightFormat::Q4_0 => (32, 18),
            WeightFormat::Q4_1 => (32, 20),
            WeightFormat::Q8_0 => (32, 34),
            WeightFormat::Q4_K => (256, 144),
            WeightFormat::Q5_K => (256, 176),
            WeightFormat::Q6_K => (256, 210),
        }
    }

    /// `bytes` (whole blocks of this format) as f32, each value as ggml
    /// decodes it (what a [`QMatrix`] of these blocks multiplies by).
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let (per, size) = self.block();
        let mut out = vec![0f32; bytes.len() / size * per];
        let (packed, held) = match self {
            WeightFormat::Q4_0 => (Packed::Q4_0, std::borrow::Cow::Borrowed(bytes)),
            WeightFormat::Q4_1 => (Packed::Q4_1, bytes.into()),
            WeightFormat::Q8_0 => (Packed::Q8_0, bytes.into()),
            _ => (Packed::K16, pack::k16(self, bytes).into()),
        };
        scalar::dequantize(packed, &held, &mut out);
        out
    }

    /// ggml's name (`q4_1`, …).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_K => "q4_k",
            WeightFormat::Q5_K => "q5_k",
            WeightFormat::Q6_K => "q6_k",
        }
    }
}

/// How a [`QMatrix`] holds its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packed {
    /// ggml's Q4_0 blocks as stored.
    Q4_0,
    /// ggml's Q4_1 blocks as stored.
    Q4_1,
    /// ggml's Q8_0 blocks as stored.
    Q8_0,
    /// Per 32 weights: 32 int8 codes, then two (scale, minimum) f32 pairs,
    /// one per 16 (48 bytes): weight `j` is `scale·code + minimum`.
    K16,
}

impl Packed {
    /// Bytes per 32 weights.
    pub const fn bytes(self) -> usize {
        match self {
            Packed::Q4_0 => 18,
            Packed::Q4_1 => 20,
            Packed::Q8_0 => 34,
            Packed::K16 => 48,
        }
    }
}

/// A weight matrix `[rows, cols]` in blocks along its rows.
#[derive(Clone)]
pub struct QMatrix {
    packed: Packed,
    /// The file's format (what it was packed from).
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl QMatrix {
    /// The matrix `[rows, cols]` whose blocks (`format`, row after row)
    /// are `bytes`; `cols` a multiple of the format's block (and of 32).
    pub fn from_ggml(format: WeightFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let (per, size) = format.block();
        if rows == 0 || cols == 0 || !cols.is_multiple_of(per) || !cols.is_multiple_of(BLOCK) {
            return Err(KernelError::Shape(format!(
                "a {} matrix needs rows of a positive multiple of {per} weights, not {rows} x {cols}",
                format.name()
            )));
        }
        let want = rows
            .checked_mul(cols / per)
            .and_then(|b| b.checked_mul(size))
            .ok_or_else(|| KernelError::Shape(format!("{rows} x {cols} overflows")))?;
        if bytes.len() != want {
            return Err(KernelError::Shape(format!(
                "{rows} x {cols} {} weights take {want} bytes, not {}",
                format.name(),
                bytes.len()
            )));
        }
        let (packed, data) = match format {
            WeightFormat::Q4_0 => (Packed::Q4_0, bytes.to_vec()),
            WeightFormat::Q4_1 => (Packed::Q4_1, bytes.to_vec()),
            WeightFormat::Q8_0 => (Packed::Q8_0, bytes.to_vec()),
            WeightFormat::Q4_K | WeightFormat::Q5_K | WeightFormat::Q6_K => {
                (Packed::K16, pack::k16(format, bytes))
            }
        };
        Ok(QMatrix {
            packed,
            format,
            rows,
            cols,
            data,
        })
    }

    /// Output features (`n`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (`k`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The file's format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// How the rows are held.
    pub fn packed(&self) -> Packed {
        self.packed
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The rows as held ([`packed`](Self::packed)), row after row.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.packed.bytes()
    }

    /// Row `r`'s blocks.
    fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// Row `r` as f32 (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        if r >= self.rows || out.len() != self.cols {
            return Err(KernelError::Shape(format!(
                "row {r} of {} into {} values (rows of {})",
                self.rows,
                out.len(),
                self.cols
            )));
        }
        scalar::dequantize(self.packed, self.row(r), out);
        Ok(())
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            scalar::dequantize(self.packed, self.row(r), o);
        }
        out
    }

    /// Rows `from..from + out.len() / cols` as f32 into `out`, split over
    /// `pool`'s threads (a panel for a dense matmul).
    pub fn dequantize_rows(&self, from: usize, out: &mut [f32], pool: &Pool) -> Result<()> {
        let n = out.len() / self.cols;
        if !out.len().is_multiple_of(self.cols) || from + n > self.rows {
            return Err(KernelError::Shape(format!(
                "rows {from}..{} of {} into {} values (rows of {})",
                from + n,
                self.rows,
                out.len(),
                self.cols
            )));
        }
        let parts = pool.threads().min(n.div_ceil(64)).max(1);
        let per = n.div_ceil(parts);
        let base = SendPtr(out.as_mut_ptr());
        pool.run(parts, &|p| {
            for r in (p * per)..((p + 1) * per).min(n) {
                // SAFETY: row `r` of `out` (inside it: `r < n`) is written
                // by part `p` alone.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(base.ptr().add(r * self.cols), self.cols)
                };
                scalar::dequantize(self.packed, self.row(from + r), o);
            }
        })
    }

    /// `out[i][j] = x[i] · row j` for the `x.rows()` activation rows;
    /// `out` is `[x.rows(), rows]` row-major. Output columns are split over
    /// `pool`'s threads.
    pub fn matmul(&self, x: &Activations, out: &mut [f32], isa: Isa, pool: &Pool) -> Result<()> {
        let isa = isa.check()?;
        let m = x.rows();
        if x.cols() != self.cols || out.len() != m * self.rows {
            return Err(KernelError::Shape(format!(
                "[{m}, {}] activations times a [{}, {}] matrix into {} values",
                x.cols(),
                self.rows,
                self.cols,
                out.len()
            )));
        }
        // Enough columns per part that a part is worth a thread.
        let parts = pool.threads().min(self.rows.div_ceil(16)).max(1);
        let per = self.rows.div_ceil(parts);
        let out_ptr = SendPtr(out.as_mut_ptr());
        pool.run(parts, &|p| {
            let cols = (p * per)..((p + 1) * per).min(self.rows);
            // SAFETY: every part writes the columns `cols` of each output
            // row, disjoint between parts and inside `out` (checked above);
            // `run` returns only when every part has ended.
            unsafe { self.columns(x, cols, out_ptr, isa) }
        })
    }

    /// Output columns `cols` of every row.
    ///
    /// # Safety
    /// `out` must point at `x.rows() × self.rows` floats that no one else
    /// writes in these columns meanwhile.
    unsafe fn columns(
        &self,
        x: &Activations,
        cols: std::ops::Range<usize>,
        out: SendPtr,
        isa: Isa,
    ) {
        let m = x.rows();
        let n = self.rows;
        let mut i = 0;
        while i < m {
            let t = (m - i).min(TILE);
            for j in cols.clone() {
                let mut acc = [0f32; TILE];
                let w = self.row(j);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa` was checked against this CPU.
                    Isa::Avx2 => unsafe { avx2::tile(self.packed, w, x, i, t, &mut acc) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa` was checked against this CPU.
                    Isa::Avx512 => unsafe { avx512::tile(self.packed, w, x, i, t, &mut acc) },
                    _ => scalar::tile(self.packed, w, x, i, t, &mut acc),
                }
                for (r, v) in acc.iter().take(t).enumerate() {
                    // SAFETY: row `i + r` < m, column `j` < n: inside
                    // `out`, in this part's columns.
                    unsafe { *out.0.add((i + r) * n + j) = *v };
                }
            }
            i += t;
        }
    }
}

/// `out`'s base pointer, shared by the parts of one matmul.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

impl SendPtr {
    /// The pointer (a method, so that closures capture the `Sync` whole).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: the parts write disjoint elements (see `QMatrix::matmul`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// An f16 from two little-endian bytes.
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[cfg(test)]
mod tests;
