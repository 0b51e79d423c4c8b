//! The cold tier's device copy for the CUDA kernel: its blocks laid out
//! as the kernel reads a cold pool, grown by doubling, written on
//! demotion.

use std::sync::RwLock;

use kvforge_quant::QuantizedBlock;
use tch::{Device, Tensor};

use crate::error::{EngineError, Result};

use super::*;

/// The cold tier's blocks on the attention device, laid out as the CUDA
/// kernel reads a cold pool (`kvforge_kernels::cuda::DeviceCold`): per
/// layer, six tensors — key codes, key scales, key minima, value codes,
/// value scales, value minima — of `[capacity, per block]` (`u8` codes,
/// f16 parameters as `i16`), row `slot` holding cold slot `slot`'s block.
pub(crate) struct Mirror {
    device: Device,
    layers: Vec<[Tensor; 6]>,
    capacity: usize,
}

impl Mirror {
    /// Cold slots it has room for.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Layer `layer`'s six tensors.
    pub(crate) fn layer(&self, layer: usize) -> Option<&[Tensor; 6]> {
        self.layers.get(layer)
    }
}

/// One layer's keys then values as [`slab_rows`]: the six rows of a
/// [`Mirror`] layer.
pub(super) fn block_rows(k: &QuantizedBlock, v: &QuantizedBlock) -> Result<Vec<Tensor>> {
    Ok(slab_rows(k)?.into_iter().chain(slab_rows(v)?).collect())
}

/// One quantized slab's arrays as tensors: its codes (`u8`), scales and
/// minima (`i16` bit patterns), each `[1, n]`.
pub(super) fn slab_rows(q: &QuantizedBlock) -> Result<[Tensor; 3]> {
    let halves = |v: &[half::f16]| -> Result<Tensor> {
        let bits: Vec<i16> = v.iter().map(|h| h.to_bits() as i16).collect();
        Ok(Tensor::f_from_slice(&bits)?.f_unsqueeze(0)?)
    };
    Ok([
        Tensor::f_from_slice(&q.packed)?.f_unsqueeze(0)?,
        halves(&q.scales)?,
        halves(&q.mins)?,
    ])
}

impl ColdTier {
    /// Keeps a copy of every block on `device` for the CUDA kernel (see
    /// [`Mirror`]), for a model of `layers` layers; `false` (no mirror)
    /// when the kernel cannot read this tier: rotated keys (the kernel
    /// does not rotate the query) or a layout it does not decode.
    pub(crate) fn mirror_on(&mut self, device: Device, layers: usize) -> bool {
        let layout = kvforge_kernels::cuda::check_cold_layout(
            self.keys.config(),
            self.values.config(),
            self.shape,
        );
        if self.spec.rotate || layout.is_err() {
            return false;
        }
        self.mirror = Some(RwLock::new(Mirror {
            device,
            layers: Vec::with_capacity(layers),
            capacity: 0,
        }));
        true
    }

    /// Whether a device copy of the blocks is kept.
    pub(crate) fn mirrored(&self) -> bool {
        self.mirror.is_some()
    }

    /// The device copy of the blocks, if kept; hold the guard while a
    /// kernel that reads it is launched.
    pub(crate) fn mirror(&self) -> Option<std::sync::RwLockReadGuard<'_, Mirror>> {
        self.mirror
            .as_ref()
            .map(|m| m.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Writes `block` into row `slot` of the device copy, growing it (to
    /// twice the slots) when it is full.
    pub(super) fn mirror_put(&self, slot: usize, block: &ColdBlock) -> Result<()> {
        let Some(m) = &self.mirror else {
            return Ok(());
        };
        let mut m = m.write().unwrap_or_else(|e| e.into_inner());
        if slot >= m.capacity {
            let cap = (slot + 1).max(2 * m.capacity).max(4);
            let mut layers = Vec::with_capacity(block.k.len());
            for (l, (qk, qv)) in block.k.iter().zip(&block.v).enumerate() {
                let rows = block_rows(qk, qv)?;
                let mut grown = Vec::with_capacity(6);
                for (i, r) in rows.iter().enumerate() {
                    let t = Tensor::f_zeros([cap as i64, r.size()[1]], (r.kind(), m.device))?;
                    if let Some(old) = m.layers.get(l) {
                        t.f_narrow(0, 0, m.capacity as i64)?.f_copy_(&old[i])?;
                    }
                    grown.push(t);
                }
                layers.push(
                    <[Tensor; 6]>::try_from(grown)
                        .map_err(|_| EngineError::Torch("six mirror tensors".into()))?,
                );
            }
            m.layers = layers;
            m.capacity = cap;
        }
        for (l, (qk, qv)) in block.k.iter().zip(&block.v).enumerate() {
            let rows = block_rows(qk, qv)?;
            let layer = m.layers.get(l).ok_or_else(|| {
                EngineError::Torch(format!("the cold tier's device copy has no layer {l}"))
            })?;
            for (dst, src) in layer.iter().zip(&rows) {
                if src.size()[1] > 0 {
                    dst.f_narrow(0, slot as i64, 1)?.f_copy_(src)?;
                }
            }
        }
        Ok(())
    }
}
