//! The AArch64 [`Ops`](super::Ops): NEON.

use std::arch::aarch64::*;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{Ops, Partial, Queries, Want, attend_chunk};
use crate::{PagedDecode, Result, Span};

/// AArch64 Advanced SIMD (NEON, part of every AArch64 CPU): four lanes,
/// fused multiply-add, the query or accumulator of a 64-wide head in
/// sixteen of the thirty-two vector registers.
pub(crate) struct Neon;

/// [`super::run`] with NEON.
///
/// # Safety
/// The CPU must support NEON (every AArch64 CPU does).
#[target_feature(enable = "neon")]
pub(crate) unsafe fn run_neon(
    kern: &PagedDecode,
    q: &[f32],
    spans: &[Span<'_>],
    out: &mut [f32],
    mass: Option<&mut [f32]>,
    key_novelty: Option<&mut [f32]>,
) -> Result<()> {
    super::run::<Neon>(kern, q, spans, out, mass, key_novelty)
}

/// [`attend_chunk`] compiled with NEON, so that the primitives inline.
///
/// # Safety
/// The CPU must support NEON.
#[target_feature(enable = "neon")]
unsafe fn attend_neon(
    k: &PagedDecode,
    q: &Queries<'_>,
    spans: &[Span<'_>],
    want: Want,
) -> Result<Partial> {
    attend_chunk::<Neon>(k, q, spans, want)
}

/// `e^x` for `x ≤ 0`, 4 lanes: the AVX2 path's `2^n · p(r)` with the
/// degree-6 Taylor polynomial (relative error below 2e-7).
#[inline(always)]
fn exp4(x: float32x4_t) -> float32x4_t {
    // SAFETY (of the intrinsics in this module): `Neon` only runs on
    // an AArch64 CPU, which has NEON, and every load and store below
    // stays inside the slices it was derived from (the loops step by
    // 4 while `i + 4 <= n`, with `n` bounded by every slice's length).
    unsafe {
        let x = vmaxq_f32(x, vdupq_n_f32(-87.3));
        let n = vrndnq_f32(vmulq_n_f32(x, std::f32::consts::LOG2_E));
        let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_359_4));
        let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
        let mut p = vdupq_n_f32(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = vfmaq_f32(vdupq_n_f32(c), p, r);
        }
        let e = vshlq_n_s32::<23>(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)));
        vmulq_f32(p, vreinterpretq_f32_s32(e))
    }
}

