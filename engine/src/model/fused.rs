//! RMSNorm, RoPE and SwiGLU's gate on contiguous f32 CPU tensors through
//! `kvforge_kernels::rowwise`'s loops: a decode step on GGUF blocks spends
//! more time in libtorch's small ops (about eight dispatches for a norm,
//! nine for a rotation) than in their arithmetic. Each function answers
//! `None` when its inputs are not all f32 on the CPU, are empty, or hold
//! more than [`MAX_ROWS`] rows (a long prompt chunk: there libtorch's
//! vectorized, threaded ops win; decode steps, small batches and chunks of
//! up to 32 tokens take the loops); the caller then runs the libtorch ops,
//! which compute the same values in another order. [`values`] and
//! [`output`], the model's one way to read and write a CPU tensor's f32
//! values in place, serve `weight.rs` too.

use kvforge_kernels::rowwise;
use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// Rows up to which the loops here run (decode steps, small batches,
/// short prompt chunks).
pub(super) const MAX_ROWS: i64 = 32;

/// `t` as a contiguous f32 CPU tensor, or `None` when it is not f32 on the
/// CPU.
fn cpu_f32(t: &Tensor) -> Result<Option<Tensor>> {
    if t.device() != Device::Cpu || t.kind() != Kind::Float {
        return Ok(None);
    }
    Ok(Some(t.f_contiguous()?))
}

/// Whether `t` holds values (libtorch's data pointer of an empty tensor
/// is null) in at most [`MAX_ROWS`] rows of its first dimension.
fn few_rows(t: &Tensor) -> bool {
    t.numel() > 0 && t.size().first().is_some_and(|&r| r <= MAX_ROWS)
}

/// The values of `t`, a contiguous f32 CPU tensor (empty for one without
/// elements, whose data pointer libtorch leaves null).
///
/// # Safety
/// `t` must be a contiguous f32 CPU tensor.
pub(super) unsafe fn values(t: &Tensor) -> &[f32] {
    if t.numel() == 0 {
        return &[];
    }
    // SAFETY: the caller's contract, and `numel > 0` makes the pointer
    // non-null; the slice borrows `t`, which keeps its storage alive.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, t.numel()) }
}

/// A new f32 CPU tensor of `size`, its values written by `fill` (not
/// called when the tensor has no elements).
pub(super) fn output(size: &[i64], fill: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<Tensor> {
    let out = Tensor::f_empty(size, (Kind::Float, Device::Cpu))?;
    if out.numel() == 0 {
        return Ok(out);
    }
    // SAFETY: `out` is a new contiguous f32 CPU tensor of `numel > 0`
    // elements (a non-null pointer) that nothing else references while
    // `fill` writes them.
    let values = unsafe { std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, out.numel()) };
    fill(values)?;
    Ok(out)
}

/// `x / sqrt(mean(x²) + eps) · w` over the last dimension of `x`.
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    if !few_rows(x) {
        return Ok(None);
    }
    let (Some(x), Some(w)) = (cpu_f32(x)?, cpu_f32(w)?) else {
        return Ok(None);
    };
    let d = w.numel();
    if d == 0 || x.size().last().copied() != Some(d as i64) {
        return Ok(None);
    }
    // SAFETY: both made contiguous f32 CPU tensors by `cpu_f32`.
    let (xs, ws) = unsafe { (values(&x), values(&w)) };
    let out = output(&x.size(), |os| Ok(rowwise::rms_norm(xs, ws, eps, os)?))?;
    Ok(Some(out))
}

/// RoPE in the `rotate_half` layout: `x` `[rows, heads, head_dim]`, row
/// `i` rotated by `cos[i]`, `sin[i]` (`[rows, head_dim]`).
pub(super) fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    if !few_rows(x) {
        return Ok(None);
    }
    let (Some(x), Some(cos), Some(sin)) = (cpu_f32(x)?, cpu_f32(cos)?, cpu_f32(sin)?) else {
        return Ok(None);
    };
    let size = x.size();
    let [rows, heads, hd] = size[..] else {
        return Ok(None);
    };
    let (rows, heads, hd) = (rows as usize, heads as usize, hd as usize);
    if hd % 2 != 0 || cos.numel() != rows * hd || sin.numel() != rows * hd {
        return Ok(None);
    }
    // SAFETY: all made contiguous f32 CPU tensors by `cpu_f32`.
    let (xs, cs, ss) = unsafe { (values(&x), values(&cos), values(&sin)) };
    let out = output(&size, |os| Ok(rowwise::rope(xs, cs, ss, heads, hd, os)?))?;
    Ok(Some(out))
}

