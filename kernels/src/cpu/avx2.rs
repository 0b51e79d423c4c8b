//! The x86-64 [`Ops`](super::Ops): AVX2, FMA and F16C.

use std::arch::x86_64::*;

use half::f16;

use super::{Ops, Partial, Queries, Want, attend_chunk};
use crate::{PagedDecode, Result, Span};

/// AVX2 + FMA + F16C. Its methods may only run on a CPU that has them
/// (the kernel checks before it picks this set).
pub(crate) struct Avx2;

/// [`super::run`] with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn run_avx2(
    kern: &PagedDecode,
    q: &[f32],
    spans: &[Span<'_>],
    out: &mut [f32],
    mass: Option<&mut [f32]>,
    key_novelty: Option<&mut [f32]>,
) -> Result<()> {
    super::run::<Avx2>(kern, q, spans, out, mass, key_novelty)
}

/// [`attend_chunk`] compiled with AVX2, so that the primitives inline.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(
    k: &PagedDecode,
    q: &Queries<'_>,
    spans: &[Span<'_>],
    want: Want,
) -> Result<Partial> {
    attend_chunk::<Avx2>(k, q, spans, want)
}

#[inline(always)]
fn hsum(v: __m256) -> f32 {
    // SAFETY (of the intrinsics in this module): `Avx2` is only used
    // on a CPU with AVX2, FMA and F16C (see the type), and every load
    // and store below stays inside the slices it was derived from
    // (the loops step by 8 while `i + 8 <= n`, with `n` bounded by
    // every slice's length).
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// `e^x` for `x ≤ 0`, 8 lanes: `2^n · p(r)` with `x = n·ln2 + r`,
/// `|r| ≤ ln2/2`, `p` the degree-6 Taylor polynomial (relative error
/// below 2e-7). Inputs below −87.3 give about 1e-38 instead of less.
#[inline(always)]
fn exp8(x: __m256) -> __m256 {
    // SAFETY: see `hsum`.
    unsafe {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }
}

/// [`Ops::scores`] for a head dim of `8·C`: the query stays in `C`
/// registers across the rows.
#[inline(always)]
fn scores_n<const C: usize>(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
    let n = s.len();
    assert!(q.len() == 8 * C && (n == 0 || rows.len() >= (n - 1) * stride + 8 * C));
    // SAFETY: see `hsum`; the assertion bounds every row read.
    unsafe {
        let mut qv = [_mm256_setzero_ps(); C];
        for (c, v) in qv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(q.as_ptr().add(8 * c));
        }
        for (i, x) in s.iter_mut().enumerate() {
            let r = rows.as_ptr().add(i * stride);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in (0..C).step_by(2) {
                a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(r.add(8 * c)), a0);
                a1 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(r.add(8 * c + 8)), a1);
            }
            *x = hsum(_mm256_add_ps(a0, a1));
        }
    }
}

/// [`Ops::accumulate`] for a head dim of `8·C`: the accumulator stays
/// in `C` registers across the rows.
#[inline(always)]
fn accumulate_n<const C: usize>(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
    let n = s.len();
    assert!(acc.len() == 8 * C && (n == 0 || rows.len() >= (n - 1) * stride + 8 * C));
    // SAFETY: see `hsum`; the assertion bounds every row read.
    unsafe {
        let mut av = [_mm256_setzero_ps(); C];
        for (c, v) in av.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(acc.as_ptr().add(8 * c));
        }
        for (i, &p) in s.iter().enumerate() {
            let r = rows.as_ptr().add(i * stride);
            let pw = _mm256_set1_ps(p * w);
            for (c, v) in av.iter_mut().enumerate() {
                *v = _mm256_fmadd_ps(pw, _mm256_loadu_ps(r.add(8 * c)), *v);
            }
        }
        for (c, v) in av.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(8 * c), *v);
        }
    }
}

impl Ops for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // SAFETY: see `hsum`.
        unsafe {
            let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                s1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    s1,
                );
                i += 16;
            }
            if i + 8 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                i += 8;
            }
            let mut s = hsum(_mm256_add_ps(s0, s1));
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
        // SAFETY: see `hsum`.
        unsafe {
            let wv = _mm256_set1_ps(w);
            let mut i = 0;
            while i + 8 <= n {
                let a = _mm256_loadu_ps(pa.add(i));
                _mm256_storeu_ps(
                    pa.add(i),
                    _mm256_fmadd_ps(wv, _mm256_loadu_ps(px.add(i)), a),
                );
                i += 8;
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
        // SAFETY: see `hsum`.
        unsafe {
            let fv = _mm256_set1_ps(f);
            let mut i = 0;
            while i + 8 <= n {
                _mm256_storeu_ps(pa.add(i), _mm256_mul_ps(fv, _mm256_loadu_ps(pa.add(i))));
                i += 8;
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
        // SAFETY: see `hsum`.
        unsafe {
            let mv = _mm256_set1_ps(m);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ps.add(i)), mv));
                _mm256_storeu_ps(ps.add(i), e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            let mut sum = hsum(acc);
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
        let n = src.len().min(dst.len());
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        // SAFETY: see `hsum`; `f16` is a `u16` in memory.
        unsafe {
            let mut i = 0;
            while i + 8 <= n {
                let h = _mm_loadu_si128(ps.add(i).cast::<__m128i>());
                _mm256_storeu_ps(pd.add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
            while i < n {
                dst[i] = src[i].to_f32();
                i += 1;
            }
        }
    }

    #[inline(always)]
    fn scores(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
        match q.len() {
            64 => scores_n::<8>(q, rows, stride, s),
            128 => scores_n::<16>(q, rows, stride, s),
            _ => s.iter_mut().enumerate().for_each(|(i, x)| {
                *x = Self::dot(q, &rows[i * stride..]);
            }),
        }
    }

    #[inline(always)]
    fn accumulate(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
        match acc.len() {
            64 => accumulate_n::<8>(acc, s, w, rows, stride),
            128 => accumulate_n::<16>(acc, s, w, rows, stride),
            _ => s.iter().enumerate().for_each(|(i, &p)| {
                Self::axpy(acc, p * w, &rows[i * stride..]);
            }),
        }
    }

    fn attend(k: &PagedDecode, q: &Queries<'_>, spans: &[Span<'_>], want: Want) -> Result<Partial> {
        // SAFETY: `Avx2` only runs on a CPU with AVX2, FMA and F16C.
        unsafe { attend_avx2(k, q, spans, want) }
    }
}
