//! The x86-64 kernel: a weight block's codes widened to int16 once, then
//! `madd` against each int16 activation row of the tile (16 products per
//! instruction), FMA for the block scales, F16C for the f16 ones.

use std::arch::x86_64::*;

use super::act::Activations;
use super::{BLOCK, Packed, TILE};

/// An f16 (two little-endian bytes at `p`) as f32, with F16C.
#[inline(always)]
unsafe fn half(p: *const u8) -> f32 {
    // SAFETY: the caller's `p` points at two readable bytes; F16C is on
    // (see `tile`).
    unsafe {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }
}

/// An f32 (four little-endian bytes at `p`).
#[inline(always)]
unsafe fn single(p: *const u8) -> f32 {
    // SAFETY: the caller's `p` points at four readable bytes.
    unsafe { f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX is on (see `tile`).
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// [`super::scalar::tile`] with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be one row of
/// `x.blocks()` blocks of `packed`, and `row + t ≤ x.rows()`, `t ≤ TILE`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(
    packed: Packed,
    w: &[u8],
    x: &Activations,
    row: usize,
    t: usize,
    acc: &mut [f32; TILE],
) {
    let nb = x.blocks();
    let size = packed.bytes();
    debug_assert_eq!(w.len(), nb * size);
    debug_assert!(t <= TILE && row + t <= x.rows());
    // SAFETY (of every intrinsic and pointer below): the features are on
    // (this function's contract); each block pointer `p` is `w`'s block
    // `b < nb`, whose `size` bytes cover every read at `p` (codes at
    // offsets 2..34 or 0..48); each activation pointer reads the 32 codes
    // (64 bytes) of block `b` of a row below `x.rows()`.
    unsafe {
        let low = _mm_set1_epi8(0x0f);
        let mut v = [_mm256_setzero_ps(); TILE];
        let mut m = [0f32; TILE];
        let xs: [*const i16; TILE] =
            std::array::from_fn(|r| x.codes((row + r).min(x.rows() - 1)).as_ptr());
        for b in 0..nb {
            let p = w.as_ptr().add(b * size);
            // The block's codes as int16: elements 0..16 and 16..32.
            let (w0, w1) = match packed {
                Packed::Q4_0 | Packed::Q4_1 => {
                    let q = _mm_loadu_si128(p.add(size - 16) as *const __m128i);
                    let lo = _mm_and_si128(q, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
                    (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi))
                }
                Packed::Q8_0 | Packed::K16 => {
                    let at = if packed == Packed::Q8_0 { 2 } else { 0 };
                    let lo = _mm_loadu_si128(p.add(at) as *const __m128i);
                    let hi = _mm_loadu_si128(p.add(at + 16) as *const __m128i);
                    (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
                }
            };
            // The block's scales and minima (per half for K16).
            let (d, mins) = match packed {
                Packed::Q4_0 => {
                    let d = half(p);
                    ([d, d], [-8.0 * d, 0.0])
                }
                Packed::Q4_1 => {
                    let d = half(p);
                    ([d, d], [half(p.add(2)), 0.0])
                }
                Packed::Q8_0 => {
                    let d = half(p);
                    ([d, d], [0.0, 0.0])
                }
                Packed::K16 => (
                    [single(p.add(32)), single(p.add(40))],
                    [single(p.add(36)), single(p.add(44))],
                ),
            };
            for r in 0..t {
                let i = (row + r) * nb + b;
                let dx = *x.d.get_unchecked(i);
                let xp = xs[r].add(b * BLOCK);
                let x0 = _mm256_loadu_si256(xp as *const __m256i);
                let x1 = _mm256_loadu_si256(xp.add(16) as *const __m256i);
                let p0 = _mm256_madd_epi16(w0, x0);
                let p1 = _mm256_madd_epi16(w1, x1);
                if packed == Packed::K16 {
                    let h = *x.halves.get_unchecked(i);
                    m[r] += mins[0] * h[0] + mins[1] * h[1];
                    let (p0, p1) = (_mm256_cvtepi32_ps(p0), _mm256_cvtepi32_ps(p1));
                    v[r] = _mm256_fmadd_ps(p0, _mm256_set1_ps(d[0] * dx), v[r]);
                    v[r] = _mm256_fmadd_ps(p1, _mm256_set1_ps(d[1] * dx), v[r]);
                } else {
                    m[r] += mins[0] * *x.s.get_unchecked(i);
                    let dot = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
                    v[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[0] * dx), v[r]);
                }
            }
        }
        for r in 0..t {
            acc[r] = hsum(v[r]) + m[r];
        }
    }
}
