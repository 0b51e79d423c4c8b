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

fn from_channel_major(shape: BlockShape, x: &[f32], out: &mut [f32]) {
    let (t, c) = (shape.tokens, shape.heads * shape.head_dim);
    for (ci, col) in x.chunks_exact(t).enumerate() {
        for (ti, &v) in col.iter().enumerate() {
            out[ti * c + ci] = v;
        }
    }
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
        for (grp, out) in data
            .chunks_exact(g)
            .zip(packed.chunks_exact_mut(bytes_per_group))
        {
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
            pack(bits, &codes, out);
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
        match self.cfg.axis() {
            Axis::PerToken => decode(self.cfg, block, out),
            Axis::PerChannel => {
                let mut tmp = vec![0f32; shape.len()];
                decode(self.cfg, block, &mut tmp);
                from_channel_major(shape, &tmp, out);
            }
        }
        Ok(())
    }
}

/// Dequantizes the groups of `block` in storage order into `dst`.
fn decode(cfg: QuantConfig, block: &QuantizedBlock, dst: &mut [f32]) {
    let (bits, g) = (cfg.bits(), cfg.group_size());
    let bytes_per_group = g * bits as usize / 8;
    let mut codes = vec![0u8; g];
    let groups = dst
        .chunks_exact_mut(g)
        .zip(block.packed.chunks_exact(bytes_per_group));
    for (k, (o, p)) in groups.enumerate() {
        unpack(bits, p, &mut codes);
        let s = block.scales[k].to_f32();
        if cfg.symmetric() {
            for (y, &c) in o.iter_mut().zip(&codes) {
                *y = f32::from(c as i8) * s;
            }
        } else {
            let m = block.mins[k].to_f32();
            for (y, &c) in o.iter_mut().zip(&codes) {
                *y = f32::from(c) * s + m;
            }
        }
    }
}

/// Packs codes of `bits` bits, lowest bits first within each byte.
fn pack(bits: u32, codes: &[u8], out: &mut [u8]) {
    match bits {
        8 => out.copy_from_slice(codes),
        4 => {
            for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
                *o = (c[0] & 0x0f) | (c[1] << 4);
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(codes.chunks_exact(4)) {
                *o = (c[0] & 3) | ((c[1] & 3) << 2) | ((c[2] & 3) << 4) | (c[3] << 6);
            }
        }
    }
}

fn unpack(bits: u32, packed: &[u8], codes: &mut [u8]) {
    match bits {
        8 => codes.copy_from_slice(packed),
        4 => {
            for (c, &p) in codes.chunks_exact_mut(2).zip(packed) {
                c[0] = p & 0x0f;
                c[1] = p >> 4;
            }
        }
        _ => {
            for (c, &p) in codes.chunks_exact_mut(4).zip(packed) {
                c[0] = p & 3;
                c[1] = (p >> 2) & 3;
                c[2] = (p >> 4) & 3;
                c[3] = p >> 6;
            }
        }
    }
}
