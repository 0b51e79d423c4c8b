//! [`ColdPoolHost`]: cold blocks laid back to back as the kernel reads them.

use half::f16;
use kvforge_quant::{Axis, QuantConfig, QuantizedBlock};

use super::checks::check_layout;
use crate::{KernelError, Result};

/// Cold blocks of one layer's keys or values, laid back to back as the
/// CUDA kernel reads them (upload each vector as is).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdPoolHost {
    /// Codes, block after block.
    pub codes: Vec<u8>,
    /// Group scales, block after block.
    pub scales: Vec<f16>,
    /// Group minima, block after block (empty for INT8).
    pub mins: Vec<f16>,
}

impl ColdPoolHost {
    /// Lays out `blocks`, which must share one shape and configuration.
    pub fn from_blocks(blocks: &[&QuantizedBlock]) -> Result<Self> {
        let Some(first) = blocks.first() else {
            return Ok(ColdPoolHost::default());
        };
        check_layout(&first.config, first.shape)?;
        let mut pool = ColdPoolHost::default();
        for (i, b) in blocks.iter().enumerate() {
            if b.shape != first.shape || b.config != first.config {
                return Err(KernelError::Shape(format!(
                    "cold block {i} is {:?} / {:?}, the pool's first {:?} / {:?}",
                    b.shape, b.config, first.shape, first.config
                )));
            }
            let groups = first.shape.len() / first.config.group_size();
            let mins = if first.config.bits() == 8 { 0 } else { groups };
            if b.packed.len() != first.shape.len() * first.config.bits() as usize / 8
                || b.scales.len() != groups
                || b.mins.len() != mins
            {
                return Err(KernelError::Shape(format!(
                    "cold block {i}: codes or group parameters truncated"
                )));
            }
            pool.codes.extend_from_slice(&b.packed);
            pool.scales.extend_from_slice(&b.scales);
            pool.mins.extend_from_slice(&b.mins);
        }
        Ok(pool)
    }

    /// Element (row `t` of block `b`, channel `c`) as the CUDA kernel's
    /// `cold_at` computes it — its index arithmetic, line for line, so the
    /// CPU tests can check it against `kvforge-quant`'s decoder.
    pub fn element(
        &self,
        cfg: &QuantConfig,
        block_tokens: usize,
        channels: usize,
        b: usize,
        t: usize,
        c: usize,
    ) -> f32 {
        let (bits, group) = (cfg.bits() as usize, cfg.group_size());
        let block_bytes = block_tokens * channels * bits / 8;
        let block_groups = block_tokens * channels / group;
        let (byte, plane, gi) = if cfg.axis() == Axis::PerChannel {
            let row_bytes = channels * bits / 8;
            (
                t * row_bytes + c % row_bytes,
                c / row_bytes,
                c * (block_tokens / group) + t / group,
            )
        } else {
            let idx = t * channels + c;
            let bpg = group * bits / 8;
            let gi = idx / group;
            let within = idx % group;
            (gi * bpg + within % bpg, within / bpg, gi)
        };
        let code = self.codes[b * block_bytes + byte];
        let s = self.scales[b * block_groups + gi].to_f32();
        if bits == 8 {
            return f32::from(code as i8) * s;
        }
        let q = (code >> (plane * bits)) & ((1u8 << bits) - 1);
        f32::from(q) * s + self.mins[b * block_groups + gi].to_f32()
    }
}
