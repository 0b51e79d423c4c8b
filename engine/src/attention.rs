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

use kvforge_coordinator::{BlockTable, Slot, TieredPool};
use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::tier::{ColdBlock, ColdTier};

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

/// What one step of one sequence attends over.
pub struct StepView {
    runs: Vec<Run>,
    /// The live entries in order, with their table index.
    pub(crate) pages: Vec<(PageRef, usize)>,
    /// Live keys.
    keys: i64,
    /// Position of the first query; queries are `start..start + n`.
    start: i64,
    n: i64,
    /// `[n, keys]` bool, true where a query may see a key; `None` when
    /// every key is visible to every query, or the keys are exactly the
    /// positions `0..start + n` from an empty start (plain causal).
    mask: Option<Tensor>,
    causal: bool,
    /// Per table entry, the live keys it holds (0 when dropped): to sum the
    /// attention mass per entry.
    entry_keys: Vec<i64>,
    /// Per live key, its row of the table: `entry × block_size + row` (a
    /// token-level policy's signal is per row).
    key_rows: Vec<u32>,
    block_size: usize,
    /// On a GPU, with cold entries in the view: [`kernel_table`] on the
    /// device (an all-hot view's table is its one run of hot slots).
    mixed_table: Option<Tensor>,
}

impl StepView {
    /// Resolves `table` (the planned table of the step, holding the `n`
    /// new tokens at its end) against the hot tensors' block size and the
    /// cold tier's storage.
    pub(crate) fn new(
        table: &BlockTable,
        n: usize,
        block_size: usize,
        cold: Option<&ColdTier>,
        device: Device,
    ) -> Result<Self> {
        let positions = table.positions() as i64;
        let (start, n) = (positions - n as i64, n as i64);
        let mut runs: Vec<Run> = Vec::new();
        let mut hot: Vec<i64> = Vec::new();
        let mut cold_run: Vec<Arc<ColdBlock>> = Vec::new();
        let mut key_pos: Vec<i64> = Vec::new();
        let mut entry_keys = Vec::with_capacity(table.entries().len());
        let mut pages = Vec::with_capacity(table.entries().len());
        let dense = table
            .entries()
            .iter()
            .all(|e| e.slot().is_live() && e.holes() == 0);
        let mut key_rows: Vec<u32> = Vec::new();
        let bs = block_size as i64;
        let flush_hot = |hot: &mut Vec<i64>, runs: &mut Vec<Run>| -> Result<()> {
            if !hot.is_empty() {
                let len = hot.len() as i64;
                let slots = Tensor::f_from_slice(hot)?.f_to_device(device)?;
                runs.push(Run::Hot { slots, len });
                hot.clear();
            }
            Ok(())
        };
        let flush_cold = |c: &mut Vec<Arc<ColdBlock>>, runs: &mut Vec<Run>| {
            if !c.is_empty() {
                let len = c.len() as i64 * bs;
                runs.push(Run::Cold {
                    blocks: std::mem::take(c),
                    len,
                });
            }
        };
        for e in table.entries() {
            let first = e.first() as i64;
            let len = i64::from(e.tokens());
            let row0 = (entry_keys.len() * block_size) as u32;
            match e.slot() {
                Slot::Hot(b) if e.holes() != 0 => {
                    // Token-level eviction: only the live rows, one page
                    // per run of them.
                    flush_cold(&mut cold_run, &mut runs);
                    let base = i64::from(TieredPool::slot_of(b)) * bs;
                    let live = |r: &i64| e.holes() >> r & 1 == 0;
                    let rows: Vec<i64> = (0..len).filter(live).collect();
                    for run in rows.chunk_by(|a, b| a + 1 == *b) {
                        let (slot, len) = ((base + run[0]) as usize, run.len());
                        pages.push((PageRef::Hot { slot, len }, entry_keys.len()));
                    }
                    hot.extend(rows.iter().map(|r| base + r));
                    key_rows.extend(rows.iter().map(|&r| row0 + r as u32));
                    key_pos.extend(rows.iter().map(|r| first + r));
                    entry_keys.push(rows.len() as i64);
                    continue;
                }
                Slot::Hot(b) => {
                    flush_cold(&mut cold_run, &mut runs);
                    let base = i64::from(TieredPool::slot_of(b)) * bs;
                    hot.extend(base..base + len);
                    let (slot, len) = (base as usize, len as usize);
                    pages.push((PageRef::Hot { slot, len }, entry_keys.len()));
                }
                Slot::Cold(b) | Slot::Alias { canonical: b } => {
                    flush_hot(&mut hot, &mut runs)?;
                    let slot = TieredPool::slot_of(b) as usize;
                    let block = cold.and_then(|c| c.get(slot)).ok_or_else(|| {
                        EngineError::Torch(format!("cold block {b} has no stored content"))
                    })?;
                    let page = PageRef::Cold {
                        block: Arc::clone(&block),
                        slot,
                        len: len as usize,
                    };
                    pages.push((page, entry_keys.len()));
                    cold_run.push(block);
                }
                Slot::Dropped => {
                    entry_keys.push(0);
                    continue;
                }
            }
            entry_keys.push(len);
            key_rows.extend(row0..row0 + len as u32);
            if !dense {
                key_pos.extend(first..first + len);
            }
        }
        flush_hot(&mut hot, &mut runs)?;
        flush_cold(&mut cold_run, &mut runs);
        let keys: i64 = entry_keys.iter().sum();
        let causal = dense && start == 0 && n > 1;
        let mask = if n > 1 && !causal {
            let k = if dense {
                Tensor::f_arange(keys, (Kind::Int64, device))?
            } else {
                Tensor::f_from_slice(&key_pos)?.f_to_device(device)?
            };
            let q = Tensor::f_arange_start(start, start + n, (Kind::Int64, device))?;
            Some(k.f_unsqueeze(0)?.f_le_tensor(&q.f_unsqueeze(1)?)?)
        } else {
            None
        };
        let mixed_table = if device.is_cuda() && n == 1 && cold.is_some_and(ColdTier::mirrored) {
            let cold_pages = pages.iter().any(|(p, _)| matches!(p, PageRef::Cold { .. }));
            cold_pages
                .then(|| {
                    Tensor::f_from_slice(&kernel_table(&pages, block_size))?.f_to_device(device)
                })
                .transpose()?
        } else {
            None
        };
        Ok(StepView {
            runs,
            pages,
            keys,
            start,
            n,
            mask,
            causal,
            entry_keys,
            key_rows,
            block_size,
            mixed_table,
        })
    }

