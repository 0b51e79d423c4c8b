//! Head-wise packing and token-level compaction: which entries a step
//! rewrites and where each lane's page or each live row goes.

use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot};

use crate::error::{CoordError, Result};

use super::Coordinator;
use super::step::Draft;

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

impl Coordinator {
    /// Works out the step's head-wise pack (from a per-lane policy's
    /// answer) or token-level compaction (of the holed entries).
    pub(super) fn pack(&self, d: &mut Draft) -> Result<()> {
        d.packing = self.lane_packing(&d.next, &d.lane_drops)?;
        d.row_packing = self.row_packing(&d.next);
        Ok(())
    }

    /// Token-level eviction's compaction, when the live rows of the holed
    /// entries fit in fewer blocks than they hold: which entries, how many
    /// keep a block, and the order of their rows (in place when nothing
    /// else can see the blocks, as for head-wise packing).
    pub(super) fn row_packing(&self, table: &BlockTable) -> Option<RowPacking> {
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

    /// Checks a per-lane policy's answer (`lanes × d` entries, each lane's
    /// ascending, each a full, closed hot block) and works out the pack:
    /// the union of the named entries, and for each of its first
    /// `union − d` entries the block each lane's page comes from (the
    /// lane's k-th surviving page).
    pub(super) fn lane_packing(
        &self,
        table: &BlockTable,
        drops: &[usize],
    ) -> Result<Option<Packing>> {
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
}
