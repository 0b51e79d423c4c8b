//! The quantized cold tier of the paged cache.
//!
//! The newest `window` tokens of a sequence stay in the cache's dtype. Every
//! whole block entirely older than that is quantized with `kvforge-quant`
//! (K and V of every layer) into a [`ColdBlock`] owned by the sequence, and
//! its hot block goes back to the pool: the bytes are really released.
//! Attention reads cold blocks dequantized on the fly, per layer and step,
//! straight into the K/V tensor it attends over (dequantize-then-attend).
//!
//! Keys may be Hadamard-rotated before quantizing; dequantizing rotates them
//! back, so the attention path does not change.

use std::mem::MaybeUninit;

use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantError, QuantizedBlock, Quantizer, Rotated,
    TierPlan,
};
use tch::{Device, Kind, Tensor};

use crate::{EngineError, Result};

/// How a cache quantizes blocks that leave the hot window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuant {
    /// Bits per element: 8 (symmetric), 4 or 2 (affine).
    pub bits: u32,
    /// Elements per group along the head dim (values; per-token keys).
    /// Per-channel key groups span one block's tokens.
    pub group_size: usize,
    /// Newest tokens kept in full precision: a whole number of blocks
    /// (rejected otherwise).
    pub window: usize,
    /// Hadamard-rotate keys before quantizing.
    pub rotate: bool,
    /// Key groups per channel (KIVI) or per token. Values are always
    /// quantized per token.
    pub key_axis: Axis,
    /// The first tokens of the sequence kept in full precision (attention
    /// sinks, as in StreamingLLM): a whole number of blocks.
    pub sink: usize,
}

impl KvQuant {
    /// `int4` etc. with defaults: group 32, window 128, per-channel keys,
    /// no rotation, a 32-token sink.
    pub fn parse(format: &str) -> Result<Self> {
        Ok(KvQuant {
            bits: QuantConfig::parse_bits(format)?,
            group_size: 32,
            window: 128,
            rotate: false,
            key_axis: Axis::PerChannel,
            sink: 32,
        })
    }

    /// A short label: `int4-g32-w128-kc` (`+rot` when rotated, `-s32`
    /// with a 32-token sink).
    pub fn name(&self) -> String {
        let axis = match self.key_axis {
            Axis::PerChannel => "kc",
            Axis::PerToken => "kt",
        };
        let rot = if self.rotate { "+rot" } else { "" };
        let sink = if self.sink > 0 {
            format!("-s{}", self.sink)
        } else {
            String::new()
        };
        format!(
            "int{}-g{}-w{}{sink}-{axis}{rot}",
            self.bits, self.group_size, self.window
        )
    }
}

/// One block of the cold tier: K and V of every layer, quantized.
#[derive(Clone, Debug)]
pub struct ColdBlock {
    k: Vec<QuantizedBlock>,
    v: Vec<QuantizedBlock>,
}

impl ColdBlock {
    /// Bytes held: codes plus group parameters of every layer.
    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|b| b.bytes() as u64).sum()
    }
}

/// The quantizers and plan of a cache's cold tier.
pub(crate) struct ColdTier {
    spec: KvQuant,
    plan: TierPlan,
    shape: BlockShape,
    keys: Box<dyn Quantizer>,
    values: Box<dyn Quantizer>,
}

impl ColdTier {
    /// Checks `spec` against the cache's block shape (group sizes dividing
    /// their axis, a power-of-two head dim for rotation, the window a
    /// multiple of the block size) by quantizing a zero block.
    pub(crate) fn new(spec: KvQuant, shape: BlockShape) -> Result<Self> {
        let plan = TierPlan::new(shape.tokens, spec.window)?;
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
        keys.quantize(shape, &zeros)?;
        values.quantize(shape, &zeros)?;
        Ok(ColdTier {
            spec,
            plan,
            shape,
            keys,
            values,
        })
    }

    pub(crate) fn spec(&self) -> KvQuant {
        self.spec
    }

    /// Cold blocks a sequence of `len` tokens should have: whole blocks
    /// after the sink and older than the window.
    pub(crate) fn cold_blocks(&self, len: usize) -> usize {
        self.plan.cold_blocks(len.saturating_sub(self.spec.sink))
    }

    /// Blocks of the sink.
    pub(crate) fn sink_blocks(&self) -> usize {
        self.spec.sink / self.shape.tokens
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

    /// All positions of one layer's K or V, `[sink | cold | hot]`: `slots`
    /// are the hot positions' slots in `hot` (the cache tensor), the sink's
    /// first; the cold blocks are dequantized in between.
    pub(crate) fn assemble(
        &self,
        cold: &[ColdBlock],
        layer: usize,
        values: bool,
        hot: &Tensor,
        slots: &Tensor,
    ) -> Result<Tensor> {
        let (t, h, d) = (self.shape.tokens, self.shape.heads, self.shape.head_dim);
        let cold_len = (cold.len() * t) as i64;
        let sink = self.spec.sink as i64;
        let hot_len = slots.size1()? - sink;
        let (h, d) = (h as i64, d as i64);
        let direct = hot.kind() == Kind::Float && hot.device() == Device::Cpu;
        let total = sink + cold_len + hot_len;
        let out = Tensor::f_empty([total, h, d], (hot.kind(), hot.device()))?;
        let q = if values { &*self.values } else { &*self.keys };
        let fill = |dst: &mut Tensor| -> Result<()> {
            with_uninit_f32(dst, |buf| {
                buf.chunks_mut(self.shape.len())
                    .zip(cold.iter())
                    .try_for_each(|(o, b)| {
                        let src = if values { &b.v[layer] } else { &b.k[layer] };
                        q.dequantize_uninit(src, o).map(|_| ())
                    })
                    .map_err(EngineError::from)
            })
        };
        if direct {
            fill(&mut out.f_narrow(0, sink, cold_len)?)?;
        } else {
            let mut tmp = Tensor::f_empty([cold_len, h, d], (Kind::Float, Device::Cpu))?;
            fill(&mut tmp)?;
            out.f_narrow(0, sink, cold_len)?.f_copy_(&tmp)?;
        }
        for (at, from, n) in [(0, 0, sink), (sink + cold_len, sink, hot_len)] {
            if n > 0 {
                let dst = out.f_narrow(0, at, n)?;
                let _ = hot.f_index_select_out(&dst, 0, &slots.f_narrow(0, from, n)?)?;
            }
        }
        Ok(out)
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
