//! ggml's block formats back to f32: F32/F16/BF16, the legacy Q4_0 / Q4_1
//! / Q5_0 / Q5_1 / Q8_0 blocks and the K-quants.

use half::{bf16, f16};

use super::*;

/// Dequantizes raw GGML data. `bytes` holds whole blocks.
pub fn dequantize(dtype: GgmlType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(h).collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        GgmlType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * 32);
            for blk in bytes.chunks_exact(34) {
                let d = h(&blk[..2]);
                out.extend(blk[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
            out
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => q4(bytes, dtype == GgmlType::Q4_1),
        GgmlType::Q5_0 | GgmlType::Q5_1 => q5(bytes, dtype == GgmlType::Q5_1),
        GgmlType::Q4_K | GgmlType::Q5_K => q45_k(bytes, dtype == GgmlType::Q5_K),
        GgmlType::Q6_K => q6_k(bytes),
        GgmlType::Q8_K => {
            let mut out = Vec::with_capacity(bytes.len() / 292 * 256);
            for blk in bytes.chunks_exact(292) {
                let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                out.extend(blk[4..260].iter().map(|&q| f32::from(q as i8) * d));
            }
            out
        }
    }
}

/// An f16 from its two little-endian bytes.
fn h(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Q4_0 (scale, codes − 8) and Q4_1 (`affine`: scale and minimum) blocks
/// of 32: low nibbles first, then high nibbles.
fn q4(bytes: &[u8], affine: bool) -> Vec<f32> {
    let size = if affine { 20 } else { 18 };
    let mut out = vec![0f32; bytes.len() / size * 32];
    for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(32)) {
        let d = h(&blk[..2]);
        let m = if affine { h(&blk[2..4]) } else { 0.0 };
        // The same arithmetic as ggml's, to the last bit.
        let value = |q: u8| match affine {
            true => f32::from(q) * d + m,
            false => (f32::from(q) - 8.0) * d,
        };
        let codes = if affine { &blk[4..] } else { &blk[2..] };
        for (j, &q) in codes.iter().enumerate() {
            o[j] = value(q & 0x0f);
            o[j + 16] = value(q >> 4);
        }
    }
    out
}

/// Q5_0 and Q5_1 (`affine`) blocks of 32: a nibble plus one bit of a
/// 32-bit word of high bits.
fn q5(bytes: &[u8], affine: bool) -> Vec<f32> {
    let size = if affine { 24 } else { 22 };
    let mut out = vec![0f32; bytes.len() / size * 32];
    for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(32)) {
        let d = h(&blk[..2]);
        let (m, rest) = if affine {
            (h(&blk[2..4]), &blk[4..])
        } else {
            (-16.0 * d, &blk[2..])
        };
        let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        for (j, &q) in rest[4..20].iter().enumerate() {
            let lo = u32::from(q & 0x0f) | ((qh >> j) & 1) << 4;
            let hi = u32::from(q >> 4) | ((qh >> (j + 16)) & 1) << 4;
            o[j] = lo as f32 * d + m;
            o[j + 16] = hi as f32 * d + m;
        }
    }
    out
}

/// Q4_K and Q5_K (`five`) super-blocks of 256: eight sub-blocks with 6-bit
/// scales and minima.
fn q45_k(bytes: &[u8], five: bool) -> Vec<f32> {
    let size = if five { 176 } else { 144 };
    let mut out = vec![0f32; bytes.len() / size * 256];
    for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(256)) {
        let (d, dmin) = (h(&blk[..2]), h(&blk[2..4]));
        let scales = &blk[4..16];
        let (qh, qs) = if five {
            (&blk[16..48], &blk[48..176])
        } else {
            (&blk[16..16], &blk[16..144])
        };
        // Four chunks of 64: the low nibbles of 32 bytes (sub-block 2j),
        // then their high nibbles (2j + 1); Q5_K takes bit 2j or 2j + 1 of
        // `qh` as the fifth bit.
        for j in 0..4 {
            let q = &qs[32 * j..32 * j + 32];
            for (half, shift) in [(0usize, 0u32), (1, 4)] {
                let sub = 2 * j + half;
                let (sc, mn) = scale_min_k4(sub, scales);
                let (d1, m1) = (d * f32::from(sc), dmin * f32::from(mn));
                let base = 64 * j + 32 * half;
                for l in 0..32 {
                    let mut v = u32::from((q[l] >> shift) & 0x0f);
                    if five && (qh[l] >> sub) & 1 == 1 {
                        v += 16;
                    }
                    o[base + l] = d1 * v as f32 - m1;
                }
            }
        }
    }
    out
}

/// Q6_K super-blocks of 256: 4 low bits, 2 high bits, 8-bit scales per 16.
fn q6_k(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; bytes.len() / 210 * 256];
    for (blk, o) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
        let d = h(&blk[208..210]);
        for n in 0..2 {
            let ql = &blk[64 * n..64 * n + 64];
            let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
            let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
            let y = &mut o[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q = |lo: u8, shift: u32| {
                    (i32::from(lo & 0x0f) | i32::from((qh[l] >> shift) & 3) << 4) - 32
                };
                let s = |k: usize| d * f32::from(sc[is + k] as i8);
                y[l] = s(0) * q(ql[l], 0) as f32;
                y[l + 32] = s(2) * q(ql[l + 32], 2) as f32;
                y[l + 64] = s(4) * q(ql[l] >> 4, 4) as f32;
                y[l + 96] = s(6) * q(ql[l + 32] >> 4, 6) as f32;
            }
        }
    }
    out
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K / Q5_K block
/// (llama.cpp's `get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
