//! The plain-Rust twin: the integer dot of each block, then its scales,
//! in the order the SIMD kernels follow (block by block, one float
//! accumulator per row), so the two differ only by float rounding.

use super::act::Activations;
use super::{BLOCK, Packed, TILE, f16_at};

/// Weight `j` of a K16 group: its code, and the (scale, minimum) pair of
/// its half.
fn k16_pair(blk: &[u8], half: usize) -> (f32, f32) {
    let at = 32 + 8 * half;
    let f = |o: usize| f32::from_le_bytes([blk[o], blk[o + 1], blk[o + 2], blk[o + 3]]);
    (f(at), f(at + 4))
}

/// One packed row as f32.
pub(super) fn dequantize(packed: Packed, row: &[u8], out: &mut [f32]) {
    for (blk, o) in row
        .chunks_exact(packed.bytes())
        .zip(out.chunks_exact_mut(BLOCK))
    {
        match packed {
            Packed::Q4_0 | Packed::Q4_1 => {
                let d = f16_at(blk, 0);
                let affine = packed == Packed::Q4_1;
                let m = if affine { f16_at(blk, 2) } else { 0.0 };
                let codes = if affine { &blk[4..20] } else { &blk[2..18] };
                let value = |q: u8| match affine {
                    true => f32::from(q) * d + m,
                    false => (f32::from(q) - 8.0) * d,
                };
                for (j, &q) in codes.iter().enumerate() {
                    o[j] = value(q & 0x0f);
                    o[j + 16] = value(q >> 4);
                }
            }
            Packed::Q8_0 => {
                let d = f16_at(blk, 0);
                for (v, &q) in o.iter_mut().zip(&blk[2..34]) {
                    *v = f32::from(q as i8) * d;
                }
            }
            Packed::K16 => {
                for (j, v) in o.iter_mut().enumerate() {
                    let (d, m) = k16_pair(blk, j / 16);
                    *v = d * f32::from(blk[j] as i8) + m;
                }
            }
        }
    }
}

/// The integer dots of one weight block's codes `w` (32, in element order)
/// with activation codes `x`: over the whole block and over each half.
fn idot(w: &[i32; BLOCK], x: &[i16]) -> [i32; 2] {
    let mut s = [0i32; 2];
    for (j, (&a, &b)) in w.iter().zip(x).enumerate() {
        s[j / 16] += a * i32::from(b);
    }
    s
}

/// `acc[r] = w · x[row + r]` for `r < t`: one weight row against `t`
/// activation rows from `row`.
pub(super) fn tile(
    packed: Packed,
    w: &[u8],
    x: &Activations,
    row: usize,
    t: usize,
    acc: &mut [f32; TILE],
) {
    let nb = x.blocks();
    let mut codes = [0i32; BLOCK];
    for (b, blk) in w.chunks_exact(packed.bytes()).enumerate() {
        match packed {
            Packed::Q4_0 | Packed::Q4_1 => {
                let q = if packed == Packed::Q4_1 {
                    &blk[4..20]
                } else {
                    &blk[2..18]
                };
                for (j, &c) in q.iter().enumerate() {
                    codes[j] = i32::from(c & 0x0f);
                    codes[j + 16] = i32::from(c >> 4);
                }
            }
            Packed::Q8_0 => {
                for (c, &q) in codes.iter_mut().zip(&blk[2..34]) {
                    *c = i32::from(q as i8);
                }
            }
            Packed::K16 => {
                for (c, &q) in codes.iter_mut().zip(&blk[..32]) {
                    *c = i32::from(q as i8);
                }
            }
        }
        for (r, a) in acc.iter_mut().enumerate().take(t) {
            let i = (row + r) * nb + b;
            let xq = &x.codes(row + r)[b * BLOCK..(b + 1) * BLOCK];
            let dx = x.d[i];
            let s = idot(&codes, xq);
            *a += match packed {
                Packed::Q4_0 => f16_at(blk, 0) * (dx * (s[0] + s[1]) as f32 - 8.0 * x.s[i]),
                Packed::Q4_1 => {
                    f16_at(blk, 0) * (dx * (s[0] + s[1]) as f32) + f16_at(blk, 2) * x.s[i]
                }
                Packed::Q8_0 => f16_at(blk, 0) * (dx * (s[0] + s[1]) as f32),
                Packed::K16 => {
                    let (d0, m0) = k16_pair(blk, 0);
                    let (d1, m1) = k16_pair(blk, 1);
                    let h = x.halves[i];
                    d0 * (dx * s[0] as f32) + m0 * h[0] + d1 * (dx * s[1] as f32) + m1 * h[1]
                }
            };
        }
    }
}
