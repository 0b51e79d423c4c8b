//! The quantized cold tier of the paged cache: its quantizers and the
//! storage of its blocks.
//!
//! The coordinator decides which hot blocks go cold (the newest `window`
//! tokens and the first `sink` ones stay in the cache's dtype) and hands
//! out a cold block id for each; the engine quantizes the hot block with
//! `kvforge-quant` (K and V of every layer) into a [`ColdBlock`] stored at
//! that id's slot. Cold blocks are shared by reference like hot ones.
//! Attention reads them dequantized on the fly, per layer and step,
//! straight into the K/V tensor it attends over (dequantize-then-attend).
//!
//! Keys may be Hadamard-rotated before quantizing; dequantizing rotates them
//! back, so the attention path does not change.

use std::mem::MaybeUninit;
use std::sync::{Arc, RwLock};

use kvforge_pool::{BlockId, StorageFormat, TieredPool};

use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantError, QuantizedBlock, Quantizer, Rotated,
    TierPlan,
};
use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};

mod mirror;
mod spec;

pub(crate) use mirror::Mirror;
pub use spec::KvQuant;

/// One block of the cold tier: K and V of every layer, quantized.
#[derive(Clone, Debug, PartialEq)]
pub struct ColdBlock {
    k: Vec<QuantizedBlock>,
    v: Vec<QuantizedBlock>,
}

impl ColdBlock {
    /// Bytes held: codes plus group parameters of every layer.
    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|b| b.bytes() as u64).sum()
    }

    /// Layer `layer`'s quantized keys and values.
    pub(crate) fn layer(&self, layer: usize) -> Option<(&QuantizedBlock, &QuantizedBlock)> {
        Some((self.k.get(layer)?, self.v.get(layer)?))
    }

    /// Every code and group parameter, layer by layer (what a
    /// deduplicator compares).
    pub fn content(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.bytes() as usize);
        for q in self.k.iter().chain(&self.v) {
            out.extend_from_slice(&q.packed);
            for x in q.scales.iter().chain(&q.mins) {
                out.extend_from_slice(&x.to_bits().to_le_bytes());
            }
        }
        out
    }
}

/// A stored cold block and the epoch of the handle it was stored under.
type Stored = (u32, Arc<ColdBlock>);

/// The quantizers of a cache's cold tier and the blocks it stores, by
/// cold slot, each with the epoch of the handle it was stored under (a
/// freed handle of an older epoch never drops a newer block's content).
pub(crate) struct ColdTier {
    spec: KvQuant,
    shape: BlockShape,
    keys: Box<dyn Quantizer>,
    values: Box<dyn Quantizer>,
    key_format: StorageFormat,
    value_format: StorageFormat,
    blocks: RwLock<Vec<Option<Stored>>>,
    /// A quantized zero slab of keys and of values: the sizes of every
    /// slab's codes and group parameters.
    template: [QuantizedBlock; 2],
    /// The blocks again on the attention device, for the CUDA kernel.
    mirror: Option<RwLock<Mirror>>,
}

impl ColdTier {
    /// Checks `spec` against the cache's block shape (group sizes dividing
    /// their axis, a power-of-two head dim for rotation, the window a
    /// multiple of the block size) by quantizing a zero block.
    pub(crate) fn new(spec: KvQuant, shape: BlockShape) -> Result<Self> {
        TierPlan::new(shape.tokens, spec.window)?;
        if spec.sink % shape.tokens != 0 {
            return Err(EngineError::Request(format!(
                "a sink of {} tokens is not a multiple of the block size {}",
                spec.sink, shape.tokens
            )));
        }
        let key_group = match spec.key_axis {
            Axis::PerChannel => shape.tokens,
            Axis::PerToken => spec.group_size,
        };
        let key_cfg = QuantConfig::new(spec.bits, key_group, spec.key_axis).map_err(|e| {
            if spec.key_axis == Axis::PerChannel && matches!(e, QuantError::GroupSize { .. }) {
                // The group here is the block, not --kv-group: say so.
                EngineError::Request(format!(
                    "per-channel keys are quantized in groups of one block ({} tokens), and at {} bits a group must fill whole bytes: use a block size of at least {} or token-wise keys",
                    shape.tokens,
                    spec.bits,
                    8 / spec.bits
                ))
            } else {
                e.into()
            }
        })?;
        let kq = GroupQuantizer::new(key_cfg);
        let keys: Box<dyn Quantizer> = if spec.rotate {
            Box::new(Rotated::new(kq))
        } else {
            Box::new(kq)
        };
        let values: Box<dyn Quantizer> = Box::new(GroupQuantizer::new(QuantConfig::new(
            spec.bits,
            spec.group_size,
            Axis::PerToken,
        )?));
        let zeros = vec![0f32; shape.len()];
        let template = [
            keys.quantize(shape, &zeros)?,
            values.quantize(shape, &zeros)?,
        ];
        let format = |group: usize| -> Result<StorageFormat> {
            let group_size = u32::try_from(group)
                .map_err(|_| EngineError::Request(format!("group size {group} is too large")))?;
            Ok(match spec.bits {
                8 => StorageFormat::Int8 { group_size },
                4 => StorageFormat::Int4 { group_size },
                _ => StorageFormat::Int2 { group_size },
            })
        };
        Ok(ColdTier {
            spec,
            shape,
            keys,
            values,
            key_format: format(key_group)?,
            value_format: format(spec.group_size)?,
            blocks: RwLock::new(Vec::new()),
            template,
            mirror: None,
        })
    }

