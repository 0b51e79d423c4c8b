//! [`GroupQuantizer`]: symmetric INT8 and affine INT4 / INT2 with f16 group
//! parameters, per token or per channel.

use std::mem::MaybeUninit;

use half::f16;

use crate::{
    Axis, BlockShape, QuantConfig, QuantError, QuantizedBlock, Quantizer, Result, as_uninit,
    assume_init, check_len,
};

/// The reference group-wise quantizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupQuantizer {
    cfg: QuantConfig,
}

impl GroupQuantizer {
    /// A quantizer for `cfg`.
    pub fn new(cfg: QuantConfig) -> Self {
        GroupQuantizer { cfg }
    }

    /// Checks that the group size divides the axis it runs along.
    fn check_shape(&self, shape: BlockShape) -> Result<()> {
        let (axis, len) = match self.cfg.axis() {
            Axis::PerToken => ("head_dim", shape.head_dim),
            Axis::PerChannel => ("tokens", shape.tokens),
        };
        if len % self.cfg.group_size() != 0 {
            return Err(QuantError::GroupSize {
                group_size: self.cfg.group_size(),
                axis,
                len,
            });
        }
        let row = shape.heads * shape.head_dim;
        if self.cfg.axis() == Axis::PerChannel && row * self.cfg.bits() as usize % 8 != 0 {
            return Err(QuantError::Shape(format!(
                "per-channel rows of {row} channels do not fill whole bytes at {} bits",
                self.cfg.bits()
            )));
        }
        Ok(())
    }
}

/// `[tokens][heads*dim]` -> `[heads*dim][tokens]` (channel-major), so that
/// per-channel groups are contiguous.
fn to_channel_major(shape: BlockShape, x: &[f32]) -> Vec<f32> {
    let (t, c) = (shape.tokens, shape.heads * shape.head_dim);
    let mut out = vec![0f32; x.len()];
    for (ti, row) in x.chunks_exact(c).enumerate() {
        for (ci, &v) in row.iter().enumerate() {
            out[ci * t + ti] = v;
        }
    }
    out
}

impl Quantizer for GroupQuantizer {
    fn name(&self) -> String {
        let axis = match self.cfg.axis() {
            Axis::PerToken => "token",
            Axis::PerChannel => "channel",
        };
        format!("int{}-g{}-{axis}", self.cfg.bits(), self.cfg.group_size())
    }

    fn config(&self) -> QuantConfig {
        self.cfg
    }

    fn quantize(&self, shape: BlockShape, x: &[f32]) -> Result<QuantizedBlock> {
        check_len(shape, x.len())?;
        self.check_shape(shape)?;
        if let Some((index, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                index,
                value: v.to_string(),
            });
        }
        let ordered;
        let data: &[f32] = match self.cfg.axis() {
            Axis::PerToken => x,
            Axis::PerChannel => {
                ordered = to_channel_major(shape, x);
                &ordered
            }
        };
        let (bits, g) = (self.cfg.bits(), self.cfg.group_size());
        let groups = data.len() / g;
        let mut packed = vec![0u8; data.len() * bits as usize / 8];
        let mut scales = Vec::with_capacity(groups);
        let mut mins = Vec::with_capacity(if self.cfg.symmetric() { 0 } else { groups });
        let bytes_per_group = g * bits as usize / 8;
        let mut codes = vec![0u8; g];
        // Per channel: codes are gathered token-major and packed per row.
        let per_channel = self.cfg.axis() == Axis::PerChannel;
        let (t, c) = (shape.tokens, shape.heads * shape.head_dim);
        let mut rows = if per_channel {
            vec![0u8; data.len()]
        } else {
            Vec::new()
        };
        for (k, grp) in data.chunks_exact(g).enumerate() {
            // Flat index (in `x`) of element `j` of this group.
            let at = |j: usize| match self.cfg.axis() {
                Axis::PerToken => k * g + j,
                Axis::PerChannel => {
                    let (ci, t0) = (k / (t / g), (k % (t / g)) * g);
                    (t0 + j) * c + ci
                }
            };
            let format = match bits {
                8 => "int8",
                4 => "int4",
                _ => "int2",
            };
            // Plain folds (they vectorize); an element's index is looked up
            // only for an error.
            let find = |hit: &dyn Fn(f32) -> bool| grp.iter().position(|&x| hit(x)).unwrap_or(0);
            if self.cfg.symmetric() {
                let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = int8_scale(amax).ok_or_else(|| QuantError::OutOfRange {
                    index: at(find(&|x| x.abs() == amax)),
                    value: grp[find(&|x| x.abs() == amax)].to_string(),
                    format,
                    limit: "|x| <= 65504 * 127",
                })?;
                scales.push(s);
                let s = s.to_f32();
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                for (c, &v) in codes.iter_mut().zip(grp) {
                    *c = (round_even((v * inv).clamp(-127.0, 127.0)) as i32 as i8) as u8;
                }
            } else {
                let levels = ((1u32 << bits) - 1) as f32;
                let (mn, mx) = grp
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                        (a.min(v), b.max(v))
                    });
                let m = f16_floor(mn).ok_or_else(|| QuantError::OutOfRange {
                    index: at(find(&|x| x == mn)),
                    value: mn.to_string(),
                    format,
                    limit: "min >= -65504",
                })?;
                let s =
                    affine_scale(mx, m.to_f32(), levels).ok_or_else(|| QuantError::OutOfRange {
                        index: at(find(&|x| x == mx)),
                        value: mx.to_string(),
                        format,
                        limit: "max - min <= 65504 * (2^bits - 1)",
                    })?;
                scales.push(s);
                mins.push(m);
                let (s, m) = (s.to_f32(), m.to_f32());
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                for (c, &v) in codes.iter_mut().zip(grp) {
                    *c = round_even(((v - m) * inv).clamp(0.0, levels)) as u32 as u8;
                }
            }
            if per_channel {
                let (ci, t0) = (k / (t / g), (k % (t / g)) * g);
                for (j, &q) in codes.iter().enumerate() {
                    rows[(t0 + j) * c + ci] = q;
                }
            } else {
                pack(
                    bits,
                    &codes,
                    &mut packed[k * bytes_per_group..][..bytes_per_group],
                );
            }
        }
        if per_channel {
            let row_bytes = c * bits as usize / 8;
            for (q, out) in rows.chunks_exact(c).zip(packed.chunks_exact_mut(row_bytes)) {
                pack(bits, q, out);
            }
        }
        Ok(QuantizedBlock {
            shape,
            config: self.cfg,
            packed,
            scales,
            mins,
        })
    }

    fn dequantize(&self, block: &QuantizedBlock, out: &mut [f32]) -> Result<()> {
        self.dequantize_uninit(block, as_uninit(out)).map(|_| ())
    }

    fn dequantize_uninit<'a>(
        &self,
        block: &QuantizedBlock,
        out: &'a mut [MaybeUninit<f32>],
    ) -> Result<&'a mut [f32]> {
        self.check_block(block, out.len())?;
        decode_dispatch(self.cfg, block, out);
        // SAFETY: `check_block` verified that the groups (per token) or
        // rows (per channel) of `block` cover exactly `out.len()` elements,
        // and the decoders write each of them.
        Ok(unsafe { assume_init(out) })
    }
}

