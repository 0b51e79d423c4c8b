//! The attention-backend seam: one layer's queries over a block table.
//!
//! A [`StepView`] is what one step attends over, resolved once per step
//! from the coordinator's table: the live entries in position order as
//! runs of hot slots and cold blocks (aliases resolved to their canonical
//! block, dropped entries skipped), the position of every key, and where
//! the queries sit. An [`AttentionBackend`] attends one layer over it and,
//! when asked, says how much attention each entry received (an eviction
//! policy's input).
//!
//! Keys are stored after RoPE at the position they were computed at, and
//! the mask compares positions, not indexes: when entries are dropped, the
//! keys after them keep their positions and causality holds.

use std::sync::Arc;

use tch::Tensor;

use crate::error::Result;
use crate::tier::{ColdBlock, ColdTier};

mod view;

pub use view::StepView;

use signals::{entry_key_novelty, entry_mass};
mod signals;
#[cfg(test)]
mod tests;

/// Consecutive live keys stored the same way.
enum Run {
    /// Hot-tier slots (`[len]` int64 indexes into the layer's K/V tensors).
    Hot { slots: Tensor, len: i64 },
    /// Cold blocks, dequantized on the fly.
    Cold {
        blocks: Vec<Arc<ColdBlock>>,
        len: i64,
    },
}

/// Where one live table entry's keys are, for kernels that read the
/// table in place.
pub(crate) enum PageRef {
    /// `len` hot slots from `slot`.
    Hot { slot: usize, len: usize },
    /// A cold block (an alias's canonical block) at cold slot `slot`, its
    /// first `len` tokens.
    Cold {
        block: Arc<ColdBlock>,
        slot: usize,
        len: usize,
    },
}

/// One i64 per live key, in position order, as the CUDA kernel reads a
/// table: a hot slot, or `-1 − (slot × block_size + row)` for row `row`
/// of cold slot `slot`.
pub(crate) fn kernel_table(pages: &[(PageRef, usize)], block_size: usize) -> Vec<i64> {
    let mut out = Vec::new();
    for (page, _) in pages {
        match page {
            PageRef::Hot { slot, len } => out.extend((*slot..slot + len).map(|s| s as i64)),
            PageRef::Cold { slot, len, .. } => {
                let base = slot * block_size;
                out.extend((base..base + len).map(|r| -1 - r as i64));
            }
        }
    }
    out
}

/// The storage a backend reads: the hot tier's per-layer K/V tensors
/// (`[slots, kv_heads, head_dim]`, slot `block × block_size + row`) and the
/// cold tier. A backend reads a step's keys and values through
/// [`StepView::gather`], or the hot tensors directly at the view's slots.
pub struct KvTensors<'a> {
    pub(crate) k: &'a [Tensor],
    pub(crate) v: &'a [Tensor],
    pub(crate) cold: Option<&'a ColdTier>,
}

impl KvTensors<'_> {
    /// Layers stored.
    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// Layer `layer`'s hot keys, `[slots, kv_heads, head_dim]`.
    pub fn keys(&self, layer: usize) -> Option<&Tensor> {
        self.k.get(layer)
    }

    /// Layer `layer`'s hot values, `[slots, kv_heads, head_dim]`.
    pub fn values(&self, layer: usize) -> Option<&Tensor> {
        self.v.get(layer)
    }

    /// Whether a cold tier is attached (its blocks are read dequantized
    /// through [`StepView::gather`]).
    pub fn has_cold_tier(&self) -> bool {
        self.cold.is_some()
    }
}

/// What an eviction policy asked the backend to report per entry, besides
/// the output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Observe {
    /// The attention mass each entry received.
    pub mass: bool,
    /// How far each entry's keys stand from the mean key (KeyDiff).
    pub key_novelty: bool,
    /// The mass (summed over each KV head's query heads) and key novelty
    /// per entry and KV head (`entries × kv_heads`, at `entry × kv_heads +
    /// head`) instead of over all heads.
    pub per_head: bool,
    /// The mass from the step's last `window` queries only (SnapKV's
    /// observation window); 0 for every query.
    pub window: usize,
    /// The mass and key novelty per row of the table (`entries ×
    /// block_size`; the novelty averaged over KV heads) instead of per
    /// entry: for token-level eviction.
    pub per_token: bool,
}

