//! The per-row operations of a LLaMA layer as plain loops over f32
//! slices: RMSNorm, RoPE in the `rotate_half` layout, and SwiGLU's
//! `silu(gate) · up`. A decode step on quantized weights spends more time
//! dispatching libtorch's small ops (about eight for a norm, nine for a
//! rotation) than in their arithmetic; these run in one pass each. They
//! are written for the compiler to vectorize (no `std::arch`), and every
//! length is checked before a value is written.

use crate::{KernelError, Result};

fn shape(msg: String) -> KernelError {
    KernelError::Shape(msg)
}

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) · w` for each row `r` of
/// `x` (rows of `w.len()` values; the sum of squares in f64).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f64, out: &mut [f32]) -> Result<()> {
    let d = w.len();
    if d == 0 || !x.len().is_multiple_of(d) || out.len() != x.len() {
        return Err(shape(format!(
            "rms_norm: {} values and {} outputs in rows of {d}",
            x.len(),
            out.len()
        )));
    }
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / d as f64 + eps).sqrt()) as f32;
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(w) {
            *o = v * scale * g;
        }
    }
    Ok(())
}

/// RoPE in the `rotate_half` layout over rows of `heads` vectors of
/// `head_dim` (even) values, row `i` rotated by `cos[i]`, `sin[i]` (rows
/// of `head_dim`): `out[j] = x[j]·cos[j] − x[j+h]·sin[j]` and
/// `out[j+h] = x[j+h]·cos[j+h] + x[j]·sin[j+h]`, `h = head_dim / 2`.
pub fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    head_dim: usize,
    out: &mut [f32],
) -> Result<()> {
    let rows = cos.len() / head_dim.max(1);
    if head_dim == 0
        || !head_dim.is_multiple_of(2)
        || cos.len() != rows * head_dim
        || sin.len() != cos.len()
        || x.len() != rows * heads * head_dim
        || out.len() != x.len()
    {
        return Err(shape(format!(
            "rope: {} values and {} outputs do not make rows of {heads} heads of {head_dim} \
             (even) for {} cos and {} sin",
            x.len(),
            out.len(),
            cos.len(),
            sin.len()
        )));
    }
    let half = head_dim / 2;
    let row = heads * head_dim;
    let rows = x.chunks_exact(row).zip(out.chunks_exact_mut(row));
    let angles = cos.chunks_exact(head_dim).zip(sin.chunks_exact(head_dim));
    for ((xr, or), (c, s)) in rows.zip(angles) {
        let ((ca, cb), (sa, sb)) = (c.split_at(half), s.split_at(half));
        for (xh, oh) in xr.chunks_exact(head_dim).zip(or.chunks_exact_mut(head_dim)) {
            let (a, b) = xh.split_at(half);
            let (oa, ob) = oh.split_at_mut(half);
            for j in 0..half {
                oa[j] = a[j] * ca[j] - b[j] * sa[j];
                ob[j] = b[j] * cb[j] + a[j] * sb[j];
            }
        }
    }
    Ok(())
}

/// `out = silu(gate) · up`, element by element.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    if up.len() != gate.len() || out.len() != gate.len() {
        return Err(shape(format!(
            "swiglu: {} gates, {} ups, {} outputs",
            gate.len(),
            up.len(),
            out.len()
        )));
    }
    for ((o, &a), &b) in out.iter_mut().zip(gate).zip(up) {
        *o = a / (1.0 + (-a).exp()) * b;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn rms_norm_scales_each_row_to_unit_rms() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0];
        let w = [1.0, 2.0];
        let mut out = [0.0; 6];
        rms_norm(&x, &w, 0.0, &mut out).unwrap();
        // Row 1: rms = sqrt(12.5); row 2 is all zeros (eps 0 gives NaN,
        // so it is checked with eps below); row 3: rms 1.
        let r = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
        assert_eq!(&out[4..], &[1.0, 2.0]);
        rms_norm(&x, &w, 1e-6, &mut out).unwrap();
        assert_eq!(&out[2..4], &[0.0, 0.0]);
    }

    #[test]
    fn rope_rotates_each_pair_by_its_rows_angle() {
        // One row, two heads of 4: pairs (x0, x2) and (x1, x3) rotated.
        let t = 0.5f32;
        let (c, s) = (t.cos(), t.sin());
        let cos = [c, 1.0, c, 1.0];
        let sin = [s, 0.0, s, 0.0];
        let x = [1.0, 2.0, 0.0, 3.0, 0.0, 1.0, 1.0, 0.0];
        let mut out = [0.0; 8];
        rope(&x, &cos, &sin, 2, 4, &mut out).unwrap();
        let want = [c, 2.0, s, 3.0, -s, 1.0, c, 0.0];
        for (g, w) in out.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{out:?}");
        }
    }

    #[test]
    fn swiglu_is_silu_of_the_gate_times_up() {
        let mut out = [0.0; 3];
        swiglu(&[0.0, 2.0, -2.0], &[5.0, 1.0, 3.0], &mut out).unwrap();
        let silu = |a: f32| a / (1.0 + (-a).exp());
        for (g, w) in out.iter().zip([0.0, silu(2.0), 3.0 * silu(-2.0)]) {
            assert!((g - w).abs() < 1e-6, "{out:?}");
        }
    }

    #[test]
    fn lengths_that_do_not_fit_are_errors() {
        let mut out = [0.0; 4];
        assert!(rms_norm(&[1.0; 3], &[1.0; 2], 1e-5, &mut [0.0; 3]).is_err());
        assert!(rms_norm(&[1.0; 4], &[], 1e-5, &mut out).is_err());
        assert!(rope(&[1.0; 4], &[1.0; 3], &[1.0; 3], 1, 3, &mut out).is_err());
        assert!(rope(&[1.0; 4], &[1.0; 4], &[1.0; 2], 1, 4, &mut out).is_err());
        assert!(rope(&[1.0; 4], &[1.0; 2], &[1.0; 2], 1, 2, &mut out).is_err());
        assert!(swiglu(&[1.0; 4], &[1.0; 3], &mut out).is_err());
        assert_eq!(out, [0.0; 4], "nothing written");
    }
}