    pub(crate) fn spec(&self) -> KvQuant {
        self.spec
    }

    /// How keys and values are quantized.
    pub(crate) fn configs(&self) -> (QuantConfig, QuantConfig) {
        (self.keys.config(), self.values.config())
    }

    /// How the fused kernel reads this tier's blocks.
    pub(crate) fn kernel_format(&self) -> kvforge_kernels::ColdFormat {
        kvforge_kernels::ColdFormat::new(self.keys.config(), self.values.config(), self.spec.rotate)
    }

    /// Storage of keys and values, for the coordinator's byte counts.
    pub(crate) fn formats(&self) -> (StorageFormat, StorageFormat) {
        (self.key_format, self.value_format)
    }

    /// Stores `block` as cold block `id` (and in the device copy, if
    /// kept).
    pub(crate) fn put(&self, id: BlockId, block: Arc<ColdBlock>) -> Result<()> {
        let slot = TieredPool::slot_of(id) as usize;
        self.mirror_put(slot, &block)?;
        let mut v = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        if v.len() <= slot {
            v.resize(slot + 1, None);
        }
        v[slot] = Some((id.epoch(), block));
        Ok(())
    }

    /// The block at cold slot `slot`.
    pub(crate) fn get(&self, slot: usize) -> Option<Arc<ColdBlock>> {
        let v = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        v.get(slot)
            .and_then(|b| b.as_ref())
            .map(|(_, b)| Arc::clone(b))
    }

    /// Frees the storage of cold blocks no one holds or caches any more
    /// (a slot that holds a newer block keeps it).
    pub(crate) fn free(&self, ids: impl IntoIterator<Item = BlockId>) {
        let mut v = self.blocks.write().unwrap_or_else(|e| e.into_inner());
        for id in ids {
            if let Some(b) = v.get_mut(TieredPool::slot_of(id) as usize) {
                if b.as_ref().is_some_and(|(epoch, _)| *epoch == id.epoch()) {
                    *b = None;
                }
            }
        }
    }