    /// The CUDA kernel's key table on the device ([`kernel_table`]): the
    /// one run of hot slots of an all-hot view, or the mixed table built
    /// for a view with cold entries on a GPU with a mirrored cold tier.
    pub(crate) fn device_table(&self) -> Option<&Tensor> {
        match self.runs.as_slice() {
            [Run::Hot { slots, .. }] => Some(slots),
            _ => self.mixed_table.as_ref(),
        }
    }

    /// The block size the table's rows count in.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Folds one value per live key (in position order) into one per row
    /// of the table (`entries × block_size`, row `r` of entry `i` at `i ×
    /// block_size + r`; 0 for rows not read): a token-level policy's input.
    pub(crate) fn per_row(&self, per_key: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.entry_keys.len() * self.block_size];
        for (&at, &x) in self.key_rows.iter().zip(per_key) {
            out[at as usize] += x;
        }
        out
    }

    /// Live keys attended over.
    pub fn keys(&self) -> usize {
        self.keys as usize
    }

    /// Position of the first query.
    pub fn start(&self) -> usize {
        self.start as usize
    }

    /// Entries of the step's table, dropped ones included.
    pub fn entries(&self) -> usize {
        self.entry_keys.len()
    }

    /// Folds one value per live key (in position order) into one per table
    /// entry: their sum, or with `mean` their mean (0 for an entry without
    /// live keys).
    pub(crate) fn per_entry(&self, per_key: &[f32], mean: bool) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.entry_keys.len());
        let mut at = 0usize;
        for &len in &self.entry_keys {
            let len = len as usize;
            let sum: f32 = per_key[at..at + len].iter().sum();
            out.push(match (mean, len) {
                (false, _) => sum,
                (true, 0) => 0.0,
                (true, _) => sum / len as f32,
            });
            at += len;
        }
        out
    }

    /// One layer's K (or V, with `values`) of every live key, in position
    /// order: `[keys, kv_heads, head_dim]` in `kind` (cold blocks are
    /// dequantized straight into it, not rounded to the storage dtype).
    pub(crate) fn gather(
        &self,
        kv: &KvTensors<'_>,
        layer: usize,
        values: bool,
        kind: Kind,
    ) -> Result<Tensor> {
        let src = if values { &kv.v[layer] } else { &kv.k[layer] };
        if let [Run::Hot { slots, .. }] = self.runs.as_slice() {
            return Ok(src.f_index_select(0, slots)?.f_to_kind(kind)?);
        }
        let size = src.size();
        let out = Tensor::f_empty([self.keys, size[1], size[2]], (kind, src.device()))?;
        let mut at = 0;
        for run in &self.runs {
            match run {
                Run::Hot { slots, len } => {
                    let mut dst = out.f_narrow(0, at, *len)?;
                    if src.kind() == kind {
                        let _ = src.f_index_select_out(&dst, 0, slots)?;
                    } else {
                        dst.f_copy_(&src.f_index_select(0, slots)?)?;
                    }
                    at += len;
                }
                Run::Cold { blocks, len } => {
                    let tier = kv.cold.ok_or_else(|| {
                        EngineError::Torch("cold entries without a cold tier".into())
                    })?;
                    let mut dst = out.f_narrow(0, at, *len)?;
                    tier.dequantize_into(blocks, layer, values, &mut dst)?;
                    at += len;
                }
            }
        }
        Ok(out)
    }
}