/// One layer's attention output, and what was asked of it per entry.
pub struct Attended {
    /// `[n, heads, head_dim]` in the query's dtype.
    pub out: Tensor,
    /// Per entry of the step's table: attention weight summed over heads
    /// and queries (0 for dropped entries). Present when asked for.
    pub mass: Option<Vec<f32>>,
    /// Per entry: `1 − cos(key, mean live key)` averaged over its keys and
    /// KV heads (0 for dropped entries); with [`Observe::per_head`] per
    /// entry and KV head. Present when asked for.
    pub key_novelty: Option<Vec<f32>>,
}

/// Attends one layer's queries over a [`StepView`].
pub trait AttentionBackend: Send + Sync {
    /// A short name for reports.
    fn name(&self) -> &'static str;

    /// `q`: `[n, heads, head_dim]`, already rotated, at positions
    /// `view.start()..`. Every live key of the view (the step's own
    /// included, already written) at or before a query's position is
    /// visible to it. Also returns what `observe` asks for: the attention
    /// each entry received, each entry's key novelty.
    fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        view: &StepView,
        kv: &KvTensors<'_>,
        observe: Observe,
    ) -> Result<Attended>;
}

/// Gather + SDPA: the live keys are gathered into one tensor (cold blocks
/// dequantized, aliases read from their canonical block), then
/// libtorch's scaled dot-product attention runs with a position mask. The
/// attention mass, when asked, comes from an explicit softmax; key novelty
/// from the same gathered keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceBackend;

impl AttentionBackend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        view: &StepView,
        kv: &KvTensors<'_>,
        observe: Observe,
    ) -> Result<Attended> {
        let kind = q.kind();
        let (h, hkv) = (q.size()[1], kv.k[layer].size()[1]);
        // [1, heads, len, hd]
        let prep = |t: Tensor| -> Result<Tensor> {
            Ok(t.f_to_kind(kind)?.f_transpose(0, 1)?.f_unsqueeze(0)?)
        };
        let keys = view.gather(kv, layer, false, kind)?;
        let key_novelty = if observe.key_novelty {
            Some(entry_key_novelty(view, &keys, observe)?)
        } else {
            None
        };
        let k = prep(keys)?;
        let v = prep(view.gather(kv, layer, true, kind)?)?;
        let q4 = q.f_transpose(0, 1)?.f_unsqueeze(0)?;
        let out = Tensor::f_scaled_dot_product_attention(
            &q4,
            &k,
            &v,
            view.mask.as_ref(),
            0.0,
            view.causal,
            None::<f64>,
            hkv != h,
        )?;
        let out = out.f_squeeze_dim(0)?.f_transpose(0, 1)?;
        let mass = if observe.mass {
            Some(entry_mass(view, &q4, &k, h / hkv, observe)?)
        } else {
            None
        };
        Ok(Attended {
            out,
            mass,
            key_novelty,
        })
    }
}

/// Per-key values of every KV head (`[kv_heads][keys]`, head-major) folded
/// into table entries, entry-major (`entry × kv_heads + head`); `mean`
/// averages over an entry's keys instead of summing.
pub(crate) fn interleave_heads(view: &StepView, per_key: &[f32], mean: bool) -> Vec<f32> {
    let keys = view.keys.max(1) as usize;
    let h = per_key.len() / keys;
    let mut out = vec![0f32; view.entries() * h];
    for (j, head) in per_key.chunks_exact(keys).enumerate() {
        for (e, x) in view.per_entry(head, mean).iter().enumerate() {
            out[e * h + j] = *x;
        }
    }
    out
}