/// SwiGLU's `silu(gate) · up`.
pub(super) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    if !few_rows(gate) {
        return Ok(None);
    }
    let (Some(g), Some(u)) = (cpu_f32(gate)?, cpu_f32(up)?) else {
        return Ok(None);
    };
    if g.size() != u.size() {
        return Ok(None);
    }
    // SAFETY: both made contiguous f32 CPU tensors by `cpu_f32`.
    let (gs, us) = unsafe { (values(&g), values(&u)) };
    let out = output(&g.size(), |os| Ok(rowwise::swiglu(gs, us, os)?))?;
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn randn(size: &[i64], seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(size, (Kind::Float, Device::Cpu))
    }

    /// Largest |a − b| over the largest |b|.
    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).abs().max().double_value(&[]);
        d / b.abs().max().double_value(&[])
    }

    // The loops against libtorch's ops on the same values. Each output is a
    // handful of roundings from the same inputs (f32 epsilon 1.2e-7); 1e-5
    // leaves a margin of about 80 for summation order and exp's ulps.
    const TOL: f64 = 1e-5;

    #[test]
    fn rms_norm_matches_libtorch() {
        let (x, w) = (randn(&[5, 64], 1), randn(&[64], 2));
        let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let want = &x * (var + 1e-5).rsqrt() * &w;
        let got = rms_norm(&x, &w, 1e-5).unwrap().unwrap();
        assert!(rel(&got, &want) < TOL, "{}", rel(&got, &want));
    }

    #[test]
    fn rotate_matches_rotate_half() {
        let (x, cos, sin) = (randn(&[3, 4, 8], 3), randn(&[3, 8], 4), randn(&[3, 8], 5));
        let (x1, x2) = (x.narrow(-1, 0, 4), x.narrow(-1, 4, 4));
        let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
        let want = &x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
        let got = rotate(&x, &cos, &sin).unwrap().unwrap();
        assert!(rel(&got, &want) < TOL, "{}", rel(&got, &want));
        // A transposed input is read in its logical order.
        let t = x.transpose(0, 1).contiguous().transpose(0, 1);
        let got = rotate(&t, &cos, &sin).unwrap().unwrap();
        assert!(rel(&got, &want) < TOL);
    }

    #[test]
    fn swiglu_matches_silu_times_up() {
        let (g, u) = (randn(&[2, 96], 6) * 4.0, randn(&[2, 96], 7));
        let want = g.silu() * &u;
        let got = swiglu(&g, &u).unwrap().unwrap();
        assert!(rel(&got, &want) < TOL, "{}", rel(&got, &want));
    }

    #[test]
    fn other_dtypes_and_prompt_chunks_fall_back_to_libtorch() {
        let w = randn(&[64], 2);
        let half = randn(&[2, 64], 1).to_kind(Kind::Half);
        assert!(rms_norm(&half, &w, 1e-5).unwrap().is_none());
        let long = randn(&[MAX_ROWS + 1, 64], 1);
        assert!(rms_norm(&long, &w, 1e-5).unwrap().is_none());
        assert!(swiglu(&long, &long).unwrap().is_none());
        let x = randn(&[2, 4, 8], 3);
        let wrong = randn(&[2, 6], 4);
        assert!(rotate(&x, &wrong, &wrong).unwrap().is_none());
        // No rows: libtorch's data pointer is null, so the loops decline.
        let empty = randn(&[0, 64], 1);
        assert!(rms_norm(&empty, &w, 1e-5).unwrap().is_none());
        assert!(swiglu(&empty, &empty).unwrap().is_none());
        let none = randn(&[0, 4, 8], 3);
        assert!(
            rotate(&none, &randn(&[0, 8], 4), &randn(&[0, 8], 5))
                .unwrap()
                .is_none()
        );
    }
}
