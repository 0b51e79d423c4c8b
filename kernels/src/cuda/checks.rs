//! What a step must satisfy before a launch: checked on the host, without
//! reading device memory.

use kvforge_quant::{Axis, QuantConfig};

use super::{DeviceCold, DeviceStep, HEAD_DIMS, MAX_GROUP};
use crate::{Dims, KernelError, Result};

impl DeviceStep {
    /// Checks what needs no device and no memory read: dimensions a kernel
    /// exists for, at least one key, no missing buffer, a cold layout the
    /// kernel decodes. The table's contents are the caller's to check.
    pub fn validate(&self) -> Result<()> {
        check_step(self)
    }
}

fn check_step(step: &DeviceStep) -> Result<()> {
    let d = step.dims;
    d.check()?;
    if !HEAD_DIMS.contains(&d.head_dim) {
        return Err(KernelError::Unsupported(format!(
            "no CUDA kernel for head dim {} (kernels exist for {HEAD_DIMS:?})",
            d.head_dim
        )));
    }
    if d.heads / d.kv_heads > MAX_GROUP {
        return Err(KernelError::Unsupported(format!(
            "{} query heads per KV head; the CUDA kernel handles up to {MAX_GROUP}",
            d.heads / d.kv_heads
        )));
    }
    if step.keys == 0 {
        return Err(KernelError::Shape("no keys to attend over".into()));
    }
    let null = |what: &str, p: u64| {
        if p == 0 {
            Err(KernelError::Shape(format!("no {what} buffer")))
        } else {
            Ok(())
        }
    };
    null("query", step.q)?;
    null("output", step.out)?;
    null("table", step.table)?;
    null("scratch", step.scratch)?;
    if let Some(c) = step.cold {
        check_cold(c, d)?;
    } else {
        null("hot key", step.k_pool)?;
        null("hot value", step.v_pool)?;
    }
    Ok(())
}

fn check_cold(c: DeviceCold, d: Dims) -> Result<()> {
    let shape = kvforge_quant::BlockShape {
        tokens: c.block_tokens,
        heads: d.kv_heads,
        head_dim: d.head_dim,
    };
    check_cold_layout(c.keys.config, c.values.config, shape)?;
    for (what, q) in [("keys", c.keys), ("values", c.values)] {
        if q.codes == 0 || q.scales == 0 || (q.config.bits() != 8 && q.mins == 0) {
            return Err(KernelError::Shape(format!("cold {what}: a missing buffer")));
        }
    }
    Ok(())
}

/// Whether the kernel decodes cold blocks of `shape` whose keys and
/// values were quantized as `keys` and `values` (unrotated): an error
/// saying why not.
pub fn check_cold_layout(
    keys: QuantConfig,
    values: QuantConfig,
    shape: kvforge_quant::BlockShape,
) -> Result<()> {
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(KernelError::Unsupported(format!(
            "no CUDA kernel for head dim {} (kernels exist for {HEAD_DIMS:?})",
            shape.head_dim
        )));
    }
    for (what, q) in [("keys", keys), ("values", values)] {
        check_layout(&q, shape)
            .map_err(|e| KernelError::Unsupported(format!("cold {what} on CUDA: {e}")))?;
    }
    Ok(())
}

/// What the CUDA dequantization assumes of a block's layout.
pub(super) fn check_layout(cfg: &QuantConfig, shape: kvforge_quant::BlockShape) -> Result<()> {
    let c = shape.heads * shape.head_dim;
    let g = cfg.group_size();
    let ok = match cfg.axis() {
        Axis::PerChannel => {
            shape.tokens.is_multiple_of(g) && (c * cfg.bits() as usize).is_multiple_of(8)
        }
        Axis::PerToken => shape.head_dim.is_multiple_of(g),
    };
    if ok && shape.tokens > 0 {
        Ok(())
    } else {
        Err(KernelError::Shape(format!(
            "{} groups of {g} do not tile blocks of {} tokens × {c} channels",
            if cfg.axis() == Axis::PerChannel {
                "per-channel"
            } else {
                "per-token"
            },
            shape.tokens
        )))
    }
}
