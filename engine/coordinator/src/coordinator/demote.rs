//! Demotion to the cold tier: the tier policy's answer checked, cold
//! copies remembered and reused, the index moved to them.

use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot};
use kvforge_prefix::PrefixMatcher;

use crate::error::{CoordError, Result};

use super::Coordinator;
use super::draft::{Draft, Rewrite};

/// The partial block a sequence registered moved to its cold copy: its
/// index entry moves with it.
pub(super) fn follow_moves(partial: &mut Option<BlockId>, moves: &[(BlockId, BlockId)]) {
    if let Some(p) = *partial {
        if let Some(&(_, cold)) = moves.iter().find(|&&(hot, _)| hot == p) {
            *partial = Some(cold);
        }
    }
}

impl Coordinator {
    /// The tier policy's demotions for the planned table, checked; each
    /// reuses another holder's cold copy of the same block (held copies
    /// only: reviving a cached one would cost bytes) or is quantized anew.
    pub(super) fn choose_demotions(&self, d: &mut Draft) -> Result<()> {
        for (i, hot) in self.demotions(&d.next, d.rewrite())? {
            match self.demoted.get(&hot) {
                Some(&c) if self.tiers.ref_count(c).is_ok_and(|k| k > 0) => {
                    d.reuse.push((i, hot, c));
                }
                _ => d.fresh.push((i, hot)),
            }
        }
        Ok(())
    }

    /// The tier policy's answer for `next`, checked: given (not an
    /// error), strictly ascending entries, each a full, closed hot block without holes. Entries a
    /// head-wise pack or a compaction rewrites this step stay hot.
    pub(super) fn demotions(
        &self,
        next: &BlockTable,
        rewrite: Option<&Rewrite>,
    ) -> Result<Vec<(usize, BlockId)>> {
        let Some(tp) = self.tier_policy.as_ref() else {
            return Ok(Vec::new());
        };
        let mut demote = Vec::new();
        tp.demote(next, &mut demote);
        if let Some(why) = tp.take_error() {
            return Err(CoordError::Policy(format!("the tier policy failed: {why}")));
        }
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

    /// Points index entries of demoted hot blocks at their cold copies
    /// (those still held), so later requests match the quantized blocks.
    pub(super) fn relocate(&mut self, moves: &[(BlockId, BlockId)]) -> Result<()> {
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

    /// Stale entries of the demotion map (their hot block's slot was handed
    /// out again) are dropped once the map outgrows the hot tier.
    pub(super) fn prune_demoted(&mut self) {
        if self.demoted.len() > 2 * self.cfg.hot_blocks.max(64) {
            let tiers = &self.tiers;
            self.demoted
                .retain(|&h, &mut c| tiers.ref_count(h).is_ok() && tiers.ref_count(c).is_ok());
        }
    }
}
