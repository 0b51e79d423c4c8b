//! Reference bookkeeping: every reference the coordinator takes or gives
//! back goes through here, and so does what the pools reclaim.

use kvforge_pool::{Allocation, BlockAllocator, BlockId, Retained, TieredPool};
use kvforge_prefix::{BlockRef, PrefixMatcher};

use crate::error::{CoordError, Result};

use super::{Coordinator, HOT};

impl Coordinator {
    /// Drops one reference; notes a cold block whose storage can go.
    pub(super) fn release_one(&mut self, b: BlockId) -> Result<u32> {
        let left = self.tiers.release(b)?;
        if left == 0 && TieredPool::tier_of(b) != HOT && !self.cached.contains_key(&b) {
            self.freed_cold.push(b);
        }
        Ok(left)
    }

    /// Takes one more reference on each of `blocks` (held ones only); on
    /// an error the references taken so far are given back.
    pub(super) fn retain_all(&mut self, blocks: &[BlockId]) -> Result<()> {
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

    /// Releases `blocks` tail first, after checking every handle (on error
    /// nothing changed).
    pub(super) fn release_all(&mut self, blocks: &[BlockId]) -> Result<()> {
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

    /// Marks `b` cached (the index holds it), remembering the most tokens
    /// the index was given of it.
    pub(super) fn mark_cached(&mut self, b: BlockRef) -> Result<()> {
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
    pub(super) fn forget_reclaimed(&mut self, reclaimed: &[BlockId]) {
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

    /// `n` fresh blocks of `tier`, each pushed to `taken`; the index and
    /// the deduplicator forget the cached blocks reclaimed for them, and a
    /// report of a freed cold block whose slot is handed out again is
    /// withdrawn (the engine stores and frees cold content by slot: the
    /// report would free the new block's content).
    pub(super) fn allocate(
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
            return Err(CoordError::Invariant(format!(
                "{n} blocks of tier {tier} were counted free and are not"
            )));
        }
        taken.extend_from_slice(&got.blocks);
        self.forget_reclaimed(&got.reclaimed);
        if tier != HOT && !self.freed_cold.is_empty() {
            // The same tier's slot (`index` keeps the tier bits): a hot
            // block of the same local slot number is another block.
            self.freed_cold
                .retain(|f| got.blocks.iter().all(|b| b.index() != f.index()));
        }
        Ok(got.blocks)
    }
}