/// The storage a backend reads: the hot tier's per-layer K/V tensors and
/// the cold tier.
pub struct KvTensors<'a> {
    pub(crate) k: &'a [Tensor],
    pub(crate) v: &'a [Tensor],
    pub(crate) cold: Option<&'a ColdTier>,
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

/// KeyDiff's signal for one layer, per table entry, from the view's live
/// keys `[keys, kv_heads, head_dim]`: `1 − cos(key, mean key)` per key and
/// head, averaged over heads (unless `per_head`: then one value per entry
/// and head) and over the entry's keys (0 for dropped entries); with
/// `per_token`, one value per row of the table.
fn entry_key_novelty(view: &StepView, keys: &Tensor, observe: Observe) -> Result<Vec<f32>> {
    let k = keys.f_to_kind(Kind::Float)?;
    let unit = |t: &Tensor| -> Result<Tensor> {
        let n = t.f_norm_scalaropt_dim(2, [-1i64].as_slice(), true)?;
        Ok(t / n.f_clamp_min(1e-12)?)
    };
    let mean = k.f_mean_dim([0i64].as_slice(), true, Kind::Float)?; // [1, h, d]
    let cos =
        (unit(&k)? * unit(&mean)?).f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?;
    let novelty = cos.f_neg()? + 1.0; // [keys, h]
    if observe.per_head {
        let v = Vec::<f32>::try_from(
            novelty
                .f_transpose(0, 1)?
                .f_contiguous()?
                .f_flatten(0, -1)?
                .f_to_device(Device::Cpu)?,
        )?;
        return Ok(interleave_heads(view, &v, true));
    }
    let novelty = novelty
        .f_mean_dim([1i64].as_slice(), false, Kind::Float)?
        .f_to_device(Device::Cpu)?;
    let novelty = Vec::<f32>::try_from(novelty)?;
    Ok(if observe.per_token {
        view.per_row(&novelty)
    } else {
        view.per_entry(&novelty, true)
    })
}

