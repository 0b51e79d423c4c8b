//! [`GroupQuantizer`]: symmetric INT8 and affine INT4 / INT2 with f16 group
//! parameters, per token or per channel.

mod decode;
mod encode;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

use std::mem::MaybeUninit;

use half::f16;

use decode::decode_dispatch;
use encode::{affine_group, pack, symmetric_group};

use crate::error::{QuantError, Result};
use crate::{
    Axis, BlockShape, QuantConfig, QuantizedBlock, Quantizer, as_uninit, assume_init, check_len,
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
            if self.cfg.symmetric() {
                scales.push(symmetric_group(grp, &mut codes, &at, format)?);
            } else {
                let (s, m) = affine_group(grp, &mut codes, bits, &at, format)?;
                scales.push(s);
                mins.push(m);
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
