//! [`PoolConfig`]: how many blocks a pool starts with, grows by, and caps at.

use crate::error::{PoolError, Result};
use crate::layout::KvLayout;

/// How many blocks a pool starts with, how it grows, and its hard cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Blocks created up front (rounded up to a whole growth batch).
    pub initial_blocks: usize,
    /// Blocks added per growth step; a power of two.
    pub growth_batch: usize,
    /// Hard cap: the pool never holds more blocks (the KV memory budget).
    pub max_blocks: usize,
}

impl PoolConfig {
    /// Default growth step, in blocks.
    pub const DEFAULT_GROWTH_BATCH: usize = 64;

    /// A fixed-size pool of `blocks` blocks (no growth).
    pub fn fixed(blocks: usize) -> Self {
        PoolConfig {
            initial_blocks: blocks,
            growth_batch: Self::DEFAULT_GROWTH_BATCH,
            max_blocks: blocks,
        }
    }

    /// The seed's sizing rule: `max_requests × mean_context / block_size`
    /// blocks, plus 20% headroom. The cap starts equal to the initial size;
    /// raise it with [`with_max_blocks`](Self::with_max_blocks) or
    /// [`with_memory_budget`](Self::with_memory_budget).
    pub fn sized_for(
        max_concurrent_requests: usize,
        mean_context_tokens: usize,
        layout: &KvLayout,
    ) -> Result<Self> {
        let tokens = max_concurrent_requests
            .checked_mul(mean_context_tokens)
            .ok_or(PoolError::Overflow {
                what: "requests x context tokens",
            })?;
        let blocks = tokens.div_ceil(layout.block_size() as usize);
        let initial = blocks
            .checked_add(blocks.div_ceil(5))
            .ok_or(PoolError::Overflow {
                what: "blocks + 20% headroom",
            })?;
        Ok(PoolConfig::fixed(initial))
    }

    /// Sets the hard cap in blocks.
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks;
        self
    }

    /// Sets the hard cap from a byte budget: `budget / block_bytes` blocks.
    pub fn with_memory_budget(self, budget_bytes: u64, layout: &KvLayout) -> Self {
        let blocks = budget_bytes / layout.block_bytes();
        self.with_max_blocks(usize::try_from(blocks).unwrap_or(usize::MAX))
    }

    /// Sets the growth step.
    pub fn with_growth_batch(mut self, growth_batch: usize) -> Self {
        self.growth_batch = growth_batch;
        self
    }

    pub(super) fn validate(&self, layout: &KvLayout) -> Result<()> {
        let bad = |reason: String| Err(PoolError::InvalidConfig { reason });
        if self.max_blocks == 0 {
            return bad("max_blocks must be at least 1".into());
        }
        if self.max_blocks > u32::MAX as usize {
            return bad(format!(
                "max_blocks {} exceeds the 2^32 - 1 addressable blocks",
                self.max_blocks
            ));
        }
        if self.initial_blocks > self.max_blocks {
            return bad(format!(
                "initial_blocks {} exceeds max_blocks {}",
                self.initial_blocks, self.max_blocks
            ));
        }
        if !self.growth_batch.is_power_of_two() {
            return bad(format!(
                "growth_batch {} must be a power of two",
                self.growth_batch
            ));
        }
        layout.bytes_for_blocks(self.max_blocks as u64)?;
        Ok(())
    }
}