/// [`Ops::scores`] for a head dim of `4·C`: the query stays in `C`
/// registers across the rows.
#[inline(always)]
fn scores_n<const C: usize>(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
    let n = s.len();
    assert!(q.len() == 4 * C && (n == 0 || rows.len() >= (n - 1) * stride + 4 * C));
    // SAFETY: see `exp4`; the assertion bounds every row read.
    unsafe {
        let mut qv = [vdupq_n_f32(0.0); C];
        for (c, v) in qv.iter_mut().enumerate() {
            *v = vld1q_f32(q.as_ptr().add(4 * c));
        }
        for (i, x) in s.iter_mut().enumerate() {
            let r = rows.as_ptr().add(i * stride);
            let (mut a0, mut a1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for c in (0..C).step_by(2) {
                a0 = vfmaq_f32(a0, qv[c], vld1q_f32(r.add(4 * c)));
                a1 = vfmaq_f32(a1, qv[c + 1], vld1q_f32(r.add(4 * c + 4)));
            }
            *x = vaddvq_f32(vaddq_f32(a0, a1));
        }
    }
}

/// [`Ops::accumulate`] for a head dim of `4·C`: the accumulator stays
/// in `C` registers across the rows.
#[inline(always)]
fn accumulate_n<const C: usize>(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
    let n = s.len();
    assert!(acc.len() == 4 * C && (n == 0 || rows.len() >= (n - 1) * stride + 4 * C));
    // SAFETY: see `exp4`; the assertion bounds every row read.
    unsafe {
        let mut av = [vdupq_n_f32(0.0); C];
        for (c, v) in av.iter_mut().enumerate() {
            *v = vld1q_f32(acc.as_ptr().add(4 * c));
        }
        for (i, &p) in s.iter().enumerate() {
            let r = rows.as_ptr().add(i * stride);
            for (c, v) in av.iter_mut().enumerate() {
                *v = vfmaq_n_f32(*v, vld1q_f32(r.add(4 * c)), p * w);
            }
        }
        for (c, v) in av.iter().enumerate() {
            vst1q_f32(acc.as_mut_ptr().add(4 * c), *v);
        }
    }
}

impl Ops for Neon {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // SAFETY: see `exp4`.
        unsafe {
            let (mut s0, mut s1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            let mut i = 0;
            while i + 8 <= n {
                s0 = vfmaq_f32(s0, vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
                s1 = vfmaq_f32(s1, vld1q_f32(pa.add(i + 4)), vld1q_f32(pb.add(i + 4)));
                i += 8;
            }
            if i + 4 <= n {
                s0 = vfmaq_f32(s0, vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
                i += 4;
            }
            let mut s = vaddvq_f32(vaddq_f32(s0, s1));
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    #[inline(always)]
    fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
        let n = acc.len().min(x.len());
        let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
        // SAFETY: see `exp4`.
        unsafe {
            let mut i = 0;
            while i + 4 <= n {
                let a = vld1q_f32(pa.add(i));
                vst1q_f32(pa.add(i), vfmaq_n_f32(a, vld1q_f32(px.add(i)), w));
                i += 4;
            }
            while i < n {
                acc[i] += w * x[i];
                i += 1;
            }
        }
    }

    #[inline(always)]
    fn scale(acc: &mut [f32], f: f32) {
        let n = acc.len();
        let pa = acc.as_mut_ptr();
        // SAFETY: see `exp4`.
        unsafe {
            let mut i = 0;
            while i + 4 <= n {
                vst1q_f32(pa.add(i), vmulq_n_f32(vld1q_f32(pa.add(i)), f));
                i += 4;
            }
            while i < n {
                acc[i] *= f;
                i += 1;
            }
        }
    }

    #[inline(always)]
    fn exp_sum(s: &mut [f32], m: f32) -> f32 {
        let n = s.len();
        let ps = s.as_mut_ptr();
        // SAFETY: see `exp4`.
        unsafe {
            let mv = vdupq_n_f32(m);
            let mut acc = vdupq_n_f32(0.0);
            let mut i = 0;
            while i + 4 <= n {
                let e = exp4(vsubq_f32(vld1q_f32(ps.add(i)), mv));
                vst1q_f32(ps.add(i), e);
                acc = vaddq_f32(acc, e);
                i += 4;
            }
            let mut sum = vaddvq_f32(acc);
            while i < n {
                s[i] = (s[i] - m).exp();
                sum += s[i];
                i += 1;
            }
            sum
        }
    }

    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        // `half` converts with the FP16 instructions where the CPU has
        // them (NEON's own conversion intrinsics need unstable `f16`).
        let n = src.len().min(dst.len());
        src[..n].convert_to_f32_slice(&mut dst[..n]);
    }

    #[inline(always)]
    fn scores(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
        match q.len() {
            64 => scores_n::<16>(q, rows, stride, s),
            _ => s.iter_mut().enumerate().for_each(|(i, x)| {
                *x = Self::dot(q, &rows[i * stride..]);
            }),
        }
    }

    #[inline(always)]
    fn accumulate(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
        match acc.len() {
            64 => accumulate_n::<16>(acc, s, w, rows, stride),
            _ => s.iter().enumerate().for_each(|(i, &p)| {
                Self::axpy(acc, p * w, &rows[i * stride..]);
            }),
        }
    }

    fn attend(k: &PagedDecode, q: &Queries<'_>, spans: &[Span<'_>], want: Want) -> Result<Partial> {
        // SAFETY: `Neon` only runs on an AArch64 CPU (NEON is part of
        // the architecture).
        unsafe { attend_neon(k, q, spans, want) }
    }
}
