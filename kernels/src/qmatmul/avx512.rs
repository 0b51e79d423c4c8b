//! The AVX-512 kernel: [`super::avx2`]'s scheme at twice the width. A
//! weight block's 32 codes widen to int16 in one register, and one `madd`
//! per activation row takes the whole block (32 products, 16 pair sums)
//! where AVX2 needs two; the f32 accumulator holds 16 lanes.

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

/// [`super::scalar::tile`] with AVX-512 (F and BW).
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW, AVX2, FMA and F16C; `w` must
/// be one row of `x.blocks()` blocks of `packed`, and `row + t ≤
/// x.rows()`, `t ≤ TILE`.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
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
        let mut v = [_mm512_setzero_ps(); TILE];
        let mut m = [0f32; TILE];
        let xs: [*const i16; TILE] =
            std::array::from_fn(|r| x.codes((row + r).min(x.rows() - 1)).as_ptr());
        for b in 0..nb {
            let p = w.as_ptr().add(b * size);
            // The block's 32 codes as int16, in element order.
            let wq = match packed {
                Packed::Q4_0 | Packed::Q4_1 => {
                    let q = _mm_loadu_si128(p.add(size - 16) as *const __m128i);
                    let lo = _mm_and_si128(q, low);
                    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
                    _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo))
                }
                Packed::Q8_0 | Packed::K16 => {
                    let at = if packed == Packed::Q8_0 { 2 } else { 0 };
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(p.add(at) as *const __m256i))
                }
            };
            // The block's scales and minima (per half for K16: the pair
            // sums of elements 0..16 land in lanes 0..8, of 16..32 in
            // lanes 8..16).
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
                let xq = _mm512_loadu_si512(xp as *const __m512i);
                let dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(wq, xq));
                if packed == Packed::K16 {
                    let h = *x.halves.get_unchecked(i);
                    m[r] += mins[0] * h[0] + mins[1] * h[1];
                    let scale = _mm512_mask_blend_ps(
                        0xff00,
                        _mm512_set1_ps(d[0] * dx),
                        _mm512_set1_ps(d[1] * dx),
                    );
                    v[r] = _mm512_fmadd_ps(dot, scale, v[r]);
                } else {
                    m[r] += mins[0] * *x.s.get_unchecked(i);
                    v[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(d[0] * dx), v[r]);
                }
            }
        }
        for r in 0..t {
            acc[r] = _mm512_reduce_add_ps(v[r]) + m[r];
        }
    }
}
