//! [`TieredPool`]: several [`BlockPool`]s (hot, and one per cold format)
//! behind one id space.
//!
//! Every storage tier is a pool of its own, with its own [`KvLayout`]: the
//! hot tier in the KV dtype, each cold tier in a quantized format. Their
//! handles are made globally unique by putting the tier number in the top
//! [`TIER_BITS`] bits of the slot index, so a prefix index, a block table or
//! an eviction policy can hold hot and cold blocks side by side and never
//! confuse two of them. A cold block is shared, reference counted, cached
//! and counted in bytes exactly like a hot one.

use crate::error::{PoolError, Result};
use crate::layout::KvLayout;
use crate::pool::{BlockPool, PoolConfig};
use crate::{Allocation, BlockAllocator, BlockId, PoolStats, Retained};

/// Bits of a global slot index that name the tier.
pub const TIER_BITS: u32 = 4;
/// Most tiers a [`TieredPool`] holds.
pub const MAX_TIERS: usize = 1 << TIER_BITS;
const LOCAL_BITS: u32 = 32 - TIER_BITS;
/// Most blocks one tier can hold.
pub const MAX_TIER_BLOCKS: usize = 1 << LOCAL_BITS;

/// Pools of every tier behind one id space. Tier 0 is the hot tier: the
/// [`BlockAllocator`] methods allocate there, and route every other call
/// to the tier named by the handle.
pub struct TieredPool {
    tiers: Vec<BlockPool>,
}

impl TieredPool {
    /// One pool per `(layout, config)`, tier 0 first. Errors: no tier, more
    /// than [`MAX_TIERS`], a tier allowed more than [`MAX_TIER_BLOCKS`]
    /// blocks, or a pool configuration [`BlockPool::new`] refuses.
    pub fn new(tiers: impl IntoIterator<Item = (KvLayout, PoolConfig)>) -> Result<Self> {
        let mut pools = Vec::new();
        for (layout, config) in tiers {
            if pools.len() == MAX_TIERS {
                return Err(PoolError::InvalidConfig {
                    reason: format!("at most {MAX_TIERS} tiers"),
                });
            }
            if config.max_blocks > MAX_TIER_BLOCKS {
                return Err(PoolError::InvalidConfig {
                    reason: format!(
                        "a tier holds at most {MAX_TIER_BLOCKS} blocks, not {}",
                        config.max_blocks
                    ),
                });
            }
            pools.push(BlockPool::new(layout, config)?);
        }
        if pools.is_empty() {
            return Err(PoolError::InvalidConfig {
                reason: "a tiered pool needs at least the hot tier".into(),
            });
        }
        Ok(TieredPool { tiers: pools })
    }

    /// Number of tiers.
    pub fn tiers(&self) -> usize {
        self.tiers.len()
    }

    /// The tier a global handle belongs to.
    pub const fn tier_of(id: BlockId) -> usize {
        (id.index() >> LOCAL_BITS) as usize
    }

    /// The slot of a global handle inside its tier (what the engine
    /// addresses its storage with).
    pub const fn slot_of(id: BlockId) -> u32 {
        id.index() & (MAX_TIER_BLOCKS as u32 - 1)
    }

    fn global(tier: usize, local: BlockId) -> BlockId {
        BlockId::new(((tier as u32) << LOCAL_BITS) | local.index(), local.epoch())
    }

    fn local(id: BlockId) -> BlockId {
        BlockId::new(Self::slot_of(id), id.epoch())
    }

    fn pool(&self, tier: usize) -> Result<&BlockPool> {
        self.tiers.get(tier).ok_or(PoolError::UnknownTier {
            tier,
            tiers: self.tiers.len(),
        })
    }

    /// The pool of one tier.
    pub fn tier(&self, tier: usize) -> Result<&BlockPool> {
        self.pool(tier)
    }

    /// The layout of one tier.
    pub fn layout(&self, tier: usize) -> Result<&KvLayout> {
        Ok(self.pool(tier)?.layout())
    }

    /// Occupancy of one tier.
    pub fn tier_stats(&self, tier: usize) -> Result<PoolStats> {
        Ok(self.pool(tier)?.stats())
    }

    /// Bytes held by blocks in use, all tiers.
    pub fn in_use_bytes(&self) -> u64 {
        self.tiers.iter().map(|p| p.stats().in_use_bytes).sum()
    }

    /// [`BlockAllocator::allocate_into`] in tier `tier`, with global handles.
    pub fn allocate_in(&self, tier: usize, n: usize, out: &mut Allocation) -> Result<bool> {
        let pool = self.pool(tier)?;
        let mut local = Allocation::default();
        if !pool.allocate_into(n, &mut local) {
            return Ok(false);
        }
        out.blocks
            .extend(local.blocks.iter().map(|&b| Self::global(tier, b)));
        out.reclaimed
            .extend(local.reclaimed.iter().map(|&b| Self::global(tier, b)));
        Ok(true)
    }

    fn route(&self, id: BlockId) -> Result<(&BlockPool, BlockId)> {
        Ok((self.pool(Self::tier_of(id))?, Self::local(id)))
    }
}

impl BlockAllocator for TieredPool {
    fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool {
        self.allocate_in(0, n, out).unwrap_or(false)
    }

    fn retain(&self, id: BlockId) -> Result<Retained> {
        let (p, l) = self.route(id)?;
        p.retain(l).map_err(|e| globalize(e, id))
    }

    fn release(&self, id: BlockId) -> Result<u32> {
        let (p, l) = self.route(id)?;
        p.release(l).map_err(|e| globalize(e, id))
    }

    fn mark_cached(&self, id: BlockId) -> Result<()> {
        let (p, l) = self.route(id)?;
        p.mark_cached(l).map_err(|e| globalize(e, id))
    }

    fn ref_count(&self, id: BlockId) -> Result<u32> {
        let (p, l) = self.route(id)?;
        p.ref_count(l).map_err(|e| globalize(e, id))
    }

    /// All tiers added up; `block_bytes` is the hot tier's. Use
    /// [`TieredPool::tier_stats`] for one tier.
    fn stats(&self) -> PoolStats {
        let mut s = self.tiers[0].stats();
        for p in &self.tiers[1..] {
            let t = p.stats();
            s.capacity += t.capacity;
            s.max_blocks += t.max_blocks;
            s.in_use += t.in_use;
            s.cached_free += t.cached_free;
            s.retired += t.retired;
            s.in_use_bytes += t.in_use_bytes;
            s.capacity_bytes += t.capacity_bytes;
        }
        s
    }
}

/// Names the global handle in a tier's error (the tier only knows its own).
fn globalize(e: PoolError, id: BlockId) -> PoolError {
    match e {
        PoolError::UnknownBlock { capacity, .. } => PoolError::UnknownBlock { id, capacity },
        PoolError::StaleBlock { current_epoch, .. } => PoolError::StaleBlock { id, current_epoch },
        PoolError::NotHeld { .. } => PoolError::NotHeld { id },
        PoolError::RefCountOverflow { .. } => PoolError::RefCountOverflow { id },
        other => other,
    }
}