impl GroupQuantizer {
    /// Everything `dequantize` relies on, checked up front: the fields of a
    /// [`QuantizedBlock`] are public, so a block may come from anywhere.
    fn check_block(&self, block: &QuantizedBlock, out_len: usize) -> Result<()> {
        let shape = block.shape;
        check_len(shape, out_len)?;
        if block.config != self.cfg {
            return Err(QuantError::Shape(format!(
                "block was quantized as {:?}, not {:?}",
                block.config, self.cfg
            )));
        }
        self.check_shape(shape)
            .map_err(|e| QuantError::Corrupt(e.to_string()))?;
        let (bits, g) = (self.cfg.bits(), self.cfg.group_size());
        let groups = shape.len() / g;
        let want_mins = if self.cfg.symmetric() { 0 } else { groups };
        // Cannot overflow: `shape.len()` is a slice length of 4-byte elements.
        if block.packed.len() != shape.len() * bits as usize / 8
            || block.scales.len() != groups
            || block.mins.len() != want_mins
        {
            return Err(QuantError::Corrupt(
                "the codes or parameters are truncated or too long".into(),
            ));
        }
        // One branch-free pass (it vectorizes); find the culprit only if any.
        let exp = |p: &f16| p.to_bits() & 0x7c00 == 0x7c00;
        let params = || block.scales.iter().chain(&block.mins);
        if params().fold(false, |bad, p| bad | exp(p)) {
            let p = params().find(|p| exp(p)).copied().unwrap_or(f16::NAN);
            return Err(QuantError::Corrupt(format!(
                "non-finite group parameter {p}"
            )));
        }
        Ok(())
    }
}

/// `x` rounded to the nearest integer, ties to even, for `|x| <= 2^22`
/// (codes are clamped first). Exact, and vectorizes on plain SSE2, unlike
/// `f32::round`; adding 0.5 and truncating would send 0.49999997 to 1.
#[inline(always)]
fn round_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

/// The largest f16 not above `x`; `None` if that is not finite.
fn f16_floor(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    let h = if h.to_f32() <= x {
        h
    } else {
        f16_step(h, false)
    };
    h.is_finite().then_some(h)
}

/// The smallest f16 not below `x`; `None` if that is not finite.
fn f16_ceil(x: f32) -> Option<f16> {
    let h = f16::from_f32(x);
    let h = if h.to_f32() >= x {
        h
    } else {
        f16_step(h, true)
    };
    h.is_finite().then_some(h)
}

