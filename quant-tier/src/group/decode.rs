//! Dequantizing a whole block: per-token groups or per-channel rows, with
//! an AVX2 build of the same loops when the CPU has it.

use std::mem::MaybeUninit;

use crate::{Axis, QuantConfig, QuantizedBlock};

/// Dequantizes `block` into `dst`, with AVX2 code when the CPU has it (the
/// loops are plain Rust; the wider target lets the compiler vectorize the
/// byte-to-float conversions 8 lanes at a time).
pub(super) fn decode_dispatch(
    cfg: QuantConfig,
    block: &QuantizedBlock,
    dst: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU supports AVX2 and F16C, checked just above.
        unsafe { decode_avx2(cfg, block, dst) };
        return;
    }
    decode_any(cfg, block, dst);
}

/// `unsafe fn` rather than a safe `#[target_feature]` fn, which needs Rust
/// 1.86 (the workspace's `rust-version` is 1.85).
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_avx2(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
    decode_any(cfg, block, dst);
}

#[inline(always)]
pub(super) fn decode_any(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
    match cfg.axis() {
        Axis::PerToken => decode(cfg, block, dst),
        Axis::PerChannel => decode_channels(cfg, block, dst),
    }
}

/// Dequantizes the groups of `block` in storage order into `dst`
/// (per-token layout: groups run along the rows of `dst`).
#[inline(always)]
fn decode(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
    let (bits, g) = (cfg.bits(), cfg.group_size());
    let bytes_per_group = g * bits as usize / 8;
    let groups = dst
        .chunks_exact_mut(g)
        .zip(block.packed.chunks_exact(bytes_per_group));
    for (k, (o, p)) in groups.enumerate() {
        let s = block.scales[k].to_f32();
        let m = block.mins.get(k).map_or(0.0, |m| m.to_f32());
        if bits == 8 {
            for (y, &c) in o.iter_mut().zip(p) {
                y.write(f32::from(c as i8) * s);
            }
            continue;
        }
        // One contiguous pass per bit plane (see `pack`).
        let mask = ((1u32 << bits) - 1) as u8;
        for (plane, part) in o.chunks_exact_mut(p.len()).enumerate() {
            let shift = plane as u32 * bits;
            for (y, &c) in part.iter_mut().zip(p) {
                y.write(f32::from((c >> shift) & mask) * s + m);
            }
        }
    }
}

/// Dequantizes a per-channel block into token-major `dst`. Codes are
/// stored token-major (each row packed like a group, see [`pack`]), group
/// parameters channel-major; each row is one affine pass per bit plane with
/// the per-channel scale and minimum of its token group.
#[inline(always)]
fn decode_channels(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
    let shape = block.shape;
    let (t, c, g, bits) = (
        shape.tokens,
        shape.heads * shape.head_dim,
        cfg.group_size(),
        cfg.bits(),
    );
    let per_channel = t / g;
    let row_bytes = c * bits as usize / 8;
    let (mut s, mut m) = (vec![0f32; c], vec![0f32; c]);
    let rows = dst
        .chunks_exact_mut(c)
        .zip(block.packed.chunks_exact(row_bytes));
    for (ti, (out, p)) in rows.enumerate() {
        if ti % g == 0 {
            let k = ti / g;
            for ci in 0..c {
                s[ci] = block.scales[ci * per_channel + k].to_f32();
                m[ci] = block
                    .mins
                    .get(ci * per_channel + k)
                    .map_or(0.0, |v| v.to_f32());
            }
        }
        if bits == 8 {
            for ((y, &q), &s) in out.iter_mut().zip(p).zip(&s) {
                y.write(f32::from(q as i8) * s);
            }
            continue;
        }
        let mask = ((1u32 << bits) - 1) as u8;
        let planes = out
            .chunks_exact_mut(row_bytes)
            .zip(s.chunks_exact(row_bytes).zip(m.chunks_exact(row_bytes)));
        for (plane, (o, (s, m))) in planes.enumerate() {
            let shift = plane as u32 * bits;
            for (((y, &q), &s), &m) in o.iter_mut().zip(p).zip(s).zip(m) {
                y.write(f32::from((q >> shift) & mask) * s + m);
            }
        }
    }
}
