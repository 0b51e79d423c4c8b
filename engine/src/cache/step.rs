//! One forward step of a sequence: the coordinator's plan carried out with
//! tensors (copies, packs, compaction, demotions), attention through the
//! backend, then commit — or, on any failure, abort with in-place
//! rewrites undone.

use std::sync::Arc;

use kvforge_coordinator::{Coordinator, Grain, Planned, SeqId, TieredPool};
use tch::Tensor;

use crate::attention::{Observe, StepView};
use crate::error::{EngineError, Result};
use crate::kv::KvStore;

use super::*;

pub(super) struct Step {
    pub(super) id: SeqId,
    pub(super) new_slots: Tensor,
    pub(super) view: StepView,
    pub(super) mass: Option<Vec<f32>>,
    /// KeyDiff's signal summed over the layers so far, when the eviction
    /// policy wants it; for a per-lane policy one slot per entry and lane
    /// (`layer × kv_heads + head`), each layer filling its own.
    pub(super) novelty: Option<Vec<f32>>,
    /// KV heads per layer when the policy ranks per lane.
    pub(super) lane_heads: Option<usize>,
    /// The mass from the step's last `window` queries (0: all).
    pub(super) window: usize,
    /// Signals per row of the table (token-level eviction).
    pub(super) per_token: bool,
    /// An in-place pack this step carried out: undone if it is aborted.
    pub(super) undo: Option<kvforge_coordinator::Pack>,
    /// An in-place row compaction this step carried out: the same.
    pub(super) undo_rows: Option<kvforge_coordinator::RowPack>,
}

/// One sequence of a [`PagedKvCache`] seen as a [`KvStore`].
pub struct PagedSeq<'a> {
    pub(super) cache: &'a PagedKvCache,
    pub(super) seq: &'a mut Sequence,
    pub(super) step: Option<Step>,
}

impl PagedSeq<'_> {
    /// Carries out the plan's demotions (quantize, offer for sharing) and
    /// resolves the step's view. The caller aborts on error.
    pub(super) fn execute(
        &self,
        id: SeqId,
        plan: &kvforge_coordinator::Plan,
        n: usize,
    ) -> Result<Step> {
        let c = self.cache;
        let bs = c.block_size;
        let device = c.k[0].device();
        for cp in &plan.copies {
            let slots = |b| {
                let base = i64::from(TieredPool::slot_of(b)) * bs as i64;
                Tensor::f_from_slice(&(base..base + i64::from(cp.tokens)).collect::<Vec<_>>())?
                    .f_to_device(device)
            };
            let (src, dst) = (slots(cp.src)?, slots(cp.dst)?);
            for t in c.k.iter().chain(&c.v) {
                let rows = t.f_index_select(0, &src)?;
                let _ = t.shallow_clone().f_index_copy_(0, &dst, &rows)?;
            }
        }
        if let Some(pack) = &plan.pack {
            c.pack(pack, false)?;
        }
        let undo = plan.pack.clone().filter(|p| p.in_place);
        if let Some(rows) = &plan.rows
            && let Err(e) = c.move_rows(rows, false)
        {
            if let Some(p) = &undo {
                let _ = c.pack(p, true);
            }
            return Err(e);
        }
        let undo_rows = plan.rows.clone().filter(|p| p.in_place);
        match self.demote_and_view(id, plan, n) {
            Ok(mut step) => {
                step.undo = undo;
                step.undo_rows = undo_rows;
                Ok(step)
            }
            Err(e) => {
                if let Some(p) = &undo_rows {
                    let _ = c.move_rows(p, true);
                }
                if let Some(p) = &undo {
                    let _ = c.pack(p, true);
                }
                Err(e)
            }
        }
    }

    /// The rest of [`execute`](Self::execute): demotions, then the view.
    /// What to observe comes with the plan ([`Wants`]); the coordinator is
    /// locked once, for the shares and the view.
    pub(super) fn demote_and_view(
        &self,
        id: SeqId,
        plan: &kvforge_coordinator::Plan,
        n: usize,
    ) -> Result<Step> {
        let c = self.cache;
        let bs = c.block_size;
        let device = c.k[0].device();
        let wants = plan.wants;
        let mut offered = Vec::new();
        for d in plan.demotions.iter().filter(|d| d.quantize) {
            let tier = c
                .cold
                .as_ref()
                .ok_or_else(|| EngineError::Torch("a demotion without a cold tier".into()))?;
            let base = TieredPool::slot_of(d.hot) as usize * bs;
            let block = Arc::new(tier.quantize(&c.k, &c.v, base)?);
            tier.put(d.cold, Arc::clone(&block))?;
            if wants.share {
                offered.push((d.cold, tier.content(&block, wants.share_vectors)?));
            }
        }
        let mut new = Vec::with_capacity(n);
        for w in &plan.writes {
            let base = TieredPool::slot_of(w.block) as i64 * bs as i64 + i64::from(w.offset);
            new.extend(base..base + i64::from(w.tokens));
        }
        let (layers, heads) = (c.k.len(), c.shape.heads);
        let view = {
            let mut coord = c.coordinator();
            if let Some(tier) = c.cold.as_ref() {
                for (cold, content) in &offered {
                    coord.share(id, *cold, content, &mut |other| {
                        let o = tier.get(TieredPool::slot_of(other) as usize)?;
                        tier.content(&o, wants.share_vectors).ok()
                    })?;
                }
            }
            StepView::new(coord.view(id)?, n, bs, c.cold.as_ref(), device)?
        };
        let lanes = match wants.grain {
            Grain::Entry => 1,
            Grain::Lane => layers * heads,
            Grain::Row => bs,
        };
        let entries = view.entries();
        let signal = |wanted: bool| wanted.then(|| vec![0f32; entries * lanes]);
        Ok(Step {
            id,
            new_slots: Tensor::f_from_slice(&new)?.f_to_device(device)?,
            mass: signal(wants.attention),
            novelty: signal(wants.keys),
            lane_heads: (wants.grain == Grain::Lane).then_some(heads),
            window: wants.window,
            per_token: wants.grain == Grain::Row,
            view,
            undo: None,
            undo_rows: None,
        })
    }
}

