//! The normalized Walsh–Hadamard transform and [`Rotated`], a quantizer
//! wrapper that rotates every head vector before quantizing.

use std::mem::MaybeUninit;

use crate::error::{QuantError, Result};
use crate::{BlockShape, QuantConfig, QuantizedBlock, Quantizer, as_uninit, check_len};

/// In-place normalized fast Walsh–Hadamard transform of a power-of-two
/// length vector. Orthogonal and its own inverse: applying it twice returns
/// the input (up to rounding). Each butterfly stage is normalized by `1/√2`,
/// so no intermediate exceeds the final bound `√n · max|x|` (the
/// unnormalized transform grows to `n · max|x|` first and overflows f32 for
/// large finite input).
pub fn hadamard_in_place(v: &mut [f32]) -> Result<()> {
    let n = v.len();
    if n == 0 || !n.is_power_of_two() {
        return Err(QuantError::Hadamard { head_dim: n });
    }
    let norm = std::f32::consts::FRAC_1_SQRT_2;
    let mut h = 1;
    while h < n {
        for block in v.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = ((*x + *y) * norm, (*x - *y) * norm);
                *x = s;
                *y = d;
            }
        }
        h *= 2;
    }
    Ok(())
}

/// Largest input magnitude [`Rotated`] accepts: its rotation stays finite
/// (`√head_dim · 1e30` is far below `f32::MAX` for any head dim up to 2^32)
/// so a finite input is never reported as non-finite; the inner quantizer's
/// f16 range then decides.
const ROTATION_LIMIT: f32 = 1e30;

/// Rotates each head vector with [`hadamard_in_place`] before quantizing
/// with `Q`, and back after dequantizing. Queries must be rotated the same
/// way for attention on the rotated keys (`q·k = Hq·Hk`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotated<Q> {
    inner: Q,
}

impl<Q: Quantizer> Rotated<Q> {
    /// Wraps `inner`.
    pub fn new(inner: Q) -> Self {
        Rotated { inner }
    }
}

fn rotate_heads(shape: BlockShape, v: &mut [f32]) -> Result<()> {
    v.chunks_exact_mut(shape.head_dim)
        .try_for_each(hadamard_in_place)
}

impl<Q: Quantizer> Quantizer for Rotated<Q> {
    fn name(&self) -> String {
        format!("hadamard+{}", self.inner.name())
    }

    fn config(&self) -> QuantConfig {
        self.inner.config()
    }

    fn quantize(&self, shape: BlockShape, x: &[f32]) -> Result<QuantizedBlock> {
        check_len(shape, x.len())?;
        if let Some((index, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                index,
                value: v.to_string(),
            });
        }
        if let Some((index, v)) = x.iter().enumerate().find(|(_, v)| v.abs() > ROTATION_LIMIT) {
            return Err(QuantError::OutOfRange {
                index,
                value: v.to_string(),
                format: "rotated",
                limit: "|x| <= 1e30 before the rotation",
            });
        }
        let mut r = x.to_vec();
        rotate_heads(shape, &mut r)?;
        self.inner.quantize(shape, &r)
    }

    fn dequantize(&self, block: &QuantizedBlock, out: &mut [f32]) -> Result<()> {
        self.dequantize_uninit(block, as_uninit(out)).map(|_| ())
    }

    fn dequantize_uninit<'a>(
        &self,
        block: &QuantizedBlock,
        out: &'a mut [MaybeUninit<f32>],
    ) -> Result<&'a mut [f32]> {
        let out = self.inner.dequantize_uninit(block, out)?;
        rotate_heads(block.shape, out)?;
        Ok(out)
    }
}
