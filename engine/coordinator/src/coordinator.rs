//! [`Coordinator`]: block tables of many sequences over tiered pools, with
//! the optional policies, one step at a time.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use kvforge_evict::{EvictionPolicy, Pressure, Scored, SinkWindow};
use kvforge_lifecycle::{
    Label, LabelSource, Lifecycle, LifecycleParams, LifecyclePolicy, ModelLabels, Outcome,
    RecentTurns, RuleFallback, Segment, TurnEnd,
};
use kvforge_lsh::{Content, Deduplicator, ExactDedup, ShareStats, SimHashDedup};
use kvforge_pool::{
    Allocation, BlockAllocator, BlockId, BlockTable, KvLayout, MAX_TIER_BLOCKS, PoolConfig,
    PoolStats, Retained, Slot, TieredPool,
};
use kvforge_prefix::{
    BlockRef, ExtraKeys, HashChainIndex, MatchStats, PrefixMatcher, RadixIndex, Xxh3Hasher,
    acquire_prefix,
};
use kvforge_quant::{TierPlan, TierPolicy};

use crate::plan::{CopyOp, Demotion, Pack, Plan, RowPack, Write};
use crate::{
    CoordError, CoordinatorConfig, DedupConfig, EvictionConfig, IndexKind, LifecycleConfig, Result,
    TurnTail,
};

/// Names one sequence of a coordinator.
pub type SeqId = u64;

/// The hot tier's number in the [`TieredPool`].
pub const HOT: usize = 0;
/// The cold tier's number (when there is one).
pub const COLD: usize = 1;

/// Occupancy of one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierStats {
    /// `hot`, or the cold format.
    pub name: &'static str,
    /// The pool's counters (blocks, in use, cached, bytes).
    pub pool: PoolStats,
}

/// What the policies did, counted over committed steps and ended turns
/// (the monitoring counters of the metrics snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Entries dropped by the eviction policy.
    pub evicted_entries: u64,
    /// Hot blocks moved to the cold tier (quantized, or another holder's
    /// cold copy reused).
    pub demoted_blocks: u64,
    /// Entries dropped by the lifecycle policy at turn ends (reclaimed
    /// segments and compressed ones).
    pub lifecycle_dropped_entries: u64,
    /// Segments the lifecycle put in its pending queue.
    pub lifecycle_queued: u64,
    /// Pending segments a later turn referred to: kept.
    pub lifecycle_revived: u64,
    /// Segments whose KV the lifecycle freed.
    pub lifecycle_reclaimed: u64,
    /// Segments replaced by a summary.
    pub lifecycle_compressed: u64,
    /// Turn ends whose model labels were missing or unusable, so the rule
    /// decided.
    pub lifecycle_fallbacks: u64,
    /// Blocks written by head-wise eviction's packing (pages copied in).
    pub packed_blocks: u64,
    /// Rows (tokens) token-level eviction marked invalid or dropped with
    /// their entry.
    pub evicted_tokens: u64,
    /// Blocks token-level eviction's compaction gave back (the live rows
    /// of holed blocks moved into fewer blocks).
    pub compacted_blocks: u64,
    /// Of the evicted entries, those taken from idle sequences to make room
    /// for another's step (the budget was full).
    pub evicted_idle_entries: u64,
    /// Steps committed.
    pub steps: u64,
}

/// What [`Coordinator::open`] found in the prefix index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Opened {
    /// The new sequence.
    pub seq: SeqId,
    /// Leading tokens whose KV it already holds.
    pub reused: usize,
}

pub(crate) struct Pending {
    /// The table after the step (what attention reads during it).
    pub(crate) next: BlockTable,
    /// References taken by the plan (allocations, retains): given back by
    /// an abort, kept by a commit.
    pub(crate) taken: Vec<BlockId>,
    /// References the commit gives back (demoted, dropped, aliased).
    pub(crate) release: Vec<BlockId>,
    /// Fresh demotions (hot, cold or canonical) for the commit to record.
    demoted: Vec<(BlockId, BlockId, bool)>,
    /// Cold blocks quantized by this step (offered to the deduplicator).
    fresh_cold: Vec<BlockId>,
    /// The step copies the shared partial tail.
    copies_tail: bool,
    /// Entries the step evicts, blocks it demotes and packs (for
    /// [`Counters`]).
    evicted: usize,
    demotions: usize,
    packed: usize,
    /// Rows marked invalid (token-level) and blocks compaction gave back.
    punched: usize,
    compacted: usize,
    /// Hot blocks an in-place pack or compaction rewrites: a cold copy
    /// made of their old content must not be reused after the commit.
    rewritten: Vec<BlockId>,
    /// Every block the engine writes for the step and the first row it
    /// writes (rows before it stay): new tokens, copies, packs,
    /// compactions, fresh cold copies.
    pub(crate) written: Vec<(BlockId, u32)>,
}

/// The hole mask of a block of `bs` rows whose first `live` rows are live.
fn holes_from(live: u32, bs: u32) -> u64 {
    let mask = |n: u32| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    mask(bs) & !mask(live)
}

/// Marks the policy's `victims` of `table` dropped and adds their blocks
/// to `release`; an entry the table cannot drop is the policy's error.
fn drop_victims(
    table: &mut BlockTable,
    victims: &[usize],
    release: &mut Vec<BlockId>,
) -> Result<()> {
    for &i in victims {
        let old = table
            .set_slot(i, Slot::Dropped)
            .map_err(|e| CoordError::Policy(format!("the eviction policy named entry {i}: {e}")))?;
        release.extend(old.block());
    }
    Ok(())
}

/// Marks the token-level policy's `victims` (`(entry, row)`, ascending)
/// invalid in `table`: an entry left with no live row is dropped (its
/// block added to `release`, its index to `drops`). Anything the table
/// refuses is the policy's error. Returns the rows evicted.
fn punch_victims(
    table: &mut BlockTable,
    victims: &[(usize, u32)],
    release: &mut Vec<BlockId>,
    drops: &mut Vec<usize>,
) -> Result<usize> {
    let bad = |m: String| CoordError::Policy(format!("the eviction policy {m}"));
    if !victims.windows(2).all(|w| w[0] < w[1]) {
        return Err(bad(format!("named rows out of order: {victims:?}")));
    }
    let bs = table.block_size();
    for run in victims.chunk_by(|a, b| a.0 == b.0) {
        let i = run[0].0;
        if let Some(&(_, r)) = run.iter().find(|v| v.1 >= bs.min(64)) {
            return Err(bad(format!("named row {r} of entry {i}, blocks of {bs}")));
        }
        let rows = run.iter().fold(0u64, |m, v| m | 1 << v.1);
        let dropped = table
            .punch_or_drop(i, rows)
            .map_err(|e| bad(format!("named rows of entry {i}: {e}")))?;
        if let Some(old) = dropped {
            release.extend(old.block());
            drops.push(i);
        }
    }
    Ok(victims.len())
}

/// The entries a head-wise pack or a token-level compaction rewrites:
/// the first `keep` take the written blocks, the others are dropped.
struct Rewrite {
    /// The entries, ascending.
    entries: Vec<usize>,
    /// Their blocks.
    blocks: Vec<BlockId>,
    /// How many of them keep a (packed) block.
    keep: usize,
    /// Permute their own blocks instead of writing fresh ones.
    in_place: bool,
}

impl Rewrite {
    /// Fresh hot blocks it writes into.
    fn fresh(&self) -> usize {
        if self.in_place { 0 } else { self.keep }
    }

    /// Blocks it lets go of at the commit.
    fn away(&self) -> &[BlockId] {
        if self.in_place {
            &self.blocks[self.keep..]
        } else {
            &self.blocks
        }
    }

    /// Applies it to `next`: entry `k < keep` takes the `k`-th written
    /// block — its own (in place) or a fresh one taken from `hot_new` —
    /// with `holes(k)` (`None`: a head-wise pack), the others are dropped;
    /// the blocks let go of go to `release`, the dropped entries to
    /// `drops`. Returns the written blocks.
    fn apply(
        &self,
        next: &mut BlockTable,
        hot_new: &mut &[BlockId],
        holes: impl Fn(usize) -> Option<u64>,
        release: &mut Vec<BlockId>,
        drops: &mut Vec<usize>,
    ) -> Result<Vec<BlockId>> {
        let dst = if self.in_place {
            self.blocks.clone()
        } else {
            let (fresh, rest) = hot_new.split_at(self.keep);
            *hot_new = rest;
            fresh.to_vec()
        };
        for (k, &i) in self.entries.iter().enumerate() {
            if k < self.keep {
                let old = match holes(k) {
                    None => next.repack(i, dst[k])?,
                    Some(h) => next.repack_rows(i, dst[k], h)?,
                };
                if !self.in_place {
                    release.extend(old.block());
                }
            } else {
                drops.push(i);
                release.extend(next.set_slot(i, Slot::Dropped)?.block());
            }
        }
        Ok(dst)
    }
}

/// Token-level eviction's compaction worked out by `row_packing`.
struct RowPacking {
    /// The holed entries; in place, the rows are permuted where they are.
    rw: Rewrite,
    /// Their live rows.
    live: usize,
    /// Every row of their blocks: the live ones in order, then the holes.
    order: Vec<(BlockId, u32)>,
}

/// A head-wise eviction worked out by `lane_packing`.
struct Packing {
    /// The entries any lane stops reading; in place, the union's own
    /// blocks are permuted.
    rw: Rewrite,
    /// For packed block `k` and lane `l`, at `k × lanes + l`: the block
    /// whose page of lane `l` it takes (in place: for every block of the
    /// union, the dropped pages after the kept ones).
    src: Vec<BlockId>,
}

