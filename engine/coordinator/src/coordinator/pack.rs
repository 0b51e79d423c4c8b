//! Head-wise packing and token-level compaction: which entries a step
//! rewrites and where each lane's page or each live row goes.

use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot};

use crate::error::{CoordError, Result};

use super::Coordinator;
use super::draft::{Draft, Packing, Rewrite, RowPacking};

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