impl KvStore for PagedSeq<'_> {
    fn len(&self) -> usize {
        self.seq.len
    }

    fn prepare(&mut self, n: usize) -> Result<()> {
        if self.step.is_some() {
            return Err(EngineError::Request("KvStore::prepare twice".into()));
        }
        let id = self.cache.ensure(self.seq)?;
        let plan = match self.cache.coordinator().plan(id, n)? {
            Planned::Step(plan) => plan,
            Planned::Full(short) => return Err(EngineError::CacheFull(short)),
        };
        match self.execute(id, &plan, n) {
            Ok(step) => {
                self.step = Some(step);
                Ok(())
            }
            Err(e) => {
                let mut c = self.cache.coordinator();
                c.abort(id)?;
                self.cache.free_cold(&mut c);
                Err(e)
            }
        }
    }

    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let c = self.cache;
        let Some(step) = self.step.as_mut() else {
            return Err(EngineError::Request(
                "KvStore::attend before prepare".into(),
            ));
        };
        let mut ks = c.k[layer].shallow_clone();
        let mut vs = c.v[layer].shallow_clone();
        let _ = ks.f_index_copy_(0, &step.new_slots, &k.f_to_kind(ks.kind())?)?;
        let _ = vs.f_index_copy_(0, &step.new_slots, &v.f_to_kind(vs.kind())?)?;
        let observe = Observe {
            mass: step.mass.is_some(),
            key_novelty: step.novelty.is_some(),
            per_head: step.lane_heads.is_some(),
            window: step.window,
            per_token: step.per_token,
        };
        let a = c
            .backend
            .attend(layer, q, &step.view, &c.tensors(), observe)?;
        let entries = step.view.entries();
        gather_signal(step.mass.as_mut(), a.mass, step.lane_heads, layer, entries);
        gather_signal(
            step.novelty.as_mut(),
            a.key_novelty,
            step.lane_heads,
            layer,
            entries,
        );
        Ok(a.out)
    }

    fn commit(&mut self, n: usize) -> Result<()> {
        let Some(step) = self.step.take() else {
            return Err(EngineError::Request(
                "KvStore::commit before prepare".into(),
            ));
        };
        let mut c = self.cache.coordinator();
        let done = (|| {
            if let Some(m) = &step.mass {
                c.observe(step.id, m)?;
            }
            if let Some(n) = &step.novelty {
                // Summed over layers: the ranking is the layers' mean's.
                c.observe_keys(step.id, n)?;
            }
            c.commit(step.id)
        })();
        if let Err(e) = done {
            self.cache.abandon(&step, &mut c);
            return Err(e.into());
        }
        self.cache.free_cold(&mut c);
        self.seq.len = step.view.start() + n;
        Ok(())
    }
}

/// Adds one layer's signal (attention mass or key novelty) to the step's:
/// summed over layers, or per lane (`heads` KV heads per layer) into the
/// layer's own slots of each entry.
pub(super) fn gather_signal(
    acc: Option<&mut Vec<f32>>,
    got: Option<Vec<f32>>,
    heads: Option<usize>,
    layer: usize,
    entries: usize,
) {
    let (Some(acc), Some(got)) = (acc, got) else {
        return;
    };
    match heads {
        None => acc.iter_mut().zip(got).for_each(|(x, y)| *x += y),
        Some(h) => {
            let lanes = acc.len() / entries.max(1);
            for (e, heads) in got.chunks_exact(h).enumerate() {
                acc[e * lanes + layer * h..][..h].copy_from_slice(heads);
            }
        }
    }
}

impl Drop for PagedSeq<'_> {
    /// A step prepared but not committed (the forward failed) is aborted:
    /// the sequence, the pools and the index are as they were.
    fn drop(&mut self) {
        if let Some(step) = self.step.take() {
            let mut c = self.cache.coordinator();
            self.cache.abandon(&step, &mut c);
        }
    }
}

impl PagedKvCache {
    /// A prepared step that will not be committed: its in-place pack is
    /// undone, then the coordinator aborts it.
    pub(super) fn abandon(&self, step: &Step, c: &mut Coordinator) {
        if let Some(p) = &step.undo_rows {
            let _ = self.move_rows(p, true);
        }
        if let Some(p) = &step.undo {
            let _ = self.pack(p, true);
        }
        let _ = c.abort(step.id);
        self.free_cold(c);
    }
}