/// Softmax weights of every query (of the last `observe.window`, if set)
/// over the keys, summed over heads (or over each KV head's group) and
/// queries, then per table entry (and KV head, entry-major).
fn entry_mass(
    view: &StepView,
    q: &Tensor,
    k: &Tensor,
    group: i64,
    observe: Observe,
) -> Result<Vec<f32>> {
    let d = q.size()[3] as f64;
    let k = if group > 1 {
        k.f_repeat_interleave_self_int(group, 1, None)?
    } else {
        k.shallow_clone()
    };
    let q = q.f_to_kind(Kind::Float)?;
    let k = k.f_to_kind(Kind::Float)?;
    let mut scores = q.f_matmul(&k.f_transpose(2, 3)?)? / d.sqrt(); // [1, h, n, keys]
    let visible = match (&view.mask, view.causal) {
        (Some(m), _) => Some(m.shallow_clone()),
        (None, true) => {
            let dev = q.device();
            let kp = Tensor::f_arange(view.keys, (Kind::Int64, dev))?;
            let qp = Tensor::f_arange(view.n, (Kind::Int64, dev))?;
            Some(kp.f_unsqueeze(0)?.f_le_tensor(&qp.f_unsqueeze(1)?)?)
        }
        (None, false) => None,
    };
    if let Some(m) = visible {
        scores = scores.f_masked_fill(&m.f_logical_not()?, f64::NEG_INFINITY)?;
    }
    let mut w = scores.f_softmax(-1, Kind::Float)?; // [1, h, n, keys]
    let n = w.size()[2];
    if observe.window > 0 && (observe.window as i64) < n {
        let last = observe.window as i64;
        w = w.f_narrow(2, n - last, last)?;
    }
    if !observe.per_head {
        let w = w
            .f_sum_dim_intlist([0i64, 1, 2].as_slice(), false, Kind::Float)?
            .f_to_device(Device::Cpu)?;
        let w = Vec::<f32>::try_from(w)?;
        return Ok(if observe.per_token {
            view.per_row(&w)
        } else {
            view.per_entry(&w, false)
        });
    }
    // [h, keys] -> [kv_heads, keys], summed over each group's query heads.
    let keys = w.size()[3];
    let w = w
        .f_sum_dim_intlist([0i64, 2].as_slice(), false, Kind::Float)?
        .f_view([-1, group, keys])?
        .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Float)?
        .f_contiguous()?
        .f_to_device(Device::Cpu)?;
    let flat = Vec::<f32>::try_from(w.f_flatten(0, -1)?)?;
    Ok(interleave_heads(view, &flat, false))
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kvforge_pool::{BlockId, BlockTable, Slot};
    use tch::{Device, Kind, Tensor};

    use super::*;

    /// Softmax attention of one query row over explicit keys and values
    /// (`[keys, d]` each), in f64 on plain vectors.
    fn dense(q: &[f64], k: &[Vec<f64>], v: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
        let d = q.len() as f64;
        let s: Vec<f64> = k
            .iter()
            .map(|kk| kk.iter().zip(q).map(|(a, b)| a * b).sum::<f64>() / d.sqrt())
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let w: Vec<f64> = e.iter().map(|x| x / z).collect();
        let out = (0..v[0].len())
            .map(|c| w.iter().zip(v).map(|(wi, vv)| wi * vv[c]).sum())
            .collect();
        (out, w)
    }

    fn row(t: &Tensor, i: i64) -> Vec<f64> {
        Vec::<f64>::try_from(t.get(i).to_kind(Kind::Double).flatten(0, -1)).unwrap()
    }

    /// Entries [hot 0..4 | dropped 4..8 | hot 8..12 | hot 12..14 (new)]:
    /// two queries at positions 12 and 13 see the live keys at or before
    /// their position — the dropped ones never, the keys after the drop at
    /// their own positions — and the mass per entry is the softmax weight
    /// each entry's keys received, summed over queries (0 when dropped).
    #[test]
    fn dropped_entries_are_skipped_positions_kept_and_mass_is_per_entry() {
        let (bs, d) = (4i64, 8i64);
        let k = Tensor::randn([16, 1, d], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([16, 1, d], (Kind::Float, Device::Cpu));
        let mut table = BlockTable::new(bs as u32).unwrap();
        // Hot blocks at slots 2, 0, 3 (positions are not slots).
        table.push(Slot::Hot(BlockId::new(2, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(0, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(3, 1)), 2, true).unwrap();
        table.set_slot(1, Slot::Dropped).unwrap();
        let view = StepView::new(&table, 2, bs as usize, None, Device::Cpu).unwrap();
        assert_eq!((view.keys(), view.start()), (10, 12));
        let q = Tensor::randn([2, 1, d], (Kind::Float, Device::Cpu));
        let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
        let kv = KvTensors {
            k: &ks,
            v: &vs,
            cold: None,
        };
        let observe = Observe {
            mass: true,
            ..Observe::default()
        };
        let a = ReferenceBackend.attend(0, &q, &view, &kv, observe).unwrap();
        assert!(a.key_novelty.is_none(), "not asked for");
        // Live slots in position order: block 2, block 0, block 3.
        let slots: Vec<i64> = (8..12).chain(0..4).chain(12..14).collect();
        let mass = a.mass.unwrap();
        let mut want_mass = [0f64; 4];
        for (qi, visible) in [(0i64, 9usize), (1, 10)] {
            let keys: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| row(&k, s)).collect();
            let vals: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| row(&v, s)).collect();
            let (out, w) = dense(&row(&q, qi), &keys, &vals);
            let got = row(&a.out, qi);
            for (x, y) in got.iter().zip(&out) {
                assert!((x - y).abs() < 1e-4, "query {qi}: {got:?} vs {out:?}");
            }
            for (j, wj) in w.iter().enumerate() {
                want_mass[[0, 2, 3][j / 4]] += wj;
            }
        }
        assert_eq!(mass.len(), 4);
        assert_eq!(mass[1], 0.0, "dropped");
        for (m, w) in mass.iter().zip(want_mass) {
            assert!(
                (f64::from(*m) - w).abs() < 1e-4,
                "{mass:?} vs {want_mass:?}"
            );
        }
        assert!(
            (mass.iter().sum::<f32>() - 2.0).abs() < 1e-4,
            "one per query"
        );
    }

    /// SnapKV's observation: with a window of 2 of the step's 3 queries and
    /// per KV head, each entry's mass is the softmax weight the last two
    /// queries of each KV head's query heads gave its keys.
    #[test]
    fn windowed_mass_per_head_counts_only_the_last_queries() {
        let (bs, h, hkv, d) = (4i64, 4i64, 2i64, 8i64);
        let k = Tensor::randn([16, hkv, d], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([16, hkv, d], (Kind::Float, Device::Cpu));
        let mut table = BlockTable::new(bs as u32).unwrap();
        table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(0, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(2, 1)), 3, true).unwrap();
        let view = StepView::new(&table, 3, bs as usize, None, Device::Cpu).unwrap();
        let q = Tensor::randn([3, h, d], (Kind::Float, Device::Cpu));
        let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
        let kv = KvTensors {
            k: &ks,
            v: &vs,
            cold: None,
        };
        let observe = Observe {
            mass: true,
            per_head: true,
            window: 2,
            ..Observe::default()
        };
        let mass = ReferenceBackend
            .attend(0, &q, &view, &kv, observe)
            .unwrap()
            .mass
            .unwrap();
        // Keys in position order: slots 4..8, 0..4, 8..11; queries at
        // positions 8, 9, 10 see 9, 10, 11 keys.
        let slots: Vec<i64> = (4..8).chain(0..4).chain(8..11).collect();
        let mut want = [0f64; 3 * 2];
        for qi in 1..3i64 {
            for head in 0..h {
                let kh = head / (h / hkv);
                let visible = 9 + qi as usize;
                let at = |t: &Tensor, s: i64| row(&t.get(s), kh);
                let keys: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| at(&k, s)).collect();
                let vals: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| at(&v, s)).collect();
                let (_, w) = dense(&row(&q.get(qi), head), &keys, &vals);
                for (j, wj) in w.iter().enumerate() {
                    want[(j / 4) * 2 + kh as usize] += wj;
                }
            }
        }
        assert_eq!(mass.len(), 6);
        for (m, w) in mass.iter().zip(want) {
            assert!((f64::from(*m) - w).abs() < 1e-4, "{mass:?} vs {want:?}");
        }
        // Two queries × four heads of weight one each.
        assert!((mass.iter().sum::<f32>() - 8.0).abs() < 1e-4);
    }

    /// Token-level eviction's holes: attention reads only a holed entry's
    /// live rows, and the mass per row lands on those rows (0 on holes).
    #[test]
    fn holes_are_skipped_and_mass_per_token_is_per_row() {
        let (bs, d) = (4i64, 8i64);
        let k = Tensor::randn([12, 1, d], (Kind::Float, Device::Cpu));
        let v = Tensor::randn([12, 1, d], (Kind::Float, Device::Cpu));
        let mut table = BlockTable::new(bs as u32).unwrap();
        table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
        table.punch(0, 0b0110).unwrap();
        table.push(Slot::Hot(BlockId::new(2, 1)), 2, true).unwrap();
        let view = StepView::new(&table, 1, bs as usize, None, Device::Cpu).unwrap();
        assert_eq!((view.keys(), view.start()), (4, 5));
        let q = Tensor::randn([1, 1, d], (Kind::Float, Device::Cpu));
        let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
        let kv = KvTensors {
            k: &ks,
            v: &vs,
            cold: None,
        };
        let per_token = Observe {
            mass: true,
            per_token: true,
            ..Observe::default()
        };
        // Fused without a signal reads the holed page as two spans; with a
        // per-token signal it falls back to the reference.
        let fused = crate::fused::FusedBackend::default();
        for (backend, observe) in [
            (&ReferenceBackend as &dyn AttentionBackend, per_token),
            (&fused, per_token),
            (&fused, Observe::default()),
        ] {
            let a = backend.attend(0, &q, &view, &kv, observe).unwrap();
            let slots = [4i64, 7, 8, 9];
            let keys: Vec<Vec<f64>> = slots.iter().map(|&s| row(&k, s)).collect();
            let vals: Vec<Vec<f64>> = slots.iter().map(|&s| row(&v, s)).collect();
            let (out, w) = dense(&row(&q, 0), &keys, &vals);
            let got = row(&a.out, 0);
            for (x, y) in got.iter().zip(&out) {
                assert!(
                    (x - y).abs() < 1e-4,
                    "{}: {got:?} vs {out:?}",
                    backend.name()
                );
            }
            let Some(mass) = a.mass else {
                continue;
            };
            let want = [w[0], 0.0, 0.0, w[1], w[2], w[3], 0.0, 0.0];
            assert_eq!(mass.len(), 8);
            for (m, w) in mass.iter().zip(want) {
                assert!((f64::from(*m) - w).abs() < 1e-5, "{mass:?} vs {want:?}");
            }
        }
    }

    /// KeyDiff's signal: per entry, `1 − cos(key, mean of the live keys)`
    /// averaged over its keys and heads; 0 for a dropped entry.
    #[test]
    fn key_novelty_is_the_distance_from_the_mean_live_key_per_entry() {
        let (bs, h, d) = (4i64, 2i64, 8i64);
        let k = Tensor::randn([16, h, d], (Kind::Float, Device::Cpu));
        let v = Tensor::zeros([16, h, d], (Kind::Float, Device::Cpu));
        let mut table = BlockTable::new(bs as u32).unwrap();
        table.push(Slot::Hot(BlockId::new(2, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
        table.push(Slot::Hot(BlockId::new(0, 1)), 3, true).unwrap();
        table.set_slot(1, Slot::Dropped).unwrap();
        let view = StepView::new(&table, 1, bs as usize, None, Device::Cpu).unwrap();
        let (ks, vs) = ([k.shallow_clone()], [v]);
        let kv = KvTensors {
            k: &ks,
            v: &vs,
            cold: None,
        };
        let q = Tensor::randn([1, h, d], (Kind::Float, Device::Cpu));
        let observe = Observe {
            key_novelty: true,
            ..Observe::default()
        };
        let a = ReferenceBackend.attend(0, &q, &view, &kv, observe).unwrap();
        assert!(a.mass.is_none(), "not asked for");
        let got = a.key_novelty.unwrap();
        let per_head = Observe {
            per_head: true,
            ..observe
        };
        let heads = ReferenceBackend
            .attend(0, &q, &view, &kv, per_head)
            .unwrap();
        let got_heads = heads.key_novelty.unwrap();
        let slots: Vec<i64> = (8..12).chain(0..3).collect();
        let key = |s: i64, head: i64| -> Vec<f64> {
            Vec::<f64>::try_from(k.get(s).get(head).to_kind(Kind::Double)).unwrap()
        };
        let cos = |a: &[f64], b: &[f64]| {
            let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            let n = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
            dot / (n(a) * n(b))
        };
        let mut want = [0f64; 3];
        let mut want_heads = [0f64; 6];
        for head in 0..h {
            let mean: Vec<f64> = (0..d as usize)
                .map(|c| slots.iter().map(|&s| key(s, head)[c]).sum::<f64>() / slots.len() as f64)
                .collect();
            for (j, &s) in slots.iter().enumerate() {
                let entry = if j < 4 { 0 } else { 2 };
                let len = if j < 4 { 4.0 } else { 3.0 };
                let x = (1.0 - cos(&key(s, head), &mean)) / len;
                want[entry] += x / h as f64;
                want_heads[entry * h as usize + head as usize] += x;
            }
        }
        assert_eq!(got_heads.len(), 6, "per entry and head");
        for (g, w) in got_heads.iter().zip(want_heads) {
            assert!(
                (f64::from(*g) - w).abs() < 1e-4,
                "{got_heads:?} vs {want_heads:?}"
            );
        }
        assert_eq!(got.len(), 3);
        assert_eq!(got[1], 0.0, "dropped");
        for (g, w) in got.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-4, "{got:?} vs {want:?}");
        }
    }
}