/// The next f16 up (or down) from a finite `h`.
fn f16_step(h: f16, up: bool) -> f16 {
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
fn int8_scale(amax: f32) -> Option<f16> {
    let mut s = f16_ceil(amax / 127.0)?;
    while f64::from(s.to_f32()) * 127.0 < f64::from(amax) {
        s = f16_step(s, true);
    }
    s.is_finite().then_some(s)
}

/// The affine scale: `(max − m) / levels` rounded up in f16, so that
/// `m + levels · s ≥ max`; `None` when f16 cannot hold it.
fn affine_scale(max: f32, m: f32, levels: f32) -> Option<f16> {
    let range = f64::from(max) - f64::from(m);
    let mut s = f16_ceil((range / f64::from(levels)) as f32)?;
    while f64::from(s.to_f32()) * f64::from(levels) < range {
        s = f16_step(s, true);
    }
    s.is_finite().then_some(s)
}

/// Dequantizes `block` into `dst`, with AVX2 code when the CPU has it (the
/// loops are plain Rust; the wider target lets the compiler vectorize the
/// byte-to-float conversions 8 lanes at a time).
fn decode_dispatch(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
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
fn decode_any(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [MaybeUninit<f32>]) {
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

/// Packs one group's codes of `bits` bits in bit planes: with
/// `n = codes.len() * bits / 8` bytes, code `j` goes to byte `j % n` at bit
/// `(j / n) * bits` (INT4: the group's first half in the low nibbles, the
/// second half in the high nibbles). Unpacking is then a few contiguous,
/// vectorizable passes.
fn pack(bits: u32, codes: &[u8], out: &mut [u8]) {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// xorshift64*, seeded.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed | 1;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    fn decode_with(
        f: impl Fn(QuantConfig, &QuantizedBlock, &mut [MaybeUninit<f32>]),
        cfg: QuantConfig,
        b: &QuantizedBlock,
    ) -> Vec<u32> {
        let mut out = vec![MaybeUninit::new(f32::NAN); b.shape.len()];
        f(cfg, b, &mut out);
        // SAFETY: initialized above (and overwritten by the decoder).
        unsafe { assume_init(&mut out) }
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The run-time-dispatched (AVX2 where present) and the plain scalar
    /// decoders agree bit for bit, over random shapes and extreme values.
    #[test]
    fn simd_and_scalar_decoders_agree_bit_for_bit() {
        let mut r = rng(42);
        let specials = [
            0.0, -0.0, 1e-30, -1e-30, 6e-8, 8.3e6, -8.3e6, 65504.0, -65504.0, 1.0,
        ];
        for case in 0..400 {
            let bits = [8, 4, 2][case % 3];
            let axis = if case % 2 == 0 {
                Axis::PerToken
            } else {
                Axis::PerChannel
            };
            let g = [16usize, 32, 64][(r() % 3) as usize];
            let shape = BlockShape {
                tokens: g * (1 + (r() % 2) as usize),
                heads: 1 + (r() % 3) as usize,
                head_dim: [32usize, 64, 128][(r() % 3) as usize],
            };
            let cfg = match QuantConfig::new(bits, g, axis) {
                Ok(c) => c,
                Err(_) => continue,
            };
            let quant = GroupQuantizer::new(cfg);
            let scale = [1e-6f32, 1.0, 1e3, 1e5][(r() % 4) as usize];
            let x: Vec<f32> = (0..shape.len())
                .map(|_| {
                    let u = r();
                    if u % 17 == 0 {
                        specials[(u >> 8) as usize % specials.len()]
                    } else {
                        ((u >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * scale
                    }
                })
                .collect();
            let Ok(b) = quant.quantize(shape, &x) else {
                continue;
            };
            assert_eq!(
                decode_with(decode_dispatch, cfg, &b),
                decode_with(decode_any, cfg, &b),
                "case {case}: {cfg:?} {shape:?}"
            );
        }
    }

    #[test]
    fn f16_rounding_helpers_round_the_right_way() {
        for x in [
            300.1f32, -300.1, 1e-7, -1e-7, 0.0, 65504.0, -65503.0, 3.3e-9,
        ] {
            let lo = f16_floor(x).unwrap().to_f32();
            let hi = f16_ceil(x).unwrap().to_f32();
            assert!(lo <= x && x <= hi, "{x}: [{lo}, {hi}]");
            assert!(f16_step(f16::from_f32(lo), true).to_f32() > x || lo == x);
        }
        assert_eq!(f16_floor(-65520.0), None, "below the f16 range");
        assert_eq!(f16_ceil(65505.0), None);
        assert_eq!(
            f16_ceil(1e-9).unwrap().to_bits(),
            1,
            "smallest subnormal, not 0"
        );
        assert_eq!(round_even(0.499_999_97), 0.0);
        assert_eq!(
            (round_even(0.5), round_even(1.5), round_even(-2.5)),
            (0.0, 2.0, -2.0)
        );
    }
}
