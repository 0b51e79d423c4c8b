//! The one error type of `kvforge-pool`.

use crate::BlockId;

/// Everything that can go wrong when building or using a pool.
///
/// Running out of blocks is *not* an error (see
/// [`BlockAllocator::allocate`](crate::BlockAllocator::allocate)); these are
/// invalid arguments and broken contracts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A layout dimension (layers, heads, head dim, block size, group size) is zero.
    #[error("KV layout: `{field}` must be greater than zero")]
    ZeroDimension {
        /// The offending field.
        field: &'static str,
    },
    /// A quantized format's group size does not divide the elements of one
    /// K (or V) slab of a block.
    #[error(
        "KV layout: group size {group_size} does not divide the {elements} elements of a block's K or V slab"
    )]
    GroupSize {
        /// The requested group size.
        group_size: u32,
        /// `block_size * kv_heads * head_dim`.
        elements: u64,
    },
    /// The byte size of a block (or of the pool) does not fit in 64 bits.
    #[error("KV layout: {what} overflows 64-bit byte counts")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A pool configuration that cannot work.
    #[error("pool config: {reason}")]
    InvalidConfig {
        /// Why.
        reason: String,
    },
    /// The handle's index is past the pool's capacity.
    #[error("block {id} does not exist (pool capacity is {capacity} blocks)")]
    UnknownBlock {
        /// The handle.
        id: BlockId,
        /// Blocks that exist.
        capacity: usize,
    },
    /// The handle's epoch is not the block's current one: its content was
    /// handed out again (a use after free).
    #[error("block {id} is stale: the slot now holds epoch {current_epoch}")]
    StaleBlock {
        /// The handle.
        id: BlockId,
        /// The slot's current epoch.
        current_epoch: u32,
    },
    /// Releasing (or marking) a block whose reference count is zero, or
    /// retaining a free block that was never marked cached.
    #[error("block {id} is not held (reference count is 0)")]
    NotHeld {
        /// The handle.
        id: BlockId,
    },
    /// A block-table change that would break its invariants.
    #[error("block table: {reason}")]
    InvalidTable {
        /// Why.
        reason: String,
    },
    /// A tier that does not exist, or a handle of another tier.
    #[error("tier {tier} does not exist ({tiers} tiers)")]
    UnknownTier {
        /// The tier named.
        tier: usize,
        /// Tiers that exist.
        tiers: usize,
    },
    /// More references than the counter can hold.
    #[error("block {id}: reference count would overflow")]
    RefCountOverflow {
        /// The handle.
        id: BlockId,
    },
}

/// `Result` with [`PoolError`].
pub type Result<T, E = PoolError> = std::result::Result<T, E>;
