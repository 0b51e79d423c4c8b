//! Assembling a step: the planned table and the [`Plan`] built from what
//! the phases of [`Coordinator::plan`] decided and took — demotions, a
//! head-wise pack or a compaction, the copy of a shared tail, the writes.

use kvforge_pool::{BlockId, BlockTable, Slot};

use crate::error::{CoordError, Result};
use crate::plan::{CopyOp, Demotion, Pack, Plan, RowPack, Write};

use super::draft::{Draft, holes_from};
use super::{Coordinator, Pending};
use crate::plan::Phase;

impl Coordinator {
    /// Builds the planned table and the plan from what was decided and
    /// taken: demotions, packs or compaction, the copy, the writes.
    pub(super) fn build(&mut self, d: &mut Draft) -> Result<Pending> {
        self.phase(Phase::Build)?;
        let demoted = self.build_demotions(d)?;
        let hot_new = std::mem::take(&mut d.hot_new);
        let mut rest = &hot_new[..];
        let (rewritten, compacted) = self.build_rewrite(d, &mut rest)?;
        d.plan.drops.sort_unstable();
        self.build_writes(d, rest)?;
        let empty = BlockTable::new(d.next.block_size())?;
        Ok(Pending {
            written: written(&d.plan),
            next: std::mem::replace(&mut d.next, empty),
            taken: std::mem::take(&mut d.taken),
            release: std::mem::take(&mut d.release),
            demoted,
            fresh_cold: std::mem::take(&mut d.cold_new),
            copies_tail: d.copy_src.is_some(),
            evicted: d.plan.drops.len(),
            demotions: d.plan.demotions.len(),
            packed: d.plan.pack.as_ref().map_or(0, |p| p.dst.len()),
            punched: d.punched,
            compacted,
            rewritten,
        })
    }

    /// The demotions into the plan and the planned table: reused copies
    /// and fresh ones, in entry order. Returns `(hot, cold, quantized)`
    /// for the commit to remember.
    fn build_demotions(&mut self, d: &mut Draft) -> Result<Vec<(BlockId, BlockId, bool)>> {
        let reused = d.reuse.iter().map(|&(entry, hot, cold)| Demotion {
            entry,
            hot,
            cold,
            quantize: false,
        });
        let quantized = d
            .fresh
            .iter()
            .zip(&d.cold_new)
            .map(|(&(entry, hot), &cold)| Demotion {
                entry,
                hot,
                cold,
                quantize: true,
            });
        d.plan.demotions = reused.chain(quantized).collect();
        d.plan.demotions.sort_by_key(|x| x.entry);
        let mut demoted = Vec::new();
        for x in &d.plan.demotions {
            d.next.set_slot(x.entry, Slot::Cold(x.cold))?;
            d.release.push(x.hot);
            demoted.push((x.hot, x.cold, x.quantize));
        }
        Ok(demoted)
    }

    /// A head-wise pack or a token-level compaction into the plan and the
    /// planned table, its fresh blocks taken from `hot_new`. Returns the
    /// blocks rewritten in place and the blocks compaction gave back.
    fn build_rewrite(
        &mut self,
        d: &mut Draft,
        hot_new: &mut &[BlockId],
    ) -> Result<(Vec<BlockId>, usize)> {
        let bs = self.block_size();
        let mut rewritten = Vec::new();
        // Head-wise eviction: the first `keep` entries of the union take
        // the packed blocks, the others are dropped.
        if let Some(p) = d.packing.take() {
            let rw = &p.rw;
            let dst = rw.apply(
                &mut d.next,
                hot_new,
                |_| None,
                &mut d.release,
                &mut d.plan.drops,
            )?;
            if rw.in_place {
                rewritten.extend_from_slice(&dst);
            }
            if rw.keep > 0 {
                d.plan.pack = Some(Pack {
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
        let Some(p) = d.row_packing.take() else {
            return Ok((rewritten, 0));
        };
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
            &mut d.next,
            hot_new,
            holes,
            &mut d.release,
            &mut d.plan.drops,
        )?;
        if rw.in_place {
            rewritten.extend_from_slice(&dst);
        }
        let mut src = p.order;
        src.truncate(dst.len() * bs);
        d.plan.rows = Some(RowPack {
            block_size: bs as u32,
            dst,
            src,
            in_place: rw.in_place,
        });
        Ok((rewritten, rw.entries.len() - rw.keep))
    }

    /// The copy of a shared partial tail, then the writes: the rest of the
    /// open block, then the new blocks `hot_new`.
    fn build_writes(&mut self, d: &mut Draft, hot_new: &[BlockId]) -> Result<()> {
        let bs = self.block_size();
        let mut hot_new = hot_new;
        if let Some((src, tokens)) = d.copy_src {
            let (&dst, rest) = hot_new
                .split_first()
                .ok_or_else(|| CoordError::Invariant("no block for the copied tail".into()))?;
            hot_new = rest;
            d.next.reopen_tail(dst)?;
            d.release.push(src);
            d.plan.copies.push(CopyOp { src, dst, tokens });
        }
        if d.in_open > 0 {
            if let Some(Slot::Hot(b)) = d.next.entries().last().map(|e| e.slot()) {
                let offset = d.next.entries().last().map_or(0, |e| e.tokens());
                d.plan.writes.push(Write {
                    block: b,
                    offset,
                    tokens: d.in_open as u32,
                });
            }
            d.next.fill(d.in_open as u32)?;
        }
        let mut left = d.n - d.in_open;
        for &b in hot_new {
            let take = left.min(bs);
            d.next.push(Slot::Hot(b), take as u32, take < bs)?;
            d.plan.writes.push(Write {
                block: b,
                offset: 0,
                tokens: take as u32,
            });
            left -= take;
        }
        Ok(())
    }
}

/// Every block the engine writes for `plan` and the first row it writes
/// (rows before it stay): new tokens, copies, packs, compactions, fresh
/// cold copies.
fn written(plan: &Plan) -> Vec<(BlockId, u32)> {
    plan.writes
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
        .collect()
}
