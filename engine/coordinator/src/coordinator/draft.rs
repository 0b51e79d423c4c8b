//! [`Draft`]: a step of one sequence being planned, passed through the
//! phases of [`Coordinator::plan`](super::Coordinator::plan) (`step.rs`
//! runs them: `evict.rs`, `pack.rs`, `demote.rs`, `budget.rs`,
//! `refs.rs`, `assemble.rs`), and the data those phases leave in it. Data
//! only: the phases depend on this file, it depends on none of them.

use kvforge_pool::{BlockId, BlockTable, Slot};

use crate::error::Result;
use crate::plan::Plan;

use super::SeqId;

/// A step being planned: what each phase of [`Coordinator::plan`] decided
/// and, from [`take`](Coordinator::take) on, what it took.
pub(super) struct Draft {
    pub(super) seq: SeqId,
    /// New tokens.
    pub(super) n: usize,
    /// The table after the step.
    pub(super) next: BlockTable,
    pub(super) plan: Plan,
    /// References the commit gives back.
    pub(super) release: Vec<BlockId>,
    /// A per-lane policy's answer (packed by `pack`).
    pub(super) lane_drops: Vec<usize>,
    /// Rows a token-level policy marked invalid.
    pub(super) punched: usize,
    pub(super) packing: Option<Packing>,
    pub(super) row_packing: Option<RowPacking>,
    /// Demotions reusing another holder's cold copy: (entry, hot, cold).
    pub(super) reuse: Vec<(usize, BlockId, BlockId)>,
    /// Demotions quantized anew: (entry, hot).
    pub(super) fresh: Vec<(usize, BlockId)>,
    /// The shared partial tail copied into a block of our own.
    pub(super) copy_src: Option<(BlockId, u32)>,
    /// New tokens that go into the open (or copied) last block.
    pub(super) in_open: usize,
    pub(super) need_hot: usize,
    /// What idle sequences give up for the step.
    pub(super) idle: IdleCuts,
    /// Every reference taken so far: the one thing a failure gives back.
    pub(super) taken: Vec<BlockId>,
    pub(super) cold_new: Vec<BlockId>,
    pub(super) hot_new: Vec<BlockId>,
}

impl Draft {
    /// The entries a head-wise pack or a compaction rewrites (at most one
    /// of them: a policy is per lane, per token or neither).
    pub(super) fn rewrite(&self) -> Option<&Rewrite> {
        self.packing
            .as_ref()
            .map(|p| &p.rw)
            .or(self.row_packing.as_ref().map(|p| &p.rw))
    }
}

/// The hole mask of a block of `bs` rows whose first `live` rows are live.
pub(super) fn holes_from(live: u32, bs: u32) -> u64 {
    let mask = |n: u32| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    mask(bs) & !mask(live)
}

/// The entries a head-wise pack or a token-level compaction rewrites:
/// the first `keep` take the written blocks, the others are dropped.
pub(super) struct Rewrite {
    /// The entries, ascending.
    pub(super) entries: Vec<usize>,
    /// Their blocks.
    pub(super) blocks: Vec<BlockId>,
    /// How many of them keep a (packed) block.
    pub(super) keep: usize,
    /// Permute their own blocks instead of writing fresh ones.
    pub(super) in_place: bool,
}

impl Rewrite {
    /// Fresh hot blocks it writes into.
    pub(super) fn fresh(&self) -> usize {
        if self.in_place { 0 } else { self.keep }
    }

    /// Blocks it lets go of at the commit.
    pub(super) fn away(&self) -> &[BlockId] {
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
    pub(super) fn apply(
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
pub(super) struct RowPacking {
    /// The holed entries; in place, the rows are permuted where they are.
    pub(super) rw: Rewrite,
    /// Their live rows.
    pub(super) live: usize,
    /// Every row of their blocks: the live ones in order, then the holes.
    pub(super) order: Vec<(BlockId, u32)>,
}

/// A head-wise eviction worked out by `lane_packing`.
pub(super) struct Packing {
    /// The entries any lane stops reading; in place, the union's own
    /// blocks are permuted.
    pub(super) rw: Rewrite,
    /// For packed block `k` and lane `l`, at `k × lanes + l`: the block
    /// whose page of lane `l` it takes (in place: for every block of the
    /// union, the dropped pages after the kept ones).
    pub(super) src: Vec<BlockId>,
}

/// Entries idle sequences give up to make room for another's step:
/// chosen by `idle_cuts`, dropped by `apply_idle_cuts`.
#[derive(Default)]
pub(super) struct IdleCuts {
    /// Per sequence: its table with the victims dropped, the blocks it
    /// lets go of, the number of victims.
    pub(super) cuts: Vec<(SeqId, BlockTable, Vec<BlockId>, usize)>,
    /// Bytes, hot and cold blocks that come back for good.
    pub(super) bytes: u64,
    pub(super) hot: usize,
    pub(super) cold: usize,
}
