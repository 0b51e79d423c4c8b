//! The byte budget: bytes per block, and bytes in use however the steps
//! in flight end.

use std::collections::HashMap;

use kvforge_pool::{BlockAllocator, BlockId, TieredPool};

use crate::error::Result;
use crate::plan::Lack;

use super::Coordinator;
use super::draft::{Draft, Rewrite};
use super::{COLD, HOT};

impl Coordinator {
    /// Whether the step fits, before anything is taken: the budget holds
    /// between steps, so blocks the step lets go of for good (dropped or
    /// demoted, no other holder) make room — until the commit they are
    /// still held, so a step can exceed it by them. When it does not fit,
    /// idle sequences' cuts are worked out (kept in the draft, applied
    /// only by `take`); then every tier must have room for its blocks.
    /// What runs out, if anything does.
    pub(super) fn fit(&mut self, d: &mut Draft) -> Result<Option<Lack>> {
        let freed: u64 = d
            .release
            .iter()
            .chain(d.rewrite().map_or(&[][..], Rewrite::away))
            .chain(d.copy_src.iter().map(|(b, _)| b))
            .chain(d.fresh.iter().map(|(_, h)| h))
            .chain(d.reuse.iter().map(|(_, h, _)| h))
            .filter(|&&b| self.tiers.ref_count(b).is_ok_and(|c| c == 1))
            .map(|&b| self.bytes_of(b))
            .sum();
        let hot_bytes = self.cfg.layout.block_bytes();
        let cold_bytes = self.cold_layout().map_or(0, |l| l.block_bytes());
        let budget = self.budget;
        let over = |need| Lack::Bytes { need, budget };
        let Some(step_bytes) = (d.need_hot as u64)
            .checked_mul(hot_bytes)
            .zip((d.fresh.len() as u64).checked_mul(cold_bytes))
            .and_then(|(h, c)| h.checked_add(c))
        else {
            return Ok(Some(over(u64::MAX)));
        };
        let mut want = self
            .tiers
            .in_use_bytes()
            .saturating_add(step_bytes)
            .saturating_sub(freed);
        // The cold copies the step reuses stay (`take` retains them first).
        if want > self.budget {
            let keep: Vec<BlockId> = d.reuse.iter().map(|&(_, _, c)| c).collect();
            d.idle = self.idle_cuts(d.seq, want, &keep)?;
        }
        want = want.saturating_sub(d.idle.bytes);
        if want > self.budget {
            return Ok(Some(over(want)));
        }
        for (tier, need, cut) in [
            (HOT, d.need_hot, d.idle.hot),
            (COLD, d.fresh.len(), d.idle.cold),
        ] {
            if need == 0 {
                continue;
            }
            let st = self.tiers.tier_stats(tier)?;
            let free = st.max_blocks.saturating_sub(st.in_use + st.retired) + cut;
            if need > free {
                return Ok(Some(Lack::Blocks {
                    tier,
                    need,
                    free,
                    capacity: st.max_blocks,
                }));
            }
        }
        Ok(None)
    }

    /// Bytes in use however the steps in flight end: each one, committed,
    /// gives back the blocks it releases and, aborted, those it took —
    /// counted only where it is their only holder. What an
    /// [`open`](Self::open) may not push over the budget.
    pub(super) fn worst_bytes(&self) -> u64 {
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
    pub(super) fn bytes_of(&self, b: BlockId) -> u64 {
        self.tiers
            .layout(TieredPool::tier_of(b))
            .map_or(0, |l| l.block_bytes())
    }
}
