//! [`GroupQuantizer`]: symmetric INT8 and affine INT4 / INT2 with f16 group
//! parameters, per token or per channel.

use half::f16;

use crate::{
    Axis, BlockShape, QuantConfig, QuantError, QuantizedBlock, Quantizer, Result, check_len,
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
            if self.cfg.symmetric() {
                let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = f16::from_f32(amax / 127.0);
                scales.push(s);
                let s = s.to_f32();
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                for (c, &v) in codes.iter_mut().zip(grp) {
                    // Round half away from zero by truncation: vectorizes
                    // on plain SSE2, unlike `f32::round`.
                    let t = (v * inv).clamp(-127.0, 127.0);
                    *c = ((t + 0.5f32.copysign(t)) as i32 as i8) as u8;
                }
            } else {
                let levels = ((1u32 << bits) - 1) as f32;
                let (mn, mx) = grp
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                        (a.min(v), b.max(v))
                    });
                let (s, m) = (f16::from_f32((mx - mn) / levels), f16::from_f32(mn));
                scales.push(s);
                mins.push(m);
                let (s, m) = (s.to_f32(), m.to_f32());
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                for (c, &v) in codes.iter_mut().zip(grp) {
                    *c = (((v - m) * inv).clamp(0.0, levels) + 0.5) as u32 as u8;
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
        let shape = block.shape;
        check_len(shape, out.len())?;
        if block.config != self.cfg {
            return Err(QuantError::Shape(format!(
                "block was quantized as {:?}, not {:?}",
                block.config, self.cfg
            )));
        }
        let (bits, g) = (self.cfg.bits(), self.cfg.group_size());
        let groups = shape.len() / g;
        let want_mins = if self.cfg.symmetric() { 0 } else { groups };
        if block.packed.len() != shape.len() * bits as usize / 8
            || block.scales.len() != groups
            || block.mins.len() != want_mins
        {
            return Err(QuantError::Shape(
                "quantized block is truncated or corrupt".into(),
            ));
        }
        decode_dispatch(self.cfg, block, out);
        Ok(())
    }
}

/// Dequantizes `block` into `dst`, with AVX2 code when the CPU has it (the
/// loops are plain Rust; the wider target lets the compiler vectorize the
/// byte-to-float conversions 8 lanes at a time).
fn decode_dispatch(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU supports AVX2 and F16C, checked just above.
        unsafe { decode_avx2(cfg, block, dst) };
        return;
    }
    decode_any(cfg, block, dst);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn decode_avx2(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
    decode_any(cfg, block, dst);
}

#[inline(always)]
fn decode_any(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
    match cfg.axis() {
        Axis::PerToken => decode(cfg, block, dst),
        Axis::PerChannel => decode_channels(cfg, block, dst),
    }
}

/// Dequantizes the groups of `block` in storage order into `dst`
/// (per-token layout: groups run along the rows of `dst`).
#[inline(always)]
fn decode(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
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
                *y = f32::from(c as i8) * s;
            }
            continue;
        }
        // One contiguous pass per bit plane (see `pack`).
        let mask = ((1u32 << bits) - 1) as u8;
        for (plane, part) in o.chunks_exact_mut(p.len()).enumerate() {
            let shift = plane as u32 * bits;
            for (y, &c) in part.iter_mut().zip(p) {
                *y = f32::from((c >> shift) & mask) * s + m;
            }
        }
    }
}

/// Dequantizes a per-channel block into token-major `dst`. Codes are
/// stored token-major (each row packed like a group, see [`pack`]), group
/// parameters channel-major; each row is one affine pass per bit plane with
/// the per-channel scale and minimum of its token group.
#[inline(always)]
fn decode_channels(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
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
                *y = f32::from(q as i8) * s;
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
                *y = f32::from((q >> shift) & mask) * s + m;
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