    /// A block of `layers` layers back from its [`ColdBlock::content`]
    /// bytes (as a remote tier stores them); errors on a wrong length or a
    /// scale or minimum that is not finite.
    pub(crate) fn block_of_content(&self, layers: usize, bytes: &[u8]) -> Result<ColdBlock> {
        let sizes = |t: &QuantizedBlock| (t.packed.len(), t.scales.len(), t.mins.len());
        let need = layers * self.template.iter().map(|t| t.bytes()).sum::<usize>();
        if bytes.len() != need {
            return Err(EngineError::Request(format!(
                "a cold block of {layers} layers is {need} bytes, not {}",
                bytes.len()
            )));
        }
        let half = |b: &[u8]| -> Vec<half::f16> {
            b.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        let (mut at, mut slabs) = (0, Vec::with_capacity(2 * layers));
        for t in self
            .template
            .iter()
            .flat_map(|t| std::iter::repeat_n(t, layers))
        {
            let (p, s, m) = sizes(t);
            let mut take = |n: usize| {
                at += n;
                &bytes[at - n..at]
            };
            let packed = take(p).to_vec();
            let (scales, mins) = (half(take(2 * s)), half(take(2 * m)));
            if !scales.iter().chain(&mins).all(|x| x.is_finite()) {
                return Err(EngineError::Request(
                    "a cold block with a non-finite scale or minimum".into(),
                ));
            }
            slabs.push(QuantizedBlock {
                packed,
                scales,
                mins,
                ..t.clone()
            });
        }
        let v = slabs.split_off(layers);
        Ok(ColdBlock { k: slabs, v })
    }

    /// Bytes of one block's [`ColdBlock::content`] for `layers` layers.
    pub(crate) fn content_bytes(&self, layers: usize) -> usize {
        layers * self.template.iter().map(|t| t.bytes()).sum::<usize>()
    }

    /// Bytes of stored blocks (held, cached, or not yet freed).
    pub(crate) fn stored_bytes(&self) -> u64 {
        let v = self.blocks.read().unwrap_or_else(|e| e.into_inner());
        v.iter().flatten().map(|(_, b)| b.bytes()).sum()
    }

    /// Quantizes the block at slot `base` of every layer's K and V.
    pub(crate) fn quantize(&self, k: &[Tensor], v: &[Tensor], base: usize) -> Result<ColdBlock> {
        let slab = |t: &Tensor, layer: usize, q: &dyn Quantizer| -> Result<QuantizedBlock> {
            let x = t
                .f_narrow(0, base as i64, self.shape.tokens as i64)?
                .f_to_kind(Kind::Float)?
                .f_to_device(Device::Cpu)?
                .f_flatten(0, -1)?;
            let x = Vec::<f32>::try_from(x)?;
            q.quantize(self.shape, &x).map_err(|e| {
                EngineError::Request(format!(
                    "layer {layer}: {e}; the block stays in the hot tier"
                ))
            })
        };
        let mut block = ColdBlock {
            k: Vec::with_capacity(k.len()),
            v: Vec::with_capacity(v.len()),
        };
        for (l, (kt, vt)) in k.iter().zip(v).enumerate() {
            block.k.push(slab(kt, l, &*self.keys)?);
            block.v.push(slab(vt, l, &*self.values)?);
        }
        Ok(block)
    }

    /// The content a deduplicator compares: the block's bytes and, with
    /// `vector`, every layer's dequantized K then V.
    pub(crate) fn content(
        &self,
        block: &ColdBlock,
        vector: bool,
    ) -> Result<kvforge_coordinator::Content> {
        let mut v = Vec::new();
        if vector {
            let n = self.shape.len();
            v.resize(n * (block.k.len() + block.v.len()), 0f32);
            for (i, q) in block.k.iter().chain(&block.v).enumerate() {
                let dq = if i < block.k.len() {
                    &*self.keys
                } else {
                    &*self.values
                };
                dq.dequantize(q, &mut v[i * n..(i + 1) * n])?;
            }
        }
        Ok(kvforge_coordinator::Content {
            bytes: block.content(),
            vector: v,
        })
    }

    /// Dequantizes layer `layer`'s K (or V, with `values`) of `blocks`,
    /// in order, into `dst` (`[blocks × tokens, heads, head_dim]`, any
    /// dtype and device).
    pub(crate) fn dequantize_into(
        &self,
        blocks: &[Arc<ColdBlock>],
        layer: usize,
        values: bool,
        dst: &mut Tensor,
    ) -> Result<()> {
        let q = if values { &*self.values } else { &*self.keys };
        let fill = |t: &mut Tensor| -> Result<()> {
            with_uninit_f32(t, |buf| {
                buf.chunks_mut(self.shape.len())
                    .zip(blocks)
                    .try_for_each(|(o, b)| {
                        let src = if values { &b.v[layer] } else { &b.k[layer] };
                        q.dequantize_uninit(src, o).map(|_| ())
                    })
                    .map_err(EngineError::from)
            })
        };
        if dst.kind() == Kind::Float && dst.device() == Device::Cpu && dst.is_contiguous() {
            return fill(dst);
        }
        let (h, d) = (self.shape.heads as i64, self.shape.head_dim as i64);
        let n = (blocks.len() * self.shape.tokens) as i64;
        let mut tmp = Tensor::f_empty([n, h, d], (Kind::Float, Device::Cpu))?;
        fill(&mut tmp)?;
        dst.f_copy_(&tmp)?;
        Ok(())
    }
}

/// Runs `f` on the storage of `t`, a contiguous CPU f32 tensor, as
/// possibly uninitialized elements (`t` may come from `Tensor::empty`):
/// `f` must write what it reads.
fn with_uninit_f32<T>(
    t: &mut Tensor,
    f: impl FnOnce(&mut [MaybeUninit<f32>]) -> Result<T>,
) -> Result<T> {
    if t.kind() != Kind::Float || t.device() != Device::Cpu || !t.is_contiguous() {
        return Err(EngineError::Torch(
            "cold-tier buffer must be a contiguous CPU f32 tensor".into(),
        ));
    }
    let n = t.numel();
    if n == 0 {
        return f(&mut []);
    }
    // SAFETY: `t` is a contiguous CPU tensor of `n` f32 elements starting at
    // `data_ptr()` (checked above); it is borrowed mutably for the call, so
    // no other Rust reference reads or writes its storage meanwhile. The
    // elements are exposed as `MaybeUninit`, so uninitialized storage is
    // never read as `f32`.
    let buf = unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<MaybeUninit<f32>>(), n) };
    f(buf)
}
