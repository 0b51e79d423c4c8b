//! [`Coordinator`]: block tables of many sequences over tiered pools, with
//! the optional policies, one step at a time. One file per concern:
//!
//! * `construct.rs` — construction from the configuration; the policy setters;
//! * `stats.rs` — occupancy, bytes, counters, statistics;
//! * `step.rs` — a step: `plan` (decide and check, then take in one
//!   place), `commit`, `abort`;
//! * `assemble.rs` — the planned table and the plan from what a step
//!   decided and took;
//! * `evict.rs` — eviction victims, the stepping sequence's and idle ones';
//! * `pack.rs` — head-wise packing and token-level compaction;
//! * `demote.rs` — demotions to the cold tier, cold copies, index moves;
//! * `budget.rs` — bytes per block, bytes however the steps in flight end;
//! * `refs.rs` — every reference taken or given back, what pools reclaim;
//! * `signals.rs` — attention mass and key novelty for eviction, blocks
//!   offered for sharing;
//! * `prefix.rs` — opening on a cached prefix, registering in the index;
//! * `import.rs` — blocks whose KV the engine brings from elsewhere;
//! * `turns.rs` — turns and rollback, forks, the lifecycle, closing;
//! * `invariants.rs` — every invariant, checked on the whole state.

use std::collections::{BTreeMap, HashMap};

use kvforge_evict::EvictionPolicy;
use kvforge_lifecycle::Lifecycle;
use kvforge_lsh::Deduplicator;
use kvforge_pool::{BlockId, BlockTable, TieredPool};
use kvforge_prefix::PrefixMatcher;
use kvforge_quant::TierPolicy;

use crate::config::{CoordinatorConfig, TurnTail};
use crate::error::{CoordError, Result};

mod assemble;
mod budget;
mod construct;
mod demote;
mod draft;
mod evict;
mod import;
mod invariants;
mod pack;
mod prefix;
mod refs;
mod signals;
mod stats;
mod step;
mod turns;

pub use crate::plan::{Phase, SeqId};
pub use stats::{Counters, TierStats};
pub use turns::{TurnInput, TurnLifecycle};

/// The hot tier's number in the [`TieredPool`].
pub const HOT: usize = 0;

/// The cold tier's number (when there is one).
pub const COLD: usize = 1;

/// What [`Coordinator::open`] found in the prefix index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Opened {
    /// The new sequence.
    pub seq: SeqId,
    /// Leading tokens whose KV it already holds.
    pub reused: usize,
}

struct Pending {
    /// The table after the step (what attention reads during it).
    next: BlockTable,
    /// References taken by the plan (allocations, retains): given back by
    /// an abort, kept by a commit.
    taken: Vec<BlockId>,
    /// References the commit gives back (demoted, dropped, aliased).
    release: Vec<BlockId>,
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
    written: Vec<(BlockId, u32)>,
}

/// A turn in progress: what [`Coordinator::rollback_turn`] restores.
struct Turn {
    /// The table at the start of the turn, holding references of its own.
    table: BlockTable,
    /// The sequence's registration state at the start of the turn.
    copy_tail: bool,
    partial: Option<BlockId>,
    indexed: usize,
    /// Index moves (hot -> its cold copy) of demotions committed during
    /// the turn: applied when the turn ends (or at a registration), dropped
    /// if it is rolled back, so a failed turn leaves the index as it was.
    relocations: Vec<(BlockId, BlockId)>,
}

struct SeqState {
    table: BlockTable,
    pending: Option<Pending>,
    /// The turn in progress, if any.
    turn: Option<Turn>,
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
    /// The eviction policy could not answer about this sequence while it
    /// was idle (asked for another's step): its own next step fails with
    /// these words, not the other's.
    policy_error: Option<String>,
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
    budget: u64,
    tiers: TieredPool,
    index: Option<Box<dyn PrefixMatcher>>,
    /// The index reports its events ([`Coordinator::watch_index`]).
    index_watched: bool,
    tier_policy: Option<Box<dyn TierPolicy>>,
    evict: Option<Box<dyn EvictionPolicy>>,
    dedup: Option<Box<dyn Deduplicator>>,
    lifecycle: Option<Lifecycle>,
    seqs: BTreeMap<SeqId, SeqState>,
    next_seq: SeqId,
    /// Hot block -> the cold block its content was quantized into, so a
    /// second holder of the hot block reuses that copy.
    demoted: HashMap<BlockId, BlockId>,
    /// Blocks marked cached (the index may hand them out: their content
    /// must outlive their last holder and never change), with the most
    /// tokens the index was given for each; and cold blocks whose last
    /// holder let go of them without that: the engine may free their
    /// storage.
    cached: HashMap<BlockId, u32>,
    freed_cold: Vec<BlockId>,
    /// Lanes of a block: layers × KV heads (head-wise eviction).
    lanes: usize,
    /// The most bytes in use right after a plan (blocks a step holds
    /// until its commit included), since the last reset.
    step_peak: u64,
    counters: Counters,
    /// Check every invariant after each public call.
    check: bool,
    /// A failure to inject at this phase of the next plan (tests).
    pub(crate) fail_at: Option<Phase>,
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

impl Coordinator {
    /// Runs [`testing::check_invariants`](crate::testing::check_invariants)
    /// after every public call that changes state, turning a broken
    /// invariant into [`CoordError::Invariant`] (for tests and debugging:
    /// it walks every table).
    pub fn check_every_call(&mut self, on: bool) {
        self.check = on;
    }

    /// Where a plan fails when a test injected a failure there (once).
    fn phase(&mut self, p: Phase) -> Result<()> {
        if self.fail_at == Some(p) {
            self.fail_at = None;
            return Err(CoordError::Injected { phase: p });
        }
        Ok(())
    }

    /// `r`, or the broken invariant when checking is on.
    fn checked<T>(&self, r: Result<T>) -> Result<T> {
        if self.check && r.is_ok() {
            self.invariants().map_err(CoordError::Invariant)?;
        }
        r
    }

    fn seq(&self, id: SeqId) -> Result<&SeqState> {
        self.seqs.get(&id).ok_or(CoordError::UnknownSeq(id))
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut SeqState> {
        self.seqs.get_mut(&id).ok_or(CoordError::UnknownSeq(id))
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
                policy_error: None,
            },
        );
        id
    }

    fn tail(&self) -> Option<TurnTail> {
        self.cfg.prefix.as_ref().map(|p| p.tail)
    }
}