/// Entries idle sequences give up to make room for another's step:
/// chosen by `idle_cuts`, dropped by `apply_idle_cuts`.
#[derive(Default)]
struct IdleCuts {
    /// Per sequence: its table with the victims dropped, the blocks it
    /// lets go of, the number of victims.
    cuts: Vec<(SeqId, BlockTable, Vec<BlockId>, usize)>,
    /// Bytes, hot and cold blocks that come back for good.
    bytes: u64,
    hot: usize,
    cold: usize,
}

/// A step's decisions, from the checks of `plan` to `take_and_build`.
struct Build {
    /// What idle sequences give up for the step.
    idle: IdleCuts,
    next: BlockTable,
    plan: Plan,
    release: Vec<BlockId>,
    /// Demotions reusing another holder's cold copy: (entry, hot, cold).
    reuse: Vec<(usize, BlockId, BlockId)>,
    /// Demotions quantized anew: (entry, hot).
    fresh: Vec<(usize, BlockId)>,
    need_hot: usize,
    copy_src: Option<(BlockId, u32)>,
    in_open: usize,
    n: usize,
    packing: Option<Packing>,
    row_packing: Option<RowPacking>,
    punched: usize,
}

/// A turn in progress: what [`Coordinator::rollback_turn`] restores.
pub(crate) struct Turn {
    /// The table at the start of the turn, holding references of its own.
    pub(crate) table: BlockTable,
    /// The sequence's registration state at the start of the turn.
    copy_tail: bool,
    partial: Option<BlockId>,
    indexed: usize,
    /// Index moves (hot -> its cold copy) of demotions committed during
    /// the turn: applied when the turn ends (or at a registration), dropped
    /// if it is rolled back, so a failed turn leaves the index as it was.
    relocations: Vec<(BlockId, BlockId)>,
}

pub(crate) struct SeqState {
    pub(crate) table: BlockTable,
    pub(crate) pending: Option<Pending>,
    /// The turn in progress, if any.
    pub(crate) turn: Option<Turn>,
    /// The last entry is a partial block that others may read (matched
    /// from the index, forked, or given back by a rollback after others
    /// took it): the next step copies it into a block of the sequence's
    /// own.
    copy_tail: bool,
    /// The open partial block this sequence registered last (its index
    /// entry is replaced when it is registered again, longer).
    partial: Option<BlockId>,
    /// Leading entries registered in the index as a chain (an open partial
    /// one excluded): the next registration extends below the last one.
    indexed: usize,
    /// The step count at its last commit (idle sequences lose entries to
    /// another's step least recently stepped first).
    last_step: u64,
}

/// The tensor-free cache coordinator.
///
/// Owns the tiered pools, the prefix index and the optional policies, and
/// one [`BlockTable`] per live sequence. Each step of a sequence is
/// [`plan`](Self::plan)ned (blocks allocated, nothing released), carried
/// out by the engine with tensors, then [`commit`](Self::commit)ted or
/// [`abort`](Self::abort)ed. Policies only decide; the coordinator and the
/// pools apply.
pub struct Coordinator {
    cfg: CoordinatorConfig,
    pub(crate) budget: u64,
    pub(crate) tiers: TieredPool,
    index: Option<Box<dyn PrefixMatcher>>,
    tier_policy: Option<Box<dyn TierPolicy>>,
    evict: Option<Box<dyn EvictionPolicy>>,
    dedup: Option<Box<dyn Deduplicator>>,
    lifecycle: Option<Lifecycle>,
    pub(crate) seqs: BTreeMap<SeqId, SeqState>,
    next_seq: SeqId,
    /// Hot block -> the cold block its content was quantized into, so a
    /// second holder of the hot block reuses that copy.
    pub(crate) demoted: HashMap<BlockId, BlockId>,
    /// Blocks marked cached (the index may hand them out: their content
    /// must outlive their last holder and never change), with the most
    /// tokens the index was given for each; and cold blocks whose last
    /// holder let go of them without that: the engine may free their
    /// storage.
    pub(crate) cached: HashMap<BlockId, u32>,
    pub(crate) freed_cold: Vec<BlockId>,
    /// Lanes of a block: layers × KV heads (head-wise eviction).
    lanes: usize,
    /// The most bytes in use right after a plan (blocks a step holds
    /// until its commit included), since the last reset.
    step_peak: u64,
    counters: Counters,
    /// Check every invariant after each public call.
    check: bool,
}

impl Coordinator {
    /// Builds pools and policies from `cfg`. Errors: a budget smaller than
    /// one hot block, no hot blocks, window/sink not whole blocks, sharing
    /// without a cold tier, a cold format the layout cannot hold, policy
    /// parameters that cannot work.
    pub fn new(cfg: CoordinatorConfig) -> Result<Self> {
        let hot = cfg.layout;
        let budget = cfg.budget();
        if cfg.hot_blocks == 0 {
            return Err(CoordError::Config(
                "the hot tier needs at least one block".into(),
            ));
        }
        if budget < hot.block_bytes() {
            return Err(CoordError::Config(format!(
                "a budget of {budget} bytes is smaller than one block ({} bytes)",
                hot.block_bytes()
            )));
        }
        let bs = hot.block_size() as usize;
        let hot_max = (cfg.hot_blocks as u64)
            .min(budget / hot.block_bytes())
            .min(MAX_TIER_BLOCKS as u64) as usize;
        let mut tiers = vec![(hot, PoolConfig::fixed(hot_max))];
        let mut tier_policy: Option<Box<dyn TierPolicy>> = None;
        if let Some(c) = cfg.cold {
            if c.format.group().is_none() || c.value_format.group().is_none() {
                return Err(CoordError::Config(format!(
                    "the cold tier needs a quantized format, not {:?}",
                    c.format
                )));
            }
            let layout = hot.with_kv_formats(c.format, c.value_format)?;
            let cold_max = (budget / layout.block_bytes()).min(MAX_TIER_BLOCKS as u64) as usize;
            // Cold blocks appear as hot ones leave: grow in small batches.
            let pool = PoolConfig::fixed(cold_max.min(64)).with_max_blocks(cold_max);
            tiers.push((layout, pool.with_growth_batch(64)));
            tier_policy = Some(Box::new(TierPlan::new(bs, c.window)?.with_sink(c.sink)?));
        }
        let index: Option<Box<dyn PrefixMatcher>> = match &cfg.prefix {
            None => None,
            Some(p) => {
                let hasher = p
                    .seed
                    .map_or_else(Xxh3Hasher::random, Xxh3Hasher::with_seed);
                Some(match p.index {
                    IndexKind::HashChain => Box::new(HashChainIndex::with_hasher(bs, hasher)?),
                    IndexKind::Radix => Box::new(RadixIndex::new(bs)?),
                })
            }
        };
        let evict: Option<Box<dyn EvictionPolicy>> = match cfg.eviction {
            None => None,
            Some(EvictionConfig::SinkWindow { sink, window }) => {
                Some(Box::new(SinkWindow::new(sink, window)?))
            }
            Some(EvictionConfig::Scored {
                score,
                trigger,
                sink,
                window,
                per_head,
                per_token,
            }) => {
                let p = Scored::new(score, trigger, sink, window)?;
                let bad = |m: &str| Err(CoordError::Config(m.into()));
                if per_head && per_token {
                    return bad("eviction is per head or per token, not both");
                }
                if (per_head || per_token) && cfg.cold.is_some() {
                    return bad(
                        "per-head and token-level eviction pack hot blocks; they do not combine with a cold tier yet",
                    );
                }
                if per_token && bs > kvforge_pool::MAX_HOLED_BLOCK as usize {
                    return bad("token-level eviction marks rows of blocks of at most 64 tokens");
                }
                Some(Box::new(match (per_head, per_token) {
                    (true, _) => p.per_head()?,
                    (_, true) => p.per_token()?,
                    _ => p,
                }))
            }
        };
        let dedup: Option<Box<dyn Deduplicator>> = match cfg.dedup {
            None => None,
            Some(_) if cfg.cold.is_none() => {
                return Err(CoordError::Config(
                    "sharing duplicate blocks works in the cold tier: configure a cold tier too"
                        .into(),
                ));
            }
            Some(DedupConfig::Exact) => Some(Box::new(ExactDedup::new())),
            Some(DedupConfig::SimHash(c)) => Some(Box::new(SimHashDedup::new(c)?)),
        };
        let lifecycle = cfg.lifecycle.map(lifecycle_from).transpose()?;
        if let (Some(c), Some(window)) = (cfg.cold, cfg.eviction.map(|e| e.window())) {
            if window < c.window {
                return Err(CoordError::Config(format!(
                    "an eviction window of {window} tokens inside the hot window of {} drops blocks before they could go cold: make it at least as long",
                    c.window
                )));
            }
        }
        Ok(Coordinator {
            budget,
            tiers: TieredPool::new(tiers)?,
            index,
            tier_policy,
            evict,
            dedup,
            lifecycle,
            seqs: BTreeMap::new(),
            next_seq: 1,
            demoted: HashMap::new(),
            cached: HashMap::new(),
            freed_cold: Vec::new(),
            lanes: (hot.layers() * hot.kv_heads()) as usize,
            step_peak: 0,
            counters: Counters::default(),
            check: false,
            cfg,
        })
    }

    /// Runs [`testing::check_invariants`](crate::testing::check_invariants)
    /// after every public call that changes state, turning a broken
    /// invariant into [`CoordError::Invariant`] (for tests and debugging:
    /// it walks every table).
    pub fn check_every_call(&mut self, on: bool) {
        self.check = on;
    }

    /// `r`, or the broken invariant when checking is on.
    fn checked<T>(&self, r: Result<T>) -> Result<T> {
        if self.check && r.is_ok() {
            crate::testing::check_invariants(self).map_err(CoordError::Invariant)?;
        }
        r
    }

