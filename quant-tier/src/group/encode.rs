//! Quantizing one group: its codes, and f16 parameters rounded so that no
//! code is clamped; the bit-plane packing the decoders unpack.

use half::f16;

use crate::error::{QuantError, Result};

/// The INT8 codes of one group into `codes`, and its scale. `at(j)` is
/// the index in the input of element `j` (named in an error only).
pub(super) fn symmetric_group(
    grp: &[f32],
    codes: &mut [u8],
    at: &dyn Fn(usize) -> usize,
    format: &'static str,
) -> Result<f16> {
    let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = int8_scale(amax).ok_or_else(|| {
        let j = find(grp, &|x| x.abs() == amax);
        QuantError::OutOfRange {
            index: at(j),
            value: grp[j].to_string(),
            format,
            limit: "|x| <= 65504 * 127",
        }
    })?;
    let inv = if s.to_f32() > 0.0 {
        1.0 / s.to_f32()
    } else {
        0.0
    };
    for (c, &v) in codes.iter_mut().zip(grp) {
        *c = (round_even((v * inv).clamp(-127.0, 127.0)) as i32 as i8) as u8;
    }
    Ok(s)
}

/// The affine (INT4 / INT2) codes of one group into `codes`, and its
/// `(scale, min)`; `at` as for [`symmetric_group`].
pub(super) fn affine_group(
    grp: &[f32],
    codes: &mut [u8],
    bits: u32,
    at: &dyn Fn(usize) -> usize,
    format: &'static str,
) -> Result<(f16, f16)> {
    let levels = ((1u32 << bits) - 1) as f32;
    // Plain folds (they vectorize); an element's index is looked up only
    // for an error.
    let (mn, mx) = grp
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let m = f16_floor(mn).ok_or_else(|| QuantError::OutOfRange {
        index: at(find(grp, &|x| x == mn)),
        value: mn.to_string(),
        format,
        limit: "min >= -65504",
    })?;
    let s = affine_scale(mx, m.to_f32(), levels).ok_or_else(|| QuantError::OutOfRange {
        index: at(find(grp, &|x| x == mx)),
        value: mx.to_string(),
        format,
        limit: "max - min <= 65504 * (2^bits - 1)",
    })?;
    let (sf, mf) = (s.to_f32(), m.to_f32());
    let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
    for (c, &v) in codes.iter_mut().zip(grp) {
        *c = round_even(((v - mf) * inv).clamp(0.0, levels)) as u32 as u8;
    }
    Ok((s, m))
}

/// The offset in `grp` of the first element `hit` accepts (0 if none).
pub(super) fn find(grp: &[f32], hit: &dyn Fn(f32) -> bool) -> usize {
    grp.iter().position(|&x| hit(x)).unwrap_or(0)
}

/// `x` rounded to the nearest integer, ties to even, for `|x| <= 2^22`
/// (codes are clamped first). Exact, and vectorizes on plain SSE2, unlike
/// `f32::round`; adding 0.5 and truncating would send 0.49999997 to 1.
#[inline(always)]
pub(super) fn round_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

/// The largest f16 not above `x`; `None` if that is not finite.
pub(super) fn f16_floor(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    let h = if h.to_f32() <= x {
        h
    } else {
        f16_step(h, false)
    };
    h.is_finite().then_some(h)
}

/// The smallest f16 not below `x`; `None` if that is not finite.
pub(super) fn f16_ceil(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    let h = if h.to_f32() >= x {
        h
    } else {
        f16_step(h, true)
    };
    h.is_finite().then_some(h)
}

/// The next f16 up (or down) from a finite `h`.
pub(super) fn f16_step(h: f16, up: bool) -> f16 {
    let b = h.to_bits();
    let (mag, neg) = (b & 0x7fff, b & 0x8000 != 0);
    let bits = match (mag == 0, up == neg) {
        // ±0: one subnormal step toward the direction asked.
        (true, _) => {
            if up {
                0x0001
            } else {
                0x8001
            }
        }
        // Away from zero: magnitude grows.
        (false, false) => b + 1,
        // Toward zero: magnitude shrinks.
        (false, true) => b - 1,
    };
    f16::from_bits(bits)
}

/// The INT8 scale: `amax / 127` rounded up in f16, so that `127 · s ≥ amax`
/// (no code is clamped); `None` when f16 cannot hold it.
pub(super) fn int8_scale(amax: f32) -> Option<f16> {
    let mut s = f16_ceil(amax / 127.0)?;
    while f64::from(s.to_f32()) * 127.0 < f64::from(amax) {
        s = f16_step(s, true);
    }
    s.is_finite().then_some(s)
}

/// The affine scale: `(max − m) / levels` rounded up in f16, so that
/// `m + levels · s ≥ max`; `None` when f16 cannot hold it.
pub(super) fn affine_scale(max: f32, m: f32, levels: f32) -> Option<f16> {
    let range = f64::from(max) - f64::from(m);
    let mut s = f16_ceil((range / f64::from(levels)) as f32)?;
    while f64::from(s.to_f32()) * f64::from(levels) < range {
        s = f16_step(s, true);
    }
    s.is_finite().then_some(s)
}
/// Packs one group's codes of `bits` bits in bit planes: with
/// `n = codes.len() * bits / 8` bytes, code `j` goes to byte `j % n` at bit
/// `(j / n) * bits` (INT4: the group's first half in the low nibbles, the
/// second half in the high nibbles). Unpacking is then a few contiguous,
/// vectorizable passes.
pub(super) fn pack(bits: u32, codes: &[u8], out: &mut [u8]) {
    if bits == 8 {
        out.copy_from_slice(codes);
        return;
    }
    let n = out.len();
    out.fill(0);
    for (plane, part) in codes.chunks_exact(n).enumerate() {
        let shift = plane as u32 * bits;
        for (o, &c) in out.iter_mut().zip(part) {
            *o |= c << shift;
        }
    }
}
