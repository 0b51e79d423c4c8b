//! The byte budget: bytes per block, and bytes in use however the steps
//! in flight end.

use std::collections::HashMap;

use kvforge_pool::{BlockAllocator, BlockId, TieredPool};

use super::Coordinator;

impl Coordinator {
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
