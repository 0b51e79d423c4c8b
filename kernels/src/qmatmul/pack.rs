//! The K-quants' super-blocks of 256 repacked into [`Packed::K16`]
//! (`super::Packed::K16`): per 32 weights, their int8 codes and one f32
//! (scale, minimum) pair per 16, so that weight `j` is exactly ggml's
//! `scale·code + minimum` (its `d·sc·q − dmin·m`).

use super::{WeightFormat, f16_at};

/// Codes and per-16 (scale, minimum) of one super-block.
struct Super {
    codes: [i8; 256],
    scale: [f32; 16],
    min: [f32; 16],
}

/// `bytes` (whole super-blocks of `format`, a K-quant) as K16 groups.
pub(super) fn k16(format: WeightFormat, bytes: &[u8]) -> Vec<u8> {
    let (_, size) = format.block();
    let mut out = Vec::with_capacity(bytes.len() / size * 8 * 48);
    let mut s = Super {
        codes: [0; 256],
        scale: [0.0; 16],
        min: [0.0; 16],
    };
    for blk in bytes.chunks_exact(size) {
        match format {
            WeightFormat::Q4_K => q45_k(blk, false, &mut s),
            WeightFormat::Q5_K => q45_k(blk, true, &mut s),
            _ => q6_k(blk, &mut s),
        }
        for g in 0..8 {
            out.extend(s.codes[32 * g..32 * g + 32].iter().map(|&c| c as u8));
            for h in [2 * g, 2 * g + 1] {
                out.extend_from_slice(&s.scale[h].to_le_bytes());
                out.extend_from_slice(&s.min[h].to_le_bytes());
            }
        }
    }
    out
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K / Q5_K block
/// (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K / Q5_K (`five`): eight sub-blocks of 32 with 6-bit scales and
/// minima; chunk `j` of 64 holds sub-block `2j` in the low nibbles of 32
/// bytes and `2j + 1` in their high nibbles (Q5_K: bit `2j` / `2j + 1` of
/// `qh[l]` on top).
fn q45_k(blk: &[u8], five: bool, s: &mut Super) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let scales = &blk[4..16];
    let (qh, qs) = if five {
        (&blk[16..48], &blk[48..176])
    } else {
        (&blk[16..16], &blk[16..144])
    };
    for j in 0..4 {
        let q = &qs[32 * j..32 * j + 32];
        for (half, shift) in [(0usize, 0u32), (1, 4)] {
            let sub = 2 * j + half;
            let (sc, mn) = scale_min_k4(sub, scales);
            for h in [2 * sub, 2 * sub + 1] {
                s.scale[h] = d * f32::from(sc);
                s.min[h] = -(dmin * f32::from(mn));
            }
            for (l, &byte) in q.iter().enumerate() {
                let mut v = (byte >> shift) & 0x0f;
                if five && (qh[l] >> sub) & 1 == 1 {
                    v += 16;
                }
                s.codes[32 * sub + l] = v as i8;
            }
        }
    }
}

/// Q6_K: two halves of 128, each 4 low bits (`ql`), 2 high bits (`qh`) and
/// eight int8 scales, one per 16; codes minus 32.
fn q6_k(blk: &[u8], s: &mut Super) {
    let d = f16_at(blk, 208);
    for n in 0..2 {
        let ql = &blk[64 * n..64 * n + 64];
        let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
        let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
        for l in 0..32 {
            let q = |lo: u8, shift: u32| ((lo & 0x0f) | ((qh[l] >> shift) & 3) << 4) as i8 - 32;
            let base = 128 * n + l;
            s.codes[base] = q(ql[l], 0);
            s.codes[base + 32] = q(ql[l + 32], 2);
            s.codes[base + 64] = q(ql[l] >> 4, 4);
            s.codes[base + 96] = q(ql[l + 32] >> 4, 6);
        }
        // Element 32·g + l of this half has scale sc[l / 16 + 2g].
        for g in 0..4 {
            for is in 0..2 {
                let h = (128 * n + 32 * g + 16 * is) / 16;
                s.scale[h] = d * f32::from(sc[is + 2 * g] as i8);
                s.min[h] = 0.0;
            }
        }
    }
}