    /// Replaces the eviction policy (a researcher's own); `None` turns
    /// eviction off.
    pub fn set_eviction_policy(&mut self, p: Option<Box<dyn EvictionPolicy>>) {
        self.evict = p;
    }

    /// Replaces the tier policy (which hot entries go cold). Refused
    /// without a cold tier to put them in.
    pub fn set_tier_policy(&mut self, p: Box<dyn TierPolicy>) -> Result<()> {
        if self.tiers.tiers() <= COLD {
            return Err(CoordError::Config("no cold tier to demote into".into()));
        }
        self.tier_policy = Some(p);
        Ok(())
    }

    /// Replaces the deduplicator. Refused without a cold tier.
    pub fn set_deduplicator(&mut self, d: Option<Box<dyn Deduplicator>>) -> Result<()> {
        if d.is_some() && self.tiers.tiers() <= COLD {
            return Err(CoordError::Config("sharing needs a cold tier".into()));
        }
        self.dedup = d;
        Ok(())
    }

    /// Replaces the lifecycle policy (a researcher's own), acting under
    /// `params`; `None` turns the lifecycle off.
    pub fn set_lifecycle_policy(
        &mut self,
        p: Option<(Box<dyn LifecyclePolicy>, LifecycleParams)>,
    ) -> Result<()> {
        self.lifecycle = p.map(|(p, params)| Lifecycle::new(p, params)).transpose()?;
        Ok(())
    }

    /// Where the lifecycle's labels come from (`None`: no lifecycle).
    pub fn lifecycle_source(&self) -> Option<LabelSource> {
        self.lifecycle.as_ref().map(Lifecycle::source)
    }

    /// The segments the turn of `seq` in progress will add when it ends
    /// with `cuts` (what the model is asked to label); empty without a
    /// lifecycle.
    pub fn turn_segments(&self, seq: SeqId, cuts: &[u64]) -> Result<Vec<Segment>> {
        let end = self.seq(seq)?.table.positions();
        Ok(self
            .lifecycle
            .as_ref()
            .map(|l| l.turn_segments(seq, end, cuts))
            .unwrap_or_default())
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.cfg.layout.block_size() as usize
    }

    /// The pools.
    pub fn pools(&self) -> &TieredPool {
        &self.tiers
    }

    /// Layout of the cold tier, if there is one.
    pub fn cold_layout(&self) -> Option<KvLayout> {
        self.tiers.layout(COLD).ok().copied()
    }

    /// The byte budget across all tiers.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes held by blocks in use, all tiers (each block once, however
    /// many sequences share it).
    pub fn bytes_in_use(&self) -> u64 {
        self.tiers.in_use_bytes()
    }

    /// Bytes in use however the steps in flight end: each one, committed,
    /// gives back the blocks it releases and, aborted, those it took —
    /// counted only where it is their only holder. What an
    /// [`open`](Self::open) may not push over the budget.
    fn worst_bytes(&self) -> u64 {
        let frees = |list: &[BlockId]| -> u64 {
            let mut n: HashMap<BlockId, u32> = HashMap::new();
            for &b in list {
                *n.entry(b).or_default() += 1;
            }
            n.iter()
                .filter(|&(&b, &k)| self.tiers.ref_count(b).is_ok_and(|c| c == k))
                .map(|(&b, _)| self.bytes_of(b))
                .sum()
        };
        let credit: u64 = self
            .seqs
            .values()
            .filter_map(|s| s.pending.as_ref())
            .map(|p| frees(&p.release).min(frees(&p.taken)))
            .sum();
        self.tiers.in_use_bytes().saturating_sub(credit)
    }

    /// Bytes of one block of `b`'s tier.
    fn bytes_of(&self, b: BlockId) -> u64 {
        self.tiers
            .layout(TieredPool::tier_of(b))
            .map_or(0, |l| l.block_bytes())
    }

    /// Per-tier occupancy.
    pub fn tier_stats(&self) -> Vec<TierStats> {
        (0..self.tiers.tiers())
            .filter_map(|t| {
                let pool = self.tiers.tier_stats(t).ok()?;
                let name = if t == HOT { "hot" } else { "cold" };
                Some(TierStats { name, pool })
            })
            .collect()
    }

    /// The most bytes in use at any moment since the last
    /// [`reset_step_peak`](Self::reset_step_peak): right after each plan,
    /// while the step holds both the blocks it will release at its commit
    /// (dropped, demoted, packed away) and the ones it took. Between steps
    /// [`bytes_in_use`](Self::bytes_in_use) is lower.
    pub fn step_peak_bytes(&self) -> u64 {
        self.step_peak.max(self.tiers.in_use_bytes())
    }

    /// Starts a new [`step_peak_bytes`](Self::step_peak_bytes) measurement.
    pub fn reset_step_peak(&mut self) {
        self.step_peak = 0;
    }

    /// What the policies did so far (evictions, demotions, lifecycle
    /// drops, steps).
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The prefix index's counters, when reuse is on.
    pub fn index_stats(&self) -> Option<MatchStats> {
        self.index.as_ref().map(|i| i.stats())
    }

    /// The deduplicator's counters, when sharing is on.
    pub fn share_stats(&self) -> Option<ShareStats> {
        self.dedup.as_ref().map(|d| d.stats())
    }

