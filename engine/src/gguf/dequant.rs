//! ggml's block formats back to f32: F32/F16/BF16, the legacy Q5_0 / Q5_1
//! blocks and Q8_K here; Q4_0 / Q4_1 / Q8_0 and the K-quants Q4_K / Q5_K /
//! Q6_K by `kvforge-kernels`, whose quantized matmul reads those blocks
//! (one decoder for both paths).

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
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K => match dtype.weight_format() {
            Some(f) => f.dequantize(bytes),
            None => Vec::new(),
        },
        GgmlType::Q5_0 | GgmlType::Q5_1 => q5(bytes, dtype == GgmlType::Q5_1),
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
