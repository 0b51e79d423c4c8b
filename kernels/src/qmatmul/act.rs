//! [`Activations`]: rows of f32 quantized to int16 in blocks of 32 (scale
//! `max|x| / 32767`, codes rounded to nearest), with what the weight
//! formats' minima need: the scaled sum of each block's codes and of each
//! half of it.
//!
//! Int16, not ggml's int8: a block that holds one of the model's outlier
//! channels gets a coarse int8 step for its other 31 values, and on
//! SmolLM2 that moved a logit by up to 1.48 (2 of 114 top-1 tokens
//! changed against transformers); at int16 the products stay within f32
//! rounding of the dense matmul, for one more unpacking step per block.

use super::BLOCK;
use crate::{KernelError, Result};

/// `m` rows of `k` activations, int16 in blocks of [`BLOCK`].
#[derive(Clone, Debug, Default)]
pub struct Activations {
    rows: usize,
    cols: usize,
    /// Codes, row-major.
    pub(super) q: Vec<i16>,
    /// Per block: its scale.
    pub(super) d: Vec<f32>,
    /// Per block: `scale × Σ codes`.
    pub(super) s: Vec<f32>,
    /// Per block: `scale × Σ codes` of its first and second 16.
    pub(super) halves: Vec<[f32; 2]>,
}

impl Activations {
    /// Quantizes `x`, `rows` rows of `cols` values (`cols` a multiple of
    /// 32), reusing this buffer.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) -> Result<()> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) || Some(x.len()) != rows.checked_mul(cols) {
            return Err(KernelError::Shape(format!(
                "{} activations as {rows} rows of {cols} (a multiple of {BLOCK})",
                x.len()
            )));
        }
        let blocks = x.len() / BLOCK;
        self.rows = rows;
        self.cols = cols;
        self.q.resize(x.len(), 0);
        self.d.resize(blocks, 0.0);
        self.s.resize(blocks, 0.0);
        self.halves.resize(blocks, [0.0; 2]);
        for (b, (xb, qb)) in x
            .chunks_exact(BLOCK)
            .zip(self.q.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / f32::from(i16::MAX);
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sums = [0i32; 2];
            for (j, (v, q)) in xb.iter().zip(qb.iter_mut()).enumerate() {
                // |v · id| ≤ 32767 (up to rounding): the cast saturates.
                *q = (v * id).round() as i16;
                sums[j / 16] += i32::from(*q);
            }
            self.d[b] = d;
            self.s[b] = d * (sums[0] + sums[1]) as f32;
            self.halves[b] = [d * sums[0] as f32, d * sums[1] as f32];
        }
        Ok(())
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Blocks per row.
    pub(super) fn blocks(&self) -> usize {
        self.cols / BLOCK
    }

    /// Row `r`'s codes.
    pub(super) fn codes(&self, r: usize) -> &[i16] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }
}