    /// Live sequences.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    fn tail(&self) -> Option<TurnTail> {
        self.cfg.prefix.as_ref().map(|p| p.tail)
    }

    /// Whether prefix reuse is on.
    pub fn reuses_prefixes(&self) -> bool {
        self.index.is_some()
    }

    fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or(CoordError::UnknownSeq(id))
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut SeqState> {
        self.seqs.get_mut(&id).ok_or(CoordError::UnknownSeq(id))
    }

    /// The committed table of a sequence.
    pub fn table(&self, id: SeqId) -> Result<&BlockTable> {
        Ok(&self.seq(id)?.table)
    }

    /// The table a step attends over: the planned one while a step is in
    /// flight, else the committed one.
    pub fn view(&self, id: SeqId) -> Result<&BlockTable> {
        let s = self.seq(id)?;
        Ok(s.pending.as_ref().map_or(&s.table, |p| &p.next))
    }

    /// Opens an empty sequence.
    pub fn open_empty(&mut self) -> SeqId {
        let id = self.next_seq;
        self.next_seq += 1;
        let table = BlockTable::new(self.cfg.layout.block_size())
            .unwrap_or_else(|_| unreachable!("the layout's block size is positive"));
        self.seqs.insert(
            id,
            SeqState {
                table,
                pending: None,
                turn: None,
                copy_tail: false,
                partial: None,
                indexed: 0,
                last_step: 0,
            },
        );
        id
    }

    /// Opens a sequence for a prompt of `tokens`: with reuse on, it starts
    /// with the longest cached prefix of `tokens[..len - 1]` (the last token
    /// is always computed, for its logits), hot and cold blocks as they
    /// are cached, with a reference on each. The match is cut where
    /// reviving cached blocks (or keeping blocks a step in flight is
    /// about to free) would put the bytes in use over the budget, whether
    /// the steps in flight are committed or aborted.
    pub fn open(&mut self, tokens: &[u32], extra: &ExtraKeys) -> Result<Opened> {
        let r = self.open_call(tokens, extra);
        self.checked(r)
    }

    fn open_call(&mut self, tokens: &[u32], extra: &ExtraKeys) -> Result<Opened> {
        let Some(index) = self.index.as_mut() else {
            return Ok(Opened {
                seq: self.open_empty(),
                reused: 0,
            });
        };
        let upto = tokens.len().saturating_sub(1);
        let mut m = acquire_prefix(index, &self.tiers, &tokens[..upto], extra)?;
        let copy = self.tail() == Some(TurnTail::Copy);
        let bs = self.block_size() as u32;
        // A partial tail can only be copied out of the hot tier.
        if let Some(last) = m.blocks.last().copied() {
            if copy && last.len < bs && TieredPool::tier_of(last.block) != HOT {
                self.release_all(&[last.block])?;
                m.truncate(m.blocks.len() - 1);
            }
        }
        while self.worst_bytes() > self.budget {
            let Some(last) = m.blocks.last().copied() else {
                break;
            };
            self.release_all(&[last.block])?;
            m.truncate(m.blocks.len() - 1);
        }
        let seq = self.open_empty();
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        for b in &m.blocks {
            let slot = if TieredPool::tier_of(b.block) == HOT {
                Slot::Hot(b.block)
            } else {
                Slot::Cold(b.block)
            };
            s.table.push(slot, b.len, false)?;
        }
        s.copy_tail = copy && m.blocks.last().is_some_and(|b| b.len < bs);
        Ok(Opened {
            seq,
            reused: m.tokens,
        })
    }

    /// Plans one step of `n` new tokens for `seq`: drops (eviction),
    /// demotions (tier policy) and the hot blocks for the new tokens. Blocks
    /// are allocated now; nothing is released before [`commit`](Self::commit).
    ///
    /// Everything is decided and checked (the policies' answers, the byte
    /// budget, room in every tier) before anything is taken, so on error
    /// nothing changed: tables, counts, pools, index and the other
    /// sequences are as they were (the policies were asked, as for a step
    /// that is aborted). When the step only fits by taking entries from
    /// idle sequences, those are dropped first; an abort does not bring
    /// them back.
    pub fn plan(&mut self, seq: SeqId, n: usize) -> Result<Plan> {
        let r = self.plan_call(seq, n);
        self.checked(r)
    }

    fn plan_call(&mut self, seq: SeqId, n: usize) -> Result<Plan> {
        let bs = self.block_size();
        let s = self.seq(seq)?;
        if s.pending.is_some() {
            return Err(CoordError::Order {
                seq,
                what: "a step is already planned (commit or abort it first)",
            });
        }
        if n == 0 {
            return Err(CoordError::Order {
                seq,
                what: "a step of zero tokens",
            });
        }
        let mut next = s.table.clone();
        let copy_tail = s.copy_tail;
        let mut plan = Plan {
            start: next.positions(),
            ..Plan::default()
        };
        // 1. What the step does, decided on the planned table.
        let mut release = Vec::new();
        let (lane_drops, punched) =
            self.evict_own(seq, n, &mut next, &mut release, &mut plan.drops)?;
        let packing = self.lane_packing(&next, &lane_drops)?;
        let row_packing = self.row_packing(&next);
        // At most one of them: a policy is per lane, per token or neither.
        let rewrite = packing
            .as_ref()
            .map(|p| &p.rw)
            .or(row_packing.as_ref().map(|p| &p.rw));
        let demote = self.demotions(&next, rewrite)?;
        // Another holder's cold copy of the same block is reused as is
        // (held copies only: reviving a cached one would cost bytes);
        // the others are quantized anew.
        let mut reuse = Vec::new();
        let mut fresh = Vec::new();
        for (i, hot) in demote {
            match self.demoted.get(&hot) {
                Some(&c) if self.tiers.ref_count(c).is_ok_and(|k| k > 0) => reuse.push((i, hot, c)),
                _ => fresh.push((i, hot)),
            }
        }
        // A shared partial tail is copied into a block of our own, which
        // then takes the new tokens.
        let copy_src = match next.entries().last() {
            Some(e) if copy_tail && !next.is_open() && (e.tokens() as usize) < bs => {
                match e.slot() {
                    Slot::Hot(b) => Some((b, e.tokens())),
                    _ => None,
                }
            }
            _ => None,
        };
        let room = match copy_src {
            Some((_, len)) => bs - len as usize,
            None => next.room() as usize,
        };
        let in_open = n.min(room);
        let need_hot = (n - in_open).div_ceil(bs)
            + usize::from(copy_src.is_some())
            + rewrite.map_or(0, Rewrite::fresh);
        // 2. The budget holds between steps: blocks this step lets go of
        // for good (dropped or demoted, no other holder) make room. Until
        // the commit they are still held, so a step can exceed it by the
        // blocks it demotes or drops.
        let freed: u64 = release
            .iter()
            .chain(rewrite.map_or(&[][..], Rewrite::away))
            .chain(copy_src.iter().map(|(b, _)| b))
            .chain(fresh.iter().map(|(_, h)| h))
            .chain(reuse.iter().map(|(_, h, _)| h))
            .filter(|&&b| self.tiers.ref_count(b).is_ok_and(|c| c == 1))
            .map(|&b| self.bytes_of(b))
            .sum();
        let hot_bytes = self.cfg.layout.block_bytes();
        let cold_bytes = self.cold_layout().map_or(0, |l| l.block_bytes());
        let too_big = || {
            CoordError::CacheFull(format!(
                "a step of {n} tokens needs more KV than any budget holds"
            ))
        };
        let step_bytes = (need_hot as u64)
            .checked_mul(hot_bytes)
            .zip((fresh.len() as u64).checked_mul(cold_bytes))
            .and_then(|(h, c)| h.checked_add(c))
            .ok_or_else(too_big)?;
        let mut want = self
            .tiers
            .in_use_bytes()
            .saturating_add(step_bytes)
            .saturating_sub(freed);
        // Idle sequences give up entries, least recently stepped first,
        // when that makes the step fit; nothing is dropped yet. The cold
        // copies the step reuses stay (it takes them before the cuts).
        let idle = if want > self.budget {
            let keep: Vec<BlockId> = reuse.iter().map(|&(_, _, c)| c).collect();
            self.idle_cuts(seq, want, &keep)?
        } else {
            IdleCuts::default()
        };
        want = want.saturating_sub(idle.bytes);
        if want > self.budget {
            return Err(CoordError::CacheFull(format!(
                "the step needs {want} bytes of KV, over the budget of {} bytes",
                self.budget
            )));
        }
        for (tier, need, freed_here) in [(HOT, need_hot, idle.hot), (COLD, fresh.len(), idle.cold)]
        {
            if need == 0 {
                continue;
            }
            let st = self.tiers.tier_stats(tier)?;
            let free = st.max_blocks.saturating_sub(st.in_use + st.retired) + freed_here;
            if need > free {
                let what = if tier == HOT { "hot" } else { "cold" };
                return Err(CoordError::CacheFull(format!(
                    "{need} more {what} blocks of {bs} tokens needed, {free} of {} free",
                    st.max_blocks
                )));
            }
        }
        // 3. The step happens: references are taken, idle sequences give
        // up what was chosen; a failure from here on (a broken pool
        // contract) gives back everything taken.
        let mut taken = Vec::new();
        let built = self.take_and_build(
            Build {
                idle,
                next,
                plan,
                release,
                reuse,
                fresh,
                need_hot,
                copy_src,
                in_open,
                n,
                packing,
                row_packing,
                punched,
            },
            &mut taken,
        );
        match built {
            Ok((plan, pending)) => {
                self.step_peak = self.step_peak.max(self.tiers.in_use_bytes());
                self.seq_mut(seq)?.pending = Some(Pending { taken, ..pending });
                Ok(plan)
            }
            Err(e) => {
                let _ = self.release_all(&taken);
                Err(e)
            }
        }
    }

    /// The eviction policy's victims among `seq`'s own entries, applied to
    /// the planned table `next` (their blocks to `release`, dropped entries
    /// to `drops`). Returns a per-lane policy's answer (packed afterwards)
    /// and the rows a token-level policy marked invalid.
    fn evict_own(
        &mut self,
        seq: SeqId,
        n: usize,
        next: &mut BlockTable,
        release: &mut Vec<BlockId>,
        drops: &mut Vec<usize>,
    ) -> Result<(Vec<usize>, usize)> {
        let pressure = self.pressure(self.tiers.in_use_bytes(), n);
        let Some(ev) = self.evict.as_mut() else {
            return Ok((Vec::new(), 0));
        };
        let mut victims = Vec::new();
        if ev.per_lane() {
            ev.lane_victims(seq, next, pressure, self.lanes, &mut victims);
            return Ok((victims, 0));
        }
        if ev.token_level() {
            let mut rows = Vec::new();
            ev.token_victims(seq, next, pressure, &mut rows);
            let punched = punch_victims(next, &rows, release, drops)?;
            return Ok((Vec::new(), punched));
        }
        ev.victims(seq, next, pressure, &mut victims);
        drop_victims(next, &victims, release)?;
        drops.extend_from_slice(&victims);
        Ok((Vec::new(), 0))
    }

    /// The tier policy's answer for `next`, checked: strictly ascending
    /// entries, each a full, closed hot block without holes. Entries a
    /// head-wise pack or a compaction rewrites this step stay hot.
    fn demotions(
        &self,
        next: &BlockTable,
        rewrite: Option<&Rewrite>,
    ) -> Result<Vec<(usize, BlockId)>> {
        let Some(tp) = self.tier_policy.as_ref() else {
            return Ok(Vec::new());
        };
        let mut demote = Vec::new();
        tp.demote(next, &mut demote);
        if let Some(rw) = rewrite {
            demote.retain(|i| rw.entries.binary_search(i).is_err());
        }
        if !demote.windows(2).all(|w| w[0] < w[1]) {
            return Err(CoordError::Policy(format!(
                "the tier policy named entries out of order or twice: {demote:?}"
            )));
        }
        let bs = next.block_size();
        let last = next.entries().len().wrapping_sub(1);
        demote
            .into_iter()
            .map(|i| match next.entries().get(i) {
                Some(e)
                    if e.tokens() == bs
                        && e.holes() == 0
                        && !(next.is_open() && i == last) =>
                {
                    match e.slot() {
                        Slot::Hot(b) => Ok((i, b)),
                        _ => Err(i),
                    }
                }
                _ => Err(i),
            })
            .collect::<std::result::Result<_, usize>>()
            .map_err(|i| {
                CoordError::Policy(format!(
                    "the tier policy named entry {i}, which is not a full, closed hot block without holes"
                ))
            })
    }

    /// Takes the step's references (reused cold copies, fresh cold and hot
    /// blocks; each pushed to `taken` as it is taken) and builds the
    /// planned table and the plan. The checks in [`plan`](Self::plan)
    /// made every allocation fit: an error here is a broken contract, and
    /// the caller gives back `taken`.
    fn take_and_build(&mut self, b: Build, taken: &mut Vec<BlockId>) -> Result<(Plan, Pending)> {
        let Build {
            idle,
            mut next,
            mut plan,
            mut release,
            reuse,
            fresh,
            need_hot,
            copy_src,
            in_open,
            n,
            packing,
            row_packing,
            punched,
        } = b;
        let bs = self.block_size();
        for &(_, _, c) in &reuse {
            self.retain_all(&[c])?;
            taken.push(c);
        }
        self.apply_idle_cuts(idle)?;
        let cold_new = self.allocate(COLD, fresh.len(), taken)?;
        let mut hot_new = &self.allocate(HOT, need_hot, taken)?[..];
        let reused = reuse.iter().map(|&(entry, hot, cold)| Demotion {
            entry,
            hot,
            cold,
            quantize: false,
        });
        let quantized = fresh
            .iter()
            .zip(&cold_new)
            .map(|(&(entry, hot), &cold)| Demotion {
                entry,
                hot,
                cold,
                quantize: true,
            });
        plan.demotions = reused.chain(quantized).collect();
        plan.demotions.sort_by_key(|d| d.entry);
        let mut demoted = Vec::new();
        for d in &plan.demotions {
            next.set_slot(d.entry, Slot::Cold(d.cold))?;
            release.push(d.hot);
            demoted.push((d.hot, d.cold, d.quantize));
        }
        let mut rewritten = Vec::new();
        // Head-wise eviction: the first `keep` entries of the union take
        // the packed blocks, the others are dropped.
        if let Some(p) = packing {
            let rw = &p.rw;
            let dst = rw.apply(
                &mut next,
                &mut hot_new,
                |_| None,
                &mut release,
                &mut plan.drops,
            )?;
            if rw.in_place {
                rewritten.extend_from_slice(&dst);
            }
            if rw.keep > 0 {
                plan.pack = Some(Pack {
                    lanes: self.lanes,
                    dst,
                    src: p.src,
                    in_place: rw.in_place,
                });
            }
        }
        // Token-level eviction: the live rows of the holed entries move
        // into the first `keep` of them (the last one's tail holes), the
        // others are dropped.
        let mut compacted = 0;
        if let Some(p) = row_packing {
            let rw = &p.rw;
            let tail = (p.live - (rw.keep - 1) * bs) as u32;
            let holes = |k: usize| {
                Some(if k + 1 == rw.keep {
                    holes_from(tail, bs as u32)
                } else {
                    0
                })
            };
            let dst = rw.apply(
                &mut next,
                &mut hot_new,
                holes,
                &mut release,
                &mut plan.drops,
            )?;
            if rw.in_place {
                rewritten.extend_from_slice(&dst);
            }
            compacted = rw.entries.len() - rw.keep;
            let mut src = p.order;
            src.truncate(dst.len() * bs);
            plan.rows = Some(RowPack {
                block_size: bs as u32,
                dst,
                src,
                in_place: rw.in_place,
            });
        }
        plan.drops.sort_unstable();
        // The copy, then writes: the rest of the open block, then the new
        // blocks.
        if let Some((src, tokens)) = copy_src {
            let (&dst, rest) = hot_new
                .split_first()
                .ok_or_else(|| CoordError::CacheFull("no block for the copied tail".into()))?;
            hot_new = rest;
            next.reopen_tail(dst)?;
            release.push(src);
            plan.copies.push(CopyOp { src, dst, tokens });
        }
        if in_open > 0 {
            if let Some(Slot::Hot(b)) = next.entries().last().map(|e| e.slot()) {
                let offset = next.entries().last().map_or(0, |e| e.tokens());
                plan.writes.push(Write {
                    block: b,
                    offset,
                    tokens: in_open as u32,
                });
            }
            next.fill(in_open as u32)?;
        }
        let mut left = n - in_open;
        for &b in hot_new {
            let take = left.min(bs);
            next.push(Slot::Hot(b), take as u32, take < bs)?;
            plan.writes.push(Write {
                block: b,
                offset: 0,
                tokens: take as u32,
            });
            left -= take;
        }
        let written = plan
            .writes
            .iter()
            .map(|w| (w.block, w.offset))
            .chain(plan.copies.iter().map(|c| (c.dst, 0)))
            .chain(plan.pack.iter().flat_map(|p| p.dst.iter().map(|&b| (b, 0))))
            .chain(plan.rows.iter().flat_map(|p| p.dst.iter().map(|&b| (b, 0))))
            .chain(
                plan.demotions
                    .iter()
                    .filter(|d| d.quantize)
                    .map(|d| (d.cold, 0)),
            )
            .collect();
        let pending = Pending {
            written,
            next,
            taken: Vec::new(),
            release,
            demoted,
            fresh_cold: cold_new,
            copies_tail: copy_src.is_some(),
            evicted: plan.drops.len(),
            demotions: plan.demotions.len(),
            packed: plan.pack.as_ref().map_or(0, |p| p.dst.len()),
            punched,
            compacted,
            rewritten,
        };
        Ok((plan, pending))
    }

    /// `n` fresh blocks of `tier`, each pushed to `taken`; the index and
    /// the deduplicator forget the cached blocks reclaimed for them.
    fn allocate(
        &mut self,
        tier: usize,
        n: usize,
        taken: &mut Vec<BlockId>,
    ) -> Result<Vec<BlockId>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut got = Allocation::default();
        if !self.tiers.allocate_in(tier, n, &mut got)? {
            return Err(CoordError::CacheFull(format!(
                "{n} blocks of tier {tier} were counted free and are not"
            )));
        }
        taken.extend_from_slice(&got.blocks);
        self.forget_reclaimed(&got.reclaimed);
        Ok(got.blocks)
    }

    /// Token-level eviction's compaction, when the live rows of the holed
    /// entries fit in fewer blocks than they hold: which entries, how many
    /// keep a block, and the order of their rows (in place when nothing
    /// else can see the blocks, as for head-wise packing).
    fn row_packing(&self, table: &BlockTable) -> Option<RowPacking> {
        let bs = table.block_size();
        let last = table.entries().len().wrapping_sub(1);
        let mut entries = Vec::new();
        let mut blocks = Vec::new();
        let mut live = 0usize;
        for (i, e) in table.entries().iter().enumerate() {
            if let Slot::Hot(b) = e.slot()
                && e.holes() != 0
                && e.tokens() == bs
                && !(table.is_open() && i == last)
            {
                entries.push(i);
                blocks.push(b);
                live += e.live() as usize;
            }
        }
        let keep = live.div_ceil(bs as usize);
        if keep >= entries.len() {
            return None;
        }
        let in_place = self.index.is_none()
            && blocks
                .iter()
                .all(|&b| self.tiers.ref_count(b).is_ok_and(|c| c == 1));
        let rows = |hole: bool| {
            entries.iter().zip(&blocks).flat_map(move |(&i, &b)| {
                let h = table.entries()[i].holes();
                (0..bs)
                    .filter(move |r| (h >> r & 1 == 1) == hole)
                    .map(move |r| (b, r))
            })
        };
        let order: Vec<(BlockId, u32)> = rows(false).chain(rows(true)).collect();
        Some(RowPacking {
            rw: Rewrite {
                entries,
                blocks,
                keep,
                in_place,
            },
            live,
            order,
        })
    }

    /// What a policy is told when `in_use` bytes are (or would be) in use
    /// and `new_tokens` are coming.
    fn pressure(&self, in_use: u64, new_tokens: usize) -> Pressure {
        Pressure {
            used: in_use as f64 / self.budget as f64,
            new_tokens,
            budget_bytes: self.budget,
            hot_block_bytes: self.cfg.layout.block_bytes(),
            cold_block_bytes: self.cold_layout().map_or(0, |l| l.block_bytes()),
        }
    }

    /// The step of `stepping` would bring the bytes in use to `want`, over
    /// the budget: the eviction policy names victims in the other idle
    /// sequences (no step planned, no turn in flight), least recently
    /// stepped first, as if the bytes in use were `want`, until the step
    /// fits. Nothing is dropped here ([`apply_idle_cuts`](Self::apply_idle_cuts)
    /// does). Per-lane and token-level policies (whose victims need the
    /// engine's packing) and policies that name nothing free nothing here.
    fn idle_cuts(&mut self, stepping: SeqId, want: u64, keep: &[BlockId]) -> Result<IdleCuts> {
        let mut order: Vec<(u64, SeqId)> = self
            .seqs
            .iter()
            .filter(|(id, s)| **id != stepping && s.pending.is_none() && s.turn.is_none())
            .map(|(id, s)| (s.last_step, *id))
            .collect();
        order.sort_unstable();
        let mut out = IdleCuts::default();
        // Blocks let go of so far, with multiplicity: one held by two idle
        // sequences is freed only when both give it up.
        let mut let_go: HashMap<BlockId, u32> = HashMap::new();
        for (_, id) in order {
            let left = want.saturating_sub(out.bytes);
            if left <= self.budget {
                break;
            }
            let pressure = self.pressure(left, 0);
            let (Some(ev), Some(s)) = (self.evict.as_mut(), self.seqs.get(&id)) else {
                break;
            };
            if ev.per_lane() || ev.token_level() {
                break;
            }
            let mut victims = Vec::new();
            ev.victims(id, &s.table, pressure, &mut victims);
            if victims.is_empty() {
                continue;
            }
            let mut table = s.table.clone();
            let mut release = Vec::new();
            drop_victims(&mut table, &victims, &mut release)?;
            table.compact();
            for &b in &release {
                let n = let_go.entry(b).or_default();
                *n += 1;
                if !keep.contains(&b) && self.tiers.ref_count(b).is_ok_and(|c| c == *n) {
                    out.bytes += self.bytes_of(b);
                    if TieredPool::tier_of(b) == HOT {
                        out.hot += 1;
                    } else {
                        out.cold += 1;
                    }
                }
            }
            out.cuts.push((id, table, release, victims.len()));
        }
        Ok(out)
    }

    /// Drops what [`idle_cuts`](Self::idle_cuts) chose and releases it.
    fn apply_idle_cuts(&mut self, idle: IdleCuts) -> Result<()> {
        for (id, table, release, victims) in idle.cuts {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.table = table;
            }
            self.counters.evicted_entries += victims as u64;
            self.counters.evicted_idle_entries += victims as u64;
            self.release_all(&release)?;
        }
        Ok(())
    }

    /// Checks a per-lane policy's answer (`lanes × d` entries, each lane's
    /// ascending, each a full, closed hot block) and works out the pack:
    /// the union of the named entries, and for each of its first
    /// `union − d` entries the block each lane's page comes from (the
    /// lane's k-th surviving page).
    fn lane_packing(&self, table: &BlockTable, drops: &[usize]) -> Result<Option<Packing>> {
        let lanes = self.lanes;
        if drops.is_empty() {
            return Ok(None);
        }
        let bad = |m: String| Err(CoordError::Policy(format!("the eviction policy {m}")));
        if drops.len() % lanes != 0 {
            return bad(format!(
                "named {} lane pages, not a multiple of {lanes} lanes",
                drops.len()
            ));
        }
        let d = drops.len() / lanes;
        let last = table.entries().len().wrapping_sub(1);
        let mut union: Vec<usize> = drops.to_vec();
        union.sort_unstable();
        union.dedup();
        let mut blocks = Vec::with_capacity(union.len());
        for &i in &union {
            match table.entries().get(i) {
                Some(e)
                    if e.tokens() == table.block_size()
                        && !(table.is_open() && i == last)
                        && matches!(e.slot(), Slot::Hot(_)) =>
                {
                    blocks.extend(e.slot().block());
                }
                _ => {
                    return bad(format!(
                        "named entry {i}, which is not a full, closed hot block"
                    ));
                }
            }
        }
        let keep = union.len() - d;
        // In place when nothing else can see the blocks: no other holder
        // (a prefix hit, a turn snapshot) and no index that could have
        // registered them.
        let in_place = self.index.is_none()
            && blocks
                .iter()
                .all(|&b| self.tiers.ref_count(b).is_ok_and(|c| c == 1));
        let written = if in_place { union.len() } else { keep };
        let mut src = vec![BlockId::new(0, 0); written * lanes];
        for (lane, victims) in drops.chunks_exact(d).enumerate() {
            if !victims.windows(2).all(|w| w[0] < w[1]) {
                return bad(format!(
                    "named lane {lane}'s entries out of order: {victims:?}"
                ));
            }
            // Survivors first, then (in place) the victims.
            let mut v = victims.iter().peekable();
            let (mut k, mut gone) = (0, keep);
            for (u, &i) in union.iter().enumerate() {
                if v.peek() == Some(&&i) {
                    v.next();
                    if in_place {
                        src[gone * lanes + lane] = blocks[u];
                        gone += 1;
                    }
                } else {
                    src[k * lanes + lane] = blocks[u];
                    k += 1;
                }
            }
        }
        Ok(Some(Packing {
            rw: Rewrite {
                entries: union,
                blocks,
                keep,
                in_place,
            },
            src,
        }))
    }

    /// Drops one reference; notes a cold block whose storage can go.
    fn release_one(&mut self, b: BlockId) -> Result<u32> {
        let left = self.tiers.release(b)?;
        if left == 0 && TieredPool::tier_of(b) != HOT && !self.cached.contains_key(&b) {
            self.freed_cold.push(b);
        }
        Ok(left)
    }

    /// Releases `blocks` tail first, after checking every handle (on error
    /// nothing changed).
    /// Takes one more reference on each of `blocks` (held ones only); on
    /// an error the references taken so far are given back.
    fn retain_all(&mut self, blocks: &[BlockId]) -> Result<()> {
        for (k, &b) in blocks.iter().enumerate() {
            if let Err(e) = self.tiers.retain(b).and_then(|r| match r {
                Retained::Held(_) => Ok(()),
                Retained::Reclaimed => Err(kvforge_pool::PoolError::NotHeld { id: b }),
            }) {
                let _ = self.release_all(&blocks[..k]);
                return Err(e.into());
            }
        }
        Ok(())
    }

    fn release_all(&mut self, blocks: &[BlockId]) -> Result<()> {
        for &b in blocks {
            self.tiers.ref_count(b)?;
        }
        let mut first_err = None;
        for &b in blocks.iter().rev() {
            if let Err(e) = self.release_one(b) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn mark_cached(&mut self, b: BlockRef) -> Result<()> {
        self.tiers.mark_cached(b.block)?;
        let len = self.cached.entry(b.block).or_default();
        *len = (*len).max(b.len);
        Ok(())
    }

    /// Cold blocks released for good since the last call, never cached:
    /// their stored content can be freed.
    pub fn take_freed_cold(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.freed_cold)
    }

    /// The cache forgot reclaimed blocks' content: so do the index and the
    /// deduplicator.
    fn forget_reclaimed(&mut self, reclaimed: &[BlockId]) {
        if reclaimed.is_empty() {
            return;
        }
        if let Some(i) = self.index.as_mut() {
            i.forget_all(reclaimed);
        }
        if let Some(d) = self.dedup.as_mut() {
            for &b in reclaimed {
                d.forget(b);
            }
        }
        self.demoted
            .retain(|h, c| !reclaimed.contains(h) && !reclaimed.contains(c));
        for b in reclaimed {
            self.cached.remove(b);
        }
    }

    /// Whether the deduplicator compares dequantized vectors (fill
    /// [`Content::vector`] for [`share`](Self::share)).
    pub fn share_wants_vectors(&self) -> bool {
        self.dedup.as_ref().is_some_and(|d| d.wants_vectors())
    }

    /// Offers a cold block this step quantized to the deduplicator, which
    /// reads candidates' contents through `stored` (`None`: gone). When it
    /// names a canonical block, the entry becomes an alias of it and the
    /// new block is freed at commit. Returns the canonical block, if any.
    pub fn share(
        &mut self,
        seq: SeqId,
        cold: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>> {
        let r = self.share_call(seq, cold, content, stored);
        self.checked(r)
    }

    fn share_call(
        &mut self,
        seq: SeqId,
        cold: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>> {
        let Some(d) = self.dedup.as_mut() else {
            return Ok(None);
        };
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let Some(p) = s.pending.as_mut().filter(|p| p.fresh_cold.contains(&cold)) else {
            return Err(CoordError::Order {
                seq,
                what: "shared a block this step did not quantize",
            });
        };
        // Its content is written (it is offered): others may read it now.
        p.written.retain(|&(b, _)| b != cold);
        let Some(canonical) = d.offer(cold, content, stored)? else {
            return Ok(None);
        };
        match self.tiers.retain(canonical) {
            Ok(Retained::Held(_)) => {}
            _ => {
                d.forget(canonical);
                return Ok(None);
            }
        }
        let Some(i) = p
            .next
            .entries()
            .iter()
            .position(|e| e.slot() == Slot::Cold(cold))
        else {
            let _ = self.tiers.release(canonical);
            return Ok(None);
        };
        p.next.set_slot(i, Slot::Alias { canonical })?;
        p.taken.push(canonical);
        p.release.push(cold);
        // The entry reads another block's content now (a near duplicate
        // under SimHash): neither the index nor a second holder of the hot
        // block may take the canonical for this block's copy.
        p.demoted.retain(|d| d.1 != cold);
        Ok(Some(canonical))
    }

    /// Feeds the attention mass each entry of [`view`](Self::view) received
    /// in the step to the eviction policy (if it wants it); for a per-lane
    /// policy one value per entry and lane, as for
    /// [`observe_keys`](Self::observe_keys).
    pub fn observe(&mut self, seq: SeqId, mass: &[f32]) -> Result<()> {
        self.feed_policy(seq, mass, false)
    }

    /// Feeds each entry's key novelty (`1 − cos(key, mean key)`, averaged
    /// over its keys, heads and layers) in the step to the eviction policy
    /// (if it wants it). For a per-lane policy ([`per_lane`](Self::per_lane)):
    /// one value per entry and lane, entry after entry, lane `layer ×
    /// kv_heads + head`, averaged over the entry's keys only.
    pub fn observe_keys(&mut self, seq: SeqId, novelty: &[f32]) -> Result<()> {
        self.feed_policy(seq, novelty, true)
    }

    /// [`observe`](Self::observe), or with `keys`
    /// [`observe_keys`](Self::observe_keys): one value per entry of the
    /// step's table.
    fn feed_policy(&mut self, seq: SeqId, values: &[f32], keys: bool) -> Result<()> {
        let Some(ev) = self.evict.as_mut() else {
            return Ok(());
        };
        let s = self.seqs.get(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let t = s.pending.as_ref().map_or(&s.table, |p| &p.next);
        let per_entry = if ev.per_lane() {
            self.lanes
        } else if ev.token_level() {
            t.block_size() as usize
        } else {
            1
        };
        if values.len() != t.entries().len() * per_entry {
            let what = if keys {
                "key novelty for another number of entries"
            } else {
                "attention mass for another number of entries"
            };
            return Err(CoordError::Order { seq, what });
        }
        if keys {
            ev.observe_keys(seq, t, values);
        } else {
            ev.observe(seq, t, values);
        }
        Ok(())
    }

    /// Whether the eviction policy wants key novelty.
    pub fn wants_keys(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.wants_keys())
    }

    /// Whether the eviction policy ranks pages per lane (one layer's one
    /// KV head): it then wants key novelty per entry and lane.
    pub fn per_lane(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.per_lane())
    }

    /// Whether the eviction policy names single tokens: it then wants its
    /// signals per row of the table (`entries × block_size`).
    pub fn token_level(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.token_level())
    }

    /// Whether the eviction policy wants attention mass (per entry and
    /// lane for a [`per_lane`](Self::per_lane) policy).
    pub fn wants_attention(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.wants_attention())
    }

    /// How many of a step's last queries the attention mass should come
    /// from (SnapKV's observation window); 0 for all of them.
    pub fn observation_window(&self) -> usize {
        self.evict.as_ref().map_or(0, |e| e.observation_window())
    }

    /// The step succeeded: the planned table becomes the sequence's,
    /// demoted, dropped and aliased blocks are released, demoted blocks
    /// that the index held now point at their cold copies.
    pub fn commit(&mut self, seq: SeqId) -> Result<()> {
        let r = self.commit_call(seq);
        self.checked(r)
    }

    fn commit_call(&mut self, seq: SeqId) -> Result<()> {
        let p = self.take_pending(seq, "commit without a planned step")?;
        self.counters.steps += 1;
        self.counters.evicted_entries += p.evicted as u64;
        self.counters.demoted_blocks += p.demotions as u64;
        self.counters.packed_blocks += p.packed as u64;
        self.counters.evicted_tokens += p.punched as u64;
        self.counters.compacted_blocks += p.compacted as u64;
        let steps = self.counters.steps;
        let mut moves = Vec::new();
        for &(hot, cold, quantized) in &p.demoted {
            if quantized {
                moves.push((hot, cold));
            }
            self.demoted.insert(hot, cold);
        }
        // A block rewritten in place holds other content now: a cold copy
        // of what it held is not its copy any more.
        for b in &p.rewritten {
            self.demoted.remove(b);
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        s.table = p.next;
        s.table.compact();
        s.last_step = steps;
        if p.copies_tail {
            s.copy_tail = false;
        }
        match s.turn.as_mut() {
            Some(t) => t.relocations.extend(moves),
            None => {
                follow_moves(&mut s.partial, &moves);
                self.relocate(&moves)?;
            }
        }
        let r = self.release_all(&p.release);
        self.prune_demoted();
        r
    }

    /// Points index entries of demoted hot blocks at their cold copies
    /// (those still held), so later requests match the quantized blocks.
    fn relocate(&mut self, moves: &[(BlockId, BlockId)]) -> Result<()> {
        let Some(i) = self.index.as_mut() else {
            return Ok(());
        };
        for &(hot, cold) in moves {
            if self.tiers.ref_count(cold).is_ok_and(|c| c > 0) && i.relocate(hot, cold) {
                self.tiers.mark_cached(cold)?;
                let len = self.cached.get(&hot).copied().unwrap_or(0);
                let l = self.cached.entry(cold).or_default();
                *l = (*l).max(len);
            }
        }
        Ok(())
    }

    /// The step failed: give back what the plan took; table, counts and
    /// index are as they were before [`plan`](Self::plan). An in-place
    /// [`Pack`] the engine carried out is the engine's to undo first.
    pub fn abort(&mut self, seq: SeqId) -> Result<()> {
        let r = self.abort_call(seq);
        self.checked(r)
    }

    fn abort_call(&mut self, seq: SeqId) -> Result<()> {
        let p = self.take_pending(seq, "abort without a planned step")?;
        if let Some(d) = self.dedup.as_mut() {
            for &b in &p.fresh_cold {
                d.forget(b);
            }
        }
        self.release_all(&p.taken)
    }

    /// Stale entries of the demotion map (their hot block's slot was handed
    /// out again) are dropped once the map outgrows the hot tier.
    fn prune_demoted(&mut self) {
        if self.demoted.len() > 2 * self.cfg.hot_blocks.max(64) {
            let tiers = &self.tiers;
            self.demoted
                .retain(|&h, &mut c| tiers.ref_count(h).is_ok() && tiers.ref_count(c).is_ok());
        }
    }

    /// The step in flight of `seq`, taken out; `what` names the call
    /// when there is none.
    fn take_pending(&mut self, seq: SeqId, what: &'static str) -> Result<Pending> {
        self.seq_mut(seq)?
            .pending
            .take()
            .ok_or(CoordError::Order { seq, what })
    }

    /// Errs (naming the call, `what`) while `seq` has a step in flight.
    fn idle(&self, seq: SeqId, what: &'static str) -> Result<()> {
        match self.seq(seq)?.pending {
            Some(_) => Err(CoordError::Order { seq, what }),
            None => Ok(()),
        }
    }

    /// Seals the last block: the next token starts a new one.
    pub fn seal(&mut self, seq: SeqId) -> Result<()> {
        let r = self.seal_call(seq);
        self.checked(r)
    }

    fn seal_call(&mut self, seq: SeqId) -> Result<()> {
        self.idle(seq, "sealed during a step")?;
        self.seq_mut(seq)?.table.seal();
        Ok(())
    }

    /// Registers in the prefix index every entry from the start of `seq`
    /// (hot or cold) up to the first entry whose KV, or the KV after it,
    /// is not that of the plain prefix: an alias (another block's
    /// content), a dropped or holed entry, a packed one. `tokens` are the
    /// tokens whose KV the table holds. The partial last block is handled
    /// as the configured [`TurnTail`] says. Returns the tokens the index
    /// holds for `seq` from its start: fewer than the table when a block
    /// is indexed elsewhere as another sequence's entry (a shared partial
    /// block), whose chain cannot be continued.
    pub fn register(&mut self, seq: SeqId, tokens: &[u32], extra: &ExtraKeys) -> Result<usize> {
        let r = self.register_call(seq, tokens, extra);
        self.checked(r)
    }

    fn register_call(&mut self, seq: SeqId, tokens: &[u32], extra: &ExtraKeys) -> Result<usize> {
        let Some(tail) = self.tail() else {
            return Ok(0);
        };
        self.idle(seq, "registered during a step")?;
        let s = self.seq(seq)?;
        let t = &s.table;
        // Under `Seal` the table is sealed first (once nothing can fail).
        let open = t.is_open() && tail != TurnTail::Seal;
        let done = t.entries().len() - usize::from(open && tail == TurnTail::Skip);
        let mut refs = Vec::with_capacity(done);
        let mut covered = 0usize;
        for e in &t.entries()[..done] {
            match e.slot() {
                // A packed block holds pages of other positions; KV after
                // a hole was computed without the rows evicted.
                Slot::Hot(_) | Slot::Cold(_) if e.is_packed() || e.holes() != 0 => break,
                Slot::Hot(b) | Slot::Cold(b) => refs.push(BlockRef::new(b, e.tokens())),
                Slot::Alias { .. } | Slot::Dropped => break,
            }
            covered += e.tokens() as usize;
        }
        if covered > tokens.len() {
            return Err(CoordError::Order {
                seq,
                what: "registered with fewer tokens than the table holds",
            });
        }
        let registered_open = open && tail == TurnTail::Copy && refs.len() == done;
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        if tail == TurnTail::Seal {
            s.table.seal();
        }
        // The turn so far succeeded: its demotions' index moves apply now,
        // so the chain below is found under the handles the table holds.
        let moves = s
            .turn
            .as_mut()
            .map(|t| std::mem::take(&mut t.relocations))
            .unwrap_or_default();
        follow_moves(&mut s.partial, &moves);
        let before = s.partial.take();
        let k = s.indexed.min(refs.len());
        self.relocate(&moves)?;
        let Some(index) = self.index.as_mut() else {
            return Ok(0);
        };
        // The block registered open last time holds more tokens now: its
        // shorter entry gives way to the longer one.
        if let Some(b) = before {
            if refs.iter().any(|r| r.block == b) {
                index.forget(b);
            }
        }
        // Only what is new, below the last entry registered before (if the
        // index still holds it there); else from the start.
        let done_tokens: usize = refs[..k].iter().map(|r| r.len as usize).sum();
        let extended = match k {
            0 => None,
            _ => index.extend(
                refs[k - 1],
                done_tokens,
                &tokens[done_tokens..covered],
                &refs[k..],
            )?,
        };
        let (start, out) = match extended {
            Some(out) => (k, out),
            None => (0, index.insert(&tokens[..covered], extra, &refs)?),
        };
        // The index follows the chain through blocks it already holds (ours
        // or another sequence's copy of the same content), adds ours after
        // them, and stops at the first it refuses: only that far is the
        // chain ours to continue.
        let first_new = start + out.already_cached;
        let chained = first_new + out.new;
        for &r in &refs[first_new..chained] {
            self.mark_cached(r)?;
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let last_open = registered_open && chained == refs.len();
        s.indexed = chained - usize::from(last_open);
        s.partial = last_open.then(|| refs[chained - 1].block);
        Ok(refs[..chained].iter().map(|r| r.len as usize).sum())
    }

    /// A new sequence that reads what `seq` holds: the same entries with
    /// a reference of its own on every block (nothing is copied). Its
    /// first step copies a partial last block into a block of its own, so
    /// the two never write into one block. `seq` must be between steps.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let r = self.fork_call(seq);
        self.checked(r)
    }

    fn fork_call(&mut self, seq: SeqId) -> Result<SeqId> {
        self.idle(seq, "forked during a step")?;
        let mut table = self.seq(seq)?.table.clone();
        let held: Vec<BlockId> = table.held().collect();
        self.retain_all(&held)?;
        let bs = self.block_size() as u32;
        let partial = table.entries().last().is_some_and(|e| e.tokens() < bs);
        table.seal();
        let id = self.open_empty();
        let s = self.seq_mut(id)?;
        s.table = table;
        s.copy_tail = partial;
        Ok(id)
    }

    /// Starts a turn: the table is kept, with references of its own, so
    /// that [`rollback_turn`](Self::rollback_turn) can restore it after
    /// the turn's steps demoted or dropped entries.
    pub fn begin_turn(&mut self, seq: SeqId) -> Result<()> {
        let r = self.begin_turn_call(seq);
        self.checked(r)
    }

    fn begin_turn_call(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?;
        if s.turn.is_some() || s.pending.is_some() {
            return Err(CoordError::Order {
                seq,
                what: "a turn is already in progress",
            });
        }
        let turn = Turn {
            table: s.table.clone(),
            copy_tail: s.copy_tail,
            partial: s.partial,
            indexed: s.indexed,
            relocations: Vec::new(),
        };
        let held: Vec<BlockId> = turn.table.held().collect();
        self.retain_all(&held)?;
        self.seq_mut(seq)?.turn = Some(turn);
        Ok(())
    }

    /// The turn succeeded: its snapshot is let go; the lifecycle (if any)
    /// labels the segments and frees what it reclaims. Returns the entries
    /// dropped. [`end_turn_labelled`](Self::end_turn_labelled) with the
    /// turn as one segment and no labels from the model.
    pub fn end_turn(&mut self, seq: SeqId) -> Result<usize> {
        let t = TurnInput::default();
        self.end_turn_labelled(seq, &t).map(|r| r.dropped_entries)
    }

    /// The turn succeeded: its snapshot is let go; the lifecycle (if any)
    /// cuts the turn into segments at `t.cuts`, labels the live segments
    /// (with the model's labels `t.model`), queues, revives and frees
    /// segments. The entries lying wholly inside freed segments are
    /// dropped and their blocks released; segments to summarise come back
    /// in the report (answer with
    /// [`compressed`](Self::compressed)).
    pub fn end_turn_labelled(&mut self, seq: SeqId, t: &TurnInput) -> Result<TurnLifecycle> {
        let r = self.end_turn_labelled_call(seq, t);
        self.checked(r)
    }

    fn end_turn_labelled_call(&mut self, seq: SeqId, t: &TurnInput) -> Result<TurnLifecycle> {
        self.idle(seq, "turn ended during a step")?;
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let end = s.table.positions();
        if let Some(mut turn) = s.turn.take() {
            follow_moves(&mut s.partial, &turn.relocations);
            self.relocate(&turn.relocations)?;
            self.release_all(&turn.table.clear())?;
        }
        let Some(lc) = self.lifecycle.as_mut() else {
            return Ok(TurnLifecycle::default());
        };
        let outcome = lc.end_turn(
            seq,
            TurnEnd {
                end,
                cuts: &t.cuts,
                tokens: &t.tokens,
                stop: &t.stop,
                refer: t.refer.clone(),
                model: t.model.as_deref(),
            },
        );
        let c = &mut self.counters;
        c.lifecycle_queued += u64::from(outcome.queued);
        c.lifecycle_revived += u64::from(outcome.revived);
        c.lifecycle_reclaimed += u64::from(outcome.reclaimed);
        c.lifecycle_fallbacks += u64::from(outcome.fallback);
        // Everything freed so far: an entry straddling two segments freed at
        // different turns is inside the union, not inside either one.
        let dropped = if outcome.reclaim.is_empty() {
            0
        } else {
            let freed = lc.freed(seq);
            self.drop_ranges(seq, &freed)?
        };
        Ok(TurnLifecycle {
            dropped_entries: dropped,
            outcome,
        })
    }

    /// A segment [`end_turn_labelled`](Self::end_turn_labelled) handed out
    /// for summarising was replaced (`replaced`: its entries are dropped
    /// now, its blocks released) or not (it is kept for good). Returns the
    /// entries dropped. A segment that was not handed out (or was answered
    /// already) is refused, and nothing changes.
    pub fn compressed(&mut self, seq: SeqId, seg: Segment, replaced: bool) -> Result<usize> {
        let r = self.compressed_call(seq, seg, replaced);
        self.checked(r)
    }

    fn compressed_call(&mut self, seq: SeqId, seg: Segment, replaced: bool) -> Result<usize> {
        self.idle(seq, "compressed during a step")?;
        let Some(lc) = self.lifecycle.as_mut() else {
            return Err(CoordError::Order {
                seq,
                what: "compressed a segment without a lifecycle (none was handed out)",
            });
        };
        lc.compressed(seq, seg, replaced)?;
        if !replaced {
            return Ok(0);
        }
        let freed = lc.freed(seq);
        self.counters.lifecycle_compressed += 1;
        self.drop_ranges(seq, &freed)
    }

    /// Drops the live entries of `seq` lying wholly inside `ranges` (not
    /// an open last block, not packed ones: those hold pages of other
    /// positions, eviction's to drop) and releases their blocks.
    fn drop_ranges(&mut self, seq: SeqId, ranges: &[Range<u64>]) -> Result<usize> {
        if ranges.is_empty() {
            return Ok(0);
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let last = s.table.entries().len().wrapping_sub(1);
        let open = s.table.is_open();
        let mut release = Vec::new();
        for i in 0..s.table.entries().len() {
            let e = s.table.entries()[i];
            let inside = ranges
                .iter()
                .any(|r| r.start <= e.first() && e.end() <= r.end);
            if inside && e.slot().is_live() && !e.is_packed() && !(open && i == last) {
                release.extend(s.table.set_slot(i, Slot::Dropped)?.block());
            }
        }
        s.table.compact();
        let dropped = release.len();
        self.counters.lifecycle_dropped_entries += dropped as u64;
        self.release_all(&release)?;
        Ok(dropped)
    }

    /// The turn failed: any step in flight is aborted and the table is
    /// restored to the turn's start, with the same blocks. If others may
    /// read rows the turn wrote into the open last block (a fork, a prefix
    /// hit, the index), that block comes back sealed and the next step
    /// copies its tokens into a block of the sequence's own, so those rows
    /// are never written again. Without a turn in progress it is refused
    /// and nothing changes.
    pub fn rollback_turn(&mut self, seq: SeqId) -> Result<()> {
        let r = self.rollback_turn_call(seq);
        self.checked(r)
    }

    fn rollback_turn_call(&mut self, seq: SeqId) -> Result<()> {
        if self.seq(seq)?.turn.is_none() {
            return Err(CoordError::Order {
                seq,
                what: "rollback without a turn in progress",
            });
        }
        if self.seq(seq)?.pending.is_some() {
            self.abort(seq)?;
        }
        let s = self.seq_mut(seq)?;
        let Some(turn) = s.turn.take() else {
            return Err(CoordError::UnknownSeq(seq));
        };
        let mut now = std::mem::replace(&mut s.table, turn.table);
        s.copy_tail = turn.copy_tail;
        s.partial = turn.partial;
        s.indexed = turn.indexed;
        let open = match s.table.entries().last() {
            Some(e) if s.table.is_open() => e.slot().block().map(|b| (b, e.tokens())),
            _ => None,
        };
        self.release_all(&now.clear())?;
        if let Some((b, len)) = open {
            // Its rows after the snapshot's are written again: a cold copy
            // of the turn's content is not its copy.
            self.demoted.remove(&b);
            if self.reads_past(seq, b, len) {
                let s = self.seq_mut(seq)?;
                s.table.seal();
                s.copy_tail = true;
            }
        }
        Ok(())
    }

    /// Whether anyone but `seq` may read rows of hot block `b` from row
    /// `len` on: the index (it was given more tokens of `b`), or another
    /// sequence's table, turn snapshot or planned table listing `b` with
    /// more tokens.
    fn reads_past(&self, seq: SeqId, b: BlockId, len: u32) -> bool {
        let past = |t: &BlockTable| {
            t.entries()
                .iter()
                .any(|e| e.slot().block() == Some(b) && e.tokens() > len)
        };
        self.cached.get(&b).is_some_and(|&l| l > len)
            || self
                .seqs
                .iter()
                .filter(|(id, _)| **id != seq)
                .any(|(_, o)| {
                    past(&o.table)
                        || o.turn.as_ref().is_some_and(|t| past(&t.table))
                        || o.pending.as_ref().is_some_and(|p| past(&p.next))
                })
    }

    /// Ends a sequence: aborts a step in flight, rolls back a turn in
    /// progress, releases its blocks (cached ones stay matchable).
    pub fn close(&mut self, seq: SeqId) -> Result<()> {
        let r = self.close_call(seq);
        self.checked(r)
    }

    fn close_call(&mut self, seq: SeqId) -> Result<()> {
        if self.seq(seq)?.turn.is_some() {
            self.rollback_turn(seq)?;
        } else if self.seq(seq)?.pending.is_some() {
            self.abort(seq)?;
        }
        let mut s = self.seqs.remove(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        self.release_all(&s.table.clear())?;
        if let Some(e) = self.evict.as_mut() {
            e.forget(seq);
        }
        if let Some(l) = self.lifecycle.as_mut() {
            l.forget(seq);
        }
        Ok(())
    }
}

/// What a turn end gives the lifecycle besides the positions.
#[derive(Clone, Debug, Default)]
pub struct TurnInput {
    /// Positions where a segment of the turn starts (none: one segment).
    pub cuts: Vec<u64>,
    /// The sequence's token ids by position (for revival; empty: none).
    pub tokens: Vec<u32>,
    /// Ids that never count towards a reference (template tokens).
    pub stop: Vec<u32>,
    /// Positions whose tokens can refer to a pending segment (the user's
    /// message; `None`: the whole turn).
    pub refer: Option<Range<u64>>,
    /// The model's labels for the turn's segments (`None`: missing or
    /// unusable, or not asked).
    pub model: Option<Vec<Label>>,
}

/// What the lifecycle did at a turn end.
#[derive(Clone, Debug, Default)]
pub struct TurnLifecycle {
    /// Entries dropped (blocks released).
    pub dropped_entries: usize,
    /// The lifecycle's decisions.
    pub outcome: Outcome,
}

/// The configured lifecycle.
fn lifecycle_from(cfg: LifecycleConfig) -> Result<Lifecycle> {
    Ok(match cfg {
        LifecycleConfig::RecentTurns { keep } => Lifecycle::new(
            Box::new(RecentTurns::new(keep)?),
            LifecycleParams {
                delay: 0,
                min_match: 0,
                compress_min: None,
            },
        )?,
        LifecycleConfig::Labels {
            source,
            protect,
            delay,
            min_match,
            compress_min,
        } => {
            let rule = RuleFallback::new(protect, compress_min.unwrap_or(u64::MAX))?;
            let policy: Box<dyn LifecyclePolicy> = match source {
                LabelSource::Rule => Box::new(rule),
                s => Box::new(ModelLabels::new(s, rule)?),
            };
            Lifecycle::new(
                policy,
                LifecycleParams {
                    delay,
                    min_match,
                    compress_min,
                },
            )?
        }
    })
}

/// The partial block a sequence registered moved to its cold copy: its
/// index entry moves with it.
fn follow_moves(partial: &mut Option<BlockId>, moves: &[(BlockId, BlockId)]) {
    if let Some(p) = *partial {
        if let Some(&(_, cold)) = moves.iter().find(|&&(hot, _)| hot == p) {
            *partial = Some(cold);
        }
    }
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("sequences", &self.seqs.len())
            .field("budget", &self.budget)
            .field("in_use_bytes", &self.tiers.in_use_bytes())
            .finish()
    }
}
