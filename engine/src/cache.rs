//! KV storage: the paged cache (tensors for the coordinator's blocks), and
//! a contiguous cache kept only as a test oracle.
//!
//! The paged cache owns one K and one V tensor per layer for the hot tier,
//! shaped `[hot_blocks * block_size, kv_heads, head_dim]` (slot
//! `b * block_size + o` holds offset `o` of hot block `b`), and the cold
//! tier's quantized blocks. Everything else — which blocks a sequence
//! holds, what goes cold, what is dropped, what is shared — is decided by
//! the tensor-free [`Coordinator`]: each forward step asks it for a plan,
//! carries the plan out with tensors, attends through an
//! [`AttentionBackend`], and commits (or, when anything failed, aborts).

use std::sync::{Arc, Mutex, MutexGuard};

use kvforge_coordinator::{
    ColdConfig, Coordinator, CoordinatorConfig, Segment, SeqId, TierStats, TieredPool, TurnInput,
    TurnLifecycle,
};
use kvforge_pool::{BlockId, BlockTable, KvLayout, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_quant::BlockShape;
use tch::{Device, Kind, Tensor};

use crate::attention::{AttentionBackend, KvTensors, Observe, StepView};
use crate::error::{EngineError, Result};
use crate::fused::FusedBackend;
use crate::kv::{KvDims, KvStore};
use crate::tier::{ColdTier, KvQuant};

/// A sequence of a [`PagedKvCache`]: a handle on its block table in the
/// coordinator. Free it with [`PagedKvCache::free`].
#[derive(Debug, Default)]
pub struct Sequence {
    id: Option<SeqId>,
    len: usize,
}

impl Sequence {
    /// The position of the next token.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its id in the coordinator, once it holds anything.
    pub fn id(&self) -> Option<SeqId> {
        self.id
    }
}

/// Paged KV storage for one model: hot tensors, cold blocks, and the
/// coordinator that owns every block table.
pub struct PagedKvCache {
    coord: Mutex<Coordinator>,
    hot_layout: KvLayout,
    hot_blocks: usize,
    block_size: usize,
    shape: BlockShape,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    cold: Option<ColdTier>,
    backend: Box<dyn AttentionBackend>,
}

// SAFETY: the tensors are only read concurrently, or written at slots of
// hot blocks that the coordinator handed to exactly one sequence for the
// step (a block with other holders is never written): concurrent steps
// touch disjoint memory, and libtorch's tensor handles count references
// atomically. Everything else is behind a mutex or a lock.
unsafe impl Sync for PagedKvCache {}

impl PagedKvCache {
    /// Storage for `max_tokens` tokens of hot KV (rounded up to whole
    /// blocks) on `device` in `kind`, with every cache mechanism off.
    /// Memory is reserved up front; the coordinator hands out blocks.
    pub fn new(
        dims: impl Into<KvDims>,
        block_size: usize,
        max_tokens: usize,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let cfg = dims.into();
        if block_size == 0 || max_tokens == 0 {
            return Err(EngineError::Request(
                "block size and KV capacity must be positive".into(),
            ));
        }
        let format = match kind {
            Kind::Float => StorageFormat::F32,
            Kind::BFloat16 => StorageFormat::BF16,
            _ => StorageFormat::F16,
        };
        let layout = KvLayout::new(
            cfg.layers as u32,
            cfg.kv_heads as u32,
            cfg.head_dim as u32,
            u32::try_from(block_size)
                .map_err(|_| EngineError::Request("block size too large".into()))?,
            format,
        )?;
        let blocks = max_tokens.div_ceil(block_size);
        if device == Device::Cpu {
            let need = layout.bytes_for_blocks(blocks as u64)?;
            if let Some(have) = available_memory() {
                if need > have {
                    return Err(EngineError::Request(format!(
                        "a KV cache of {max_tokens} tokens needs {} MiB, more than the {} MiB of memory available",
                        need >> 20,
                        have >> 20
                    )));
                }
            }
        }
        let coord = Coordinator::new(CoordinatorConfig::new(layout, blocks))?;
        let slots = (blocks * block_size) as i64;
        let shape = [slots, cfg.kv_heads as i64, cfg.head_dim as i64];
        let zeros = || Tensor::f_zeros(shape, (kind, device));
        let k = (0..cfg.layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let v = (0..cfg.layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(PagedKvCache {
            coord: Mutex::new(coord),
            hot_layout: layout,
            hot_blocks: blocks,
            block_size,
            shape: BlockShape {
                tokens: block_size,
                heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
            },
            k,
            v,
            cold: None,
            backend: Box::new(FusedBackend::default()),
        })
    }

    /// Head-wise eviction's copies: lane `layer × kv_heads + head` of each
    /// packed block takes the same lane's page of its source block — one
    /// gather and one scatter per layer and K/V over the rows seen as
    /// `[slots × kv_heads, head_dim]`.
    ///
    /// With `undo`, every page goes back where it came from (an in-place
    /// pack of a step that is aborted). A failure part-way undoes the
    /// layers an in-place pack had moved.
    fn pack(&self, pack: &kvforge_coordinator::Pack, undo: bool) -> Result<()> {
        let (bs, h) = (self.block_size as i64, self.shape.heads as i64);
        let layers = self.k.len();
        if pack.lanes != layers * self.shape.heads || pack.src.len() != pack.dst.len() * pack.lanes
        {
            return Err(EngineError::Request(format!(
                "a pack of {} lanes for {} blocks does not fit {layers} layers of {h} KV heads",
                pack.lanes,
                pack.dst.len()
            )));
        }
        let device = self.k[0].device();
        let base = |b: BlockId| i64::from(TieredPool::slot_of(b)) * bs;
        let move_layer = |layer: usize, undo: bool| -> Result<()> {
            let (mut src, mut dst) = (Vec::new(), Vec::new());
            for (k, &to) in pack.dst.iter().enumerate() {
                for head in 0..h {
                    let from = pack.src[k * pack.lanes + layer * h as usize + head as usize];
                    for r in 0..bs {
                        src.push((base(from) + r) * h + head);
                        dst.push((base(to) + r) * h + head);
                    }
                }
            }
            if undo {
                std::mem::swap(&mut src, &mut dst);
            }
            let src = Tensor::f_from_slice(&src)?.f_to_device(device)?;
            let dst = Tensor::f_from_slice(&dst)?.f_to_device(device)?;
            // Every source page is read before any is written.
            let hd = self.shape.head_dim as i64;
            let rows = [
                self.k[layer].f_view([-1, hd])?,
                self.v[layer].f_view([-1, hd])?,
            ];
            let pages = [
                rows[0].f_index_select(0, &src)?,
                rows[1].f_index_select(0, &src)?,
            ];
            for (r, p) in rows.iter().zip(&pages) {
                let _ = r.shallow_clone().f_index_copy_(0, &dst, p)?;
            }
            Ok(())
        };
        for layer in 0..layers {
            if let Err(e) = move_layer(layer, undo) {
                if pack.in_place && !undo {
                    for done in 0..layer {
                        let _ = move_layer(done, true);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Carries out token-level eviction's compaction: row `r` of block
    /// `dst[k]` takes the row `src[k × block_size + r]` names, in every
    /// layer's K and V (all sources read before any destination is
    /// written). With `undo`, every row goes back where it came from (an
    /// in-place compaction of a step that is aborted); a failure part-way
    /// through an in-place one undoes the layers already done.
    fn move_rows(&self, rows: &kvforge_coordinator::RowPack, undo: bool) -> Result<()> {
        let bs = self.block_size as i64;
        if rows.block_size as i64 != bs || rows.src.len() != rows.dst.len() * bs as usize {
            return Err(EngineError::Request(format!(
                "a compaction of {} rows into {} blocks of {} does not fit blocks of {bs}",
                rows.src.len(),
                rows.dst.len(),
                rows.block_size
            )));
        }
        let base = |b: BlockId| i64::from(TieredPool::slot_of(b)) * bs;
        let mut src: Vec<i64> = rows
            .src
            .iter()
            .map(|&(b, r)| base(b) + i64::from(r))
            .collect();
        let mut dst: Vec<i64> = rows
            .dst
            .iter()
            .flat_map(|&b| (0..bs).map(move |r| base(b) + r))
            .collect();
        if undo {
            std::mem::swap(&mut src, &mut dst);
        }
        let device = self.k[0].device();
        let src = Tensor::f_from_slice(&src)?.f_to_device(device)?;
        let dst = Tensor::f_from_slice(&dst)?.f_to_device(device)?;
        let move_one = |t: &Tensor, from: &Tensor, to: &Tensor| -> Result<()> {
            let moved = t.f_index_select(0, from)?;
            let _ = t.shallow_clone().f_index_copy_(0, to, &moved)?;
            Ok(())
        };
        let tensors: Vec<&Tensor> = self.k.iter().chain(&self.v).collect();
        for (done, t) in tensors.iter().enumerate() {
            if let Err(e) = move_one(t, &src, &dst) {
                if rows.in_place && !undo {
                    for back in &tensors[..done] {
                        let _ = move_one(back, &dst, &src);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A configuration for this cache's hot tier with every mechanism off,
    /// to fill in and pass to [`configure`](Self::configure).
    pub fn base_config(&self) -> CoordinatorConfig {
        CoordinatorConfig::new(self.hot_layout, self.hot_blocks)
    }

    /// The coordinator's configuration now.
    pub fn config(&self) -> CoordinatorConfig {
        self.coordinator().config().clone()
    }

    /// Rebuilds the coordinator from `cfg` (prefix reuse, eviction,
    /// sharing, lifecycle, budget) and installs the cold tier `quant` (its
    /// formats fill `cfg.cold`). Errors, changing nothing, while any
    /// sequence lives or blocks are in use, or when `cfg` cannot work.
    pub fn configure(&mut self, mut cfg: CoordinatorConfig, quant: Option<KvQuant>) -> Result<()> {
        let mut tier = quant.map(|s| ColdTier::new(s, self.shape)).transpose()?;
        // On a GPU the CUDA kernel reads cold blocks from a copy there.
        if let (Some(t), Some(k)) = (tier.as_mut(), self.k.first()) {
            if k.device().is_cuda() {
                t.mirror_on(k.device(), self.k.len());
            }
        }
        cfg.layout = self.hot_layout;
        cfg.hot_blocks = self.hot_blocks;
        cfg.cold = match (&tier, quant) {
            (Some(t), Some(q)) => {
                let (format, value_format) = t.formats();
                Some(ColdConfig {
                    format,
                    value_format,
                    window: q.window,
                    sink: q.sink,
                })
            }
            _ => None,
        };
        let coord = Coordinator::new(cfg)?;
        let busy = {
            let c = self.coordinator();
            c.sequences() > 0 || c.bytes_in_use() > 0
        };
        if busy {
            return Err(EngineError::Request(
                "the cache cannot be reconfigured while sequences hold KV".into(),
            ));
        }
        *self.coord.get_mut().unwrap_or_else(|e| e.into_inner()) = coord;
        self.cold = tier;
        Ok(())
    }

    /// Installs (or with `None` removes) the quantized cold tier, keeping
    /// the other settings. Errors, changing nothing, while any sequence
    /// holds blocks.
    pub fn set_cold_tier(&mut self, spec: Option<KvQuant>) -> Result<()> {
        let cfg = self.config();
        self.configure(cfg, spec)
    }

    /// Replaces the attention backend.
    pub fn set_backend(&mut self, backend: Box<dyn AttentionBackend>) {
        self.backend = backend;
    }

    /// The cold tier's configuration, if there is one.
    pub fn cold_tier(&self) -> Option<KvQuant> {
        self.cold.as_ref().map(ColdTier::spec)
    }

    /// The coordinator, locked (block tables, pools, index, policies).
    pub fn coordinator(&self) -> MutexGuard<'_, Coordinator> {
        self.coord.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks the hot tier holds at most.
    pub fn hot_blocks(&self) -> usize {
        self.hot_blocks
    }

    /// Per-tier occupancy (hot first).
    pub fn tier_stats(&self) -> Vec<TierStats> {
        self.coordinator().tier_stats()
    }

    /// KV bytes held by blocks in use, all tiers, each block once.
    pub fn bytes_in_use(&self) -> u64 {
        self.coordinator().bytes_in_use()
    }

    /// A prepared step that will not be committed: its in-place pack is
    /// undone, then the coordinator aborts it.
    fn abandon(&self, step: &Step, c: &mut Coordinator) {
        if let Some(p) = &step.undo_rows {
            let _ = self.move_rows(p, true);
        }
        if let Some(p) = &step.undo {
            let _ = self.pack(p, true);
        }
        let _ = c.abort(step.id);
        self.free_cold(c);
    }

    /// The most KV bytes in use inside any step since the last call (the
    /// blocks a step releases at its commit included), and a new
    /// measurement started.
    pub fn take_step_peak_bytes(&self) -> u64 {
        let mut c = self.coordinator();
        let peak = c.step_peak_bytes();
        c.reset_step_peak();
        peak
    }

    /// `(hot, cold)` bytes in use.
    pub fn tier_bytes(&self) -> (u64, u64) {
        let s = self.tier_stats();
        let hot = s.first().map_or(0, |t| t.pool.in_use_bytes);
        let cold = s.get(1).map_or(0, |t| t.pool.in_use_bytes);
        (hot, cold)
    }

    /// A copy of a sequence's block table (empty before its first step).
    pub fn table(&self, seq: &Sequence) -> Result<BlockTable> {
        match seq.id {
            Some(id) => Ok(self.coordinator().table(id)?.clone()),
            None => Ok(BlockTable::new(self.block_size as u32)?),
        }
    }

    /// Opens a sequence for a prompt: with prefix reuse on, it starts with
    /// the longest cached prefix of `tokens` (all but the last token).
    pub fn open(&self, tokens: &[u32], extra: &ExtraKeys) -> Result<Sequence> {
        let o = self.coordinator().open(tokens, extra)?;
        Ok(Sequence {
            id: Some(o.seq),
            len: o.reused,
        })
    }

    /// Registers the completed blocks of `seq`, which holds the KV of
    /// `tokens`, in the prefix index (no-op with reuse off).
    pub fn register(&self, seq: &Sequence, tokens: &[u32], extra: &ExtraKeys) -> Result<usize> {
        match seq.id {
            Some(id) => Ok(self.coordinator().register(id, tokens, extra)?),
            None => Ok(0),
        }
    }

    /// Starts a turn that [`rollback_turn`](Self::rollback_turn) can undo.
    pub fn begin_turn(&self, seq: &mut Sequence) -> Result<()> {
        let id = self.ensure(seq)?;
        Ok(self.coordinator().begin_turn(id)?)
    }

    /// Ends a turn (the lifecycle policy may drop old segments).
    pub fn end_turn(&self, seq: &mut Sequence) -> Result<()> {
        self.finish_turn(seq, |c, id| c.end_turn(id).map(|_| ()))
    }

    /// Ends a turn with what the lifecycle needs: the turn's segment cuts,
    /// the sequence's tokens, the model's labels. See
    /// [`Coordinator::end_turn_labelled`].
    pub fn end_turn_labelled(&self, seq: &mut Sequence, t: &TurnInput) -> Result<TurnLifecycle> {
        let mut out = TurnLifecycle::default();
        self.finish_turn(seq, |c, id| {
            out = c.end_turn_labelled(id, t)?;
            Ok(())
        })?;
        Ok(out)
    }

    /// A segment handed out for summarising was replaced (its entries are
    /// dropped) or is kept. Returns the entries dropped.
    pub fn compressed(&self, seq: &mut Sequence, seg: Segment, replaced: bool) -> Result<usize> {
        let mut n = 0;
        self.finish_turn(seq, |c, id| {
            n = c.compressed(id, seg, replaced)?;
            Ok(())
        })?;
        Ok(n)
    }

    /// The segments the turn of `seq` in progress adds when it ends with
    /// `cuts` (empty without a lifecycle or a sequence).
    pub fn turn_segments(&self, seq: &Sequence, cuts: &[u64]) -> Result<Vec<Segment>> {
        match seq.id {
            Some(id) => Ok(self.coordinator().turn_segments(id, cuts)?),
            None => Ok(Vec::new()),
        }
    }

    /// A sequence that reads what `seq` holds (the same blocks, a reference
    /// of its own on each); what it writes next is its own. Free it with
    /// [`free`](Self::free).
    pub fn fork(&self, seq: &Sequence) -> Result<Sequence> {
        match seq.id {
            Some(id) => Ok(Sequence {
                id: Some(self.coordinator().fork(id)?),
                len: seq.len,
            }),
            None => Ok(Sequence::default()),
        }
    }

    /// Restores `seq` to the start of its turn.
    pub fn rollback_turn(&self, seq: &mut Sequence) -> Result<()> {
        self.finish_turn(seq, Coordinator::rollback_turn)
    }

    /// Runs `op` (end or roll back the turn of `seq`), then takes the
    /// sequence's length from its table and frees the cold storage `op`
    /// released.
    fn finish_turn(
        &self,
        seq: &mut Sequence,
        op: impl FnOnce(&mut Coordinator, SeqId) -> kvforge_coordinator::Result<()>,
    ) -> Result<()> {
        if let Some(id) = seq.id {
            let mut c = self.coordinator();
            op(&mut c, id)?;
            seq.len = c.table(id)?.positions() as usize;
            self.free_cold(&mut c);
        }
        Ok(())
    }

    /// Releases a sequence's blocks and empties it.
    pub fn free(&self, seq: &mut Sequence) -> Result<()> {
        if let Some(id) = seq.id.take() {
            let mut c = self.coordinator();
            let r = c.close(id);
            self.free_cold(&mut c);
            r?;
        }
        seq.len = 0;
        Ok(())
    }

    fn ensure(&self, seq: &mut Sequence) -> Result<SeqId> {
        Ok(*seq
            .id
            .get_or_insert_with(|| self.coordinator().open_empty()))
    }

    /// Drops the stored content of cold blocks that nobody holds or caches.
    fn free_cold(&self, c: &mut Coordinator) {
        let freed = c.take_freed_cold();
        if let Some(t) = &self.cold {
            t.free(freed.iter().map(|&b| TieredPool::slot_of(b) as usize));
        }
    }

    /// Bytes of quantized blocks stored now (held, cached, or shared).
    pub fn cold_stored_bytes(&self) -> u64 {
        self.cold.as_ref().map_or(0, ColdTier::stored_bytes)
    }

    /// A [`KvStore`] view of `seq` for one forward step.
    pub fn view<'a>(&'a self, seq: &'a mut Sequence) -> PagedSeq<'a> {
        PagedSeq {
            cache: self,
            seq,
            step: None,
        }
    }

    /// Keeps a copy of the cold tier on `device` whatever the cache's
    /// device (tests of the CUDA kernel's tables on the CPU).
    #[cfg(test)]
    pub(crate) fn mirror_cold_tier(&mut self, device: Device) -> bool {
        let layers = self.k.len();
        self.cold
            .as_mut()
            .is_some_and(|t| t.mirror_on(device, layers))
    }

    pub(crate) fn tensors(&self) -> KvTensors<'_> {
        KvTensors {
            k: &self.k,
            v: &self.v,
            cold: self.cold.as_ref(),
        }
    }
}

struct Step {
    id: SeqId,
    new_slots: Tensor,
    view: StepView,
    mass: Option<Vec<f32>>,
    /// KeyDiff's signal summed over the layers so far, when the eviction
    /// policy wants it; for a per-lane policy one slot per entry and lane
    /// (`layer × kv_heads + head`), each layer filling its own.
    novelty: Option<Vec<f32>>,
    /// KV heads per layer when the policy ranks per lane.
    lane_heads: Option<usize>,
    /// The mass from the step's last `window` queries (0: all).
    window: usize,
    /// Signals per row of the table (token-level eviction).
    per_token: bool,
    /// An in-place pack this step carried out: undone if it is aborted.
    undo: Option<kvforge_coordinator::Pack>,
    /// An in-place row compaction this step carried out: the same.
    undo_rows: Option<kvforge_coordinator::RowPack>,
}

/// One sequence of a [`PagedKvCache`] seen as a [`KvStore`].
pub struct PagedSeq<'a> {
    cache: &'a PagedKvCache,
    seq: &'a mut Sequence,
    step: Option<Step>,
}

impl PagedSeq<'_> {
    /// Carries out the plan's demotions (quantize, offer for sharing) and
    /// resolves the step's view. The caller aborts on error.
    fn execute(&self, id: SeqId, plan: &kvforge_coordinator::Plan, n: usize) -> Result<Step> {
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
    fn demote_and_view(
        &self,
        id: SeqId,
        plan: &kvforge_coordinator::Plan,
        n: usize,
    ) -> Result<Step> {
        let c = self.cache;
        let bs = c.block_size;
        let device = c.k[0].device();
        for d in plan.demotions.iter().filter(|d| d.quantize) {
            let tier = c
                .cold
                .as_ref()
                .ok_or_else(|| EngineError::Torch("a demotion without a cold tier".into()))?;
            let base = TieredPool::slot_of(d.hot) as usize * bs;
            let block = Arc::new(tier.quantize(&c.k, &c.v, base)?);
            tier.put(TieredPool::slot_of(d.cold) as usize, Arc::clone(&block))?;
            let mut coord = c.coordinator();
            if coord.share_stats().is_none() {
                continue;
            }
            let vector = coord.share_wants_vectors();
            let content = tier.content(&block, vector)?;
            coord.share(id, d.cold, &content, &mut |other| {
                let o = tier.get(TieredPool::slot_of(other) as usize)?;
                tier.content(&o, vector).ok()
            })?;
        }
        let mut new = Vec::with_capacity(n);
        for w in &plan.writes {
            let base = TieredPool::slot_of(w.block) as i64 * bs as i64 + i64::from(w.offset);
            new.extend(base..base + i64::from(w.tokens));
        }
        let (view, mass, novelty, lane_heads, window, per_token) = {
            let coord = c.coordinator();
            let table = coord.view(id)?;
            let view = StepView::new(table, n, bs, c.cold.as_ref(), device)?;
            let (layers, heads) = (c.k.len(), c.shape.heads);
            let lanes = if coord.per_lane() {
                layers * heads
            } else if coord.token_level() {
                bs
            } else {
                1
            };
            let signal = |wanted: bool| wanted.then(|| vec![0f32; table.entries().len() * lanes]);
            (
                view,
                signal(coord.wants_attention()),
                signal(coord.wants_keys()),
                coord.per_lane().then_some(heads),
                coord.observation_window(),
                coord.token_level(),
            )
        };
        Ok(Step {
            id,
            new_slots: Tensor::f_from_slice(&new)?.f_to_device(device)?,
            view,
            mass,
            novelty,
            lane_heads,
            window,
            per_token,
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
        let plan = self.cache.coordinator().plan(id, n)?;
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
fn gather_signal(
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

/// Memory the OS says is available (`MemAvailable` in `/proc/meminfo`), if
/// it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kvforge_coordinator::{Pack, TieredPool};
    use kvforge_pool::BlockId;
    use tch::{Device, Kind, Tensor};

    use super::PagedKvCache;
    use crate::model::LlamaConfig;

    /// Lane `layer × kv_heads + head` of each packed block holds that
    /// lane's rows of its source block, and nothing else moves.
    #[test]
    fn packing_copies_each_lane_from_its_own_source() {
        let cfg = LlamaConfig::tiny();
        let bs = 4;
        let c = PagedKvCache::new(&cfg, bs, 8 * bs, Device::Cpu, Kind::Float).unwrap();
        let (layers, h) = (cfg.n_layers, cfg.n_kv_heads);
        for (i, t) in c.k.iter().chain(&c.v).enumerate() {
            let n = t.numel() as i64;
            let fill = Tensor::arange(n, (Kind::Float, Device::Cpu)) + (i as f64) * 1e6;
            t.shallow_clone().copy_(&fill.view(t.size().as_slice()));
        }
        let before: Vec<Tensor> = c.k.iter().chain(&c.v).map(|t| t.copy()).collect();
        // The hot tier is tier 0: a hot slot's global handle is the slot.
        let b = |slot: u32| BlockId::new(slot, 1);
        let lanes = layers * h;
        // Two packed blocks (slots 6, 7) from sources 1, 2, 3 by lane.
        let src: Vec<BlockId> = (0..2 * lanes).map(|x| b(1 + (x % 3) as u32)).collect();
        let pack = Pack {
            lanes,
            dst: vec![b(6), b(7)],
            src: src.clone(),
            in_place: false,
        };
        c.pack(&pack, false).unwrap();
        for (i, t) in c.k.iter().chain(&c.v).enumerate() {
            let layer = i % layers;
            let old = &before[i];
            for slot in 0..8i64 {
                for head in 0..h as i64 {
                    let rows =
                        |x: &Tensor, s: i64| x.narrow(0, s * bs as i64, bs as i64).select(1, head);
                    let want = if slot >= 6 {
                        let k = (slot - 6) as usize;
                        let from = src[k * lanes + layer * h + head as usize];
                        rows(old, i64::from(TieredPool::slot_of(from)))
                    } else {
                        rows(old, slot)
                    };
                    assert!(
                        rows(t, slot).equal(&want),
                        "tensor {i} slot {slot} head {head}"
                    );
                }
            }
        }
        // A pack for another shape is refused.
        let bad = Pack {
            lanes: lanes + 1,
            dst: vec![b(6)],
            src: vec![b(1); lanes + 1],
            in_place: false,
        };
        assert!(c.pack(&bad, false).is_err());
    }

    /// A step whose in-place pack is prepared and then dropped (the forward
    /// failed) leaves every K/V element and the table as they were.
    #[test]
    fn an_aborted_step_undoes_its_in_place_pack() {
        // Head-wise pages, then token-level rows.
        aborted_step_undoes(true, false);
        aborted_step_undoes(false, true);
    }

    fn aborted_step_undoes(per_head: bool, per_token: bool) {
        use kvforge_coordinator::{EvictionConfig, Score, Trigger};

        use super::KvStore;
        let cfg = LlamaConfig::tiny();
        let mut c = PagedKvCache::new(&cfg, 4, 256, Device::Cpu, Kind::Float).unwrap();
        let mut coord = c.base_config();
        coord.eviction = Some(EvictionConfig::Scored {
            score: Score::KeyDiff,
            trigger: Trigger::Tokens(24),
            sink: 4,
            window: 8,
            per_head,
            per_token,
        });
        c.configure(coord, None).unwrap();
        let mut seq = super::Sequence::default();
        let rand = |n: i64, h: usize| {
            Tensor::randn(
                [n, h as i64, cfg.head_dim as i64],
                (Kind::Float, Device::Cpu),
            )
        };
        let snapshot = |c: &PagedKvCache| -> Vec<Tensor> {
            c.k.iter().chain(&c.v).map(|t| t.copy()).collect()
        };
        let mut found = false;
        for step in 0..120 {
            let n = if step == 0 { 12 } else { 1 };
            let before = snapshot(&c);
            let table = c.table(&seq).ok();
            let mut view = c.view(&mut seq);
            view.prepare(n).unwrap();
            let moved =
                c.k.iter()
                    .chain(&c.v)
                    .zip(&before)
                    .any(|(t, b)| !t.equal(b));
            if moved {
                drop(view);
                assert!(
                    c.k.iter().chain(&c.v).zip(&before).all(|(t, b)| t.equal(b)),
                    "step {step}: the pack is undone"
                );
                assert_eq!(
                    c.table(&seq).ok(),
                    table,
                    "step {step}: the table is unchanged"
                );
                found = true;
                // The same step again, carried through this time.
                view = c.view(&mut seq);
                view.prepare(n).unwrap();
            }
            for layer in 0..cfg.n_layers {
                let q = rand(n as i64, cfg.n_heads);
                let (k, v) = (
                    rand(n as i64, cfg.n_kv_heads),
                    rand(n as i64, cfg.n_kv_heads),
                );
                let _ = view.attend(layer, &q, &k, &v).unwrap();
            }
            view.commit(n).unwrap();
            if found {
                break;
            }
        }
        assert!(found, "no step packed in place");
        let n = c.coordinator().counters();
        assert!(n.packed_blocks > 0 || n.compacted_blocks > 0);
        c.free(&mut seq).unwrap();
    }

    /// In place, each lane's pages of blocks 1, 2, 3 are permuted among
    /// them (lane-dependent rotations); undoing restores every element.
    #[test]
    fn an_in_place_pack_permutes_lanes_and_undoes_exactly() {
        let cfg = LlamaConfig::tiny();
        let bs = 4;
        let c = PagedKvCache::new(&cfg, bs, 8 * bs, Device::Cpu, Kind::Float).unwrap();
        for t in c.k.iter().chain(&c.v) {
            t.shallow_clone().copy_(&Tensor::randn(
                t.size().as_slice(),
                (Kind::Float, Device::Cpu),
            ));
        }
        let before: Vec<Tensor> = c.k.iter().chain(&c.v).map(|t| t.copy()).collect();
        let (layers, h) = (cfg.n_layers, cfg.n_kv_heads);
        let lanes = layers * h;
        let b = |slot: u32| BlockId::new(slot, 1);
        let blocks = [b(1), b(2), b(3)];
        let src: Vec<BlockId> = (0..3 * lanes)
            .map(|x| blocks[(x / lanes + x % lanes) % 3])
            .collect();
        let pack = Pack {
            lanes,
            dst: blocks.to_vec(),
            src: src.clone(),
            in_place: true,
        };
        c.pack(&pack, false).unwrap();
        let page = |t: &Tensor, slot: i64, head: i64| {
            t.narrow(0, slot * bs as i64, bs as i64).select(1, head)
        };
        for (i, t) in c.k.iter().chain(&c.v).enumerate() {
            let layer = i % layers;
            for k in 0..3usize {
                for head in 0..h {
                    let from = src[k * lanes + layer * h + head];
                    let want = page(&before[i], i64::from(from.index()), head as i64);
                    let got = page(t, k as i64 + 1, head as i64);
                    assert!(got.equal(&want), "tensor {i} block {k} head {head}");
                }
            }
        }
        c.pack(&pack, true).unwrap();
        for (t, old) in c.k.iter().chain(&c.v).zip(&before) {
            assert!(t.equal(old), "undone exactly");
        }
    }
}
