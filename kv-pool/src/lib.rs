//! Fixed-size KV-cache blocks: ids, reference counts, free lists and bytes.
//!
//! This crate is the bottom layer of kvforge. It owns *metadata only*: which
//! block ids exist, who holds them, which free blocks still carry reusable
//! (prefix-cached) content, and how many bytes that is for a given model
//! layout. The tensors live in the engine; a prefix index, an eviction policy
//! or another engine can use this crate without libtorch.
//!
//! # Key design decisions
//!
//! * **Generational block ids.** A [`BlockId`] is a slot index plus an
//!   *epoch* that changes every time the slot is handed out with new content.
//!   A handle that outlives its content (a double free after reuse, a prefix
//!   index entry for a block that was reclaimed) is detected instead of
//!   silently touching somebody else's KV.
//! * **Lazy reclamation.** A block whose count falls to zero keeps its content
//!   if it was [marked cached](BlockAllocator::mark_cached): it stays
//!   matchable and can be [retained](BlockAllocator::retain) again until the
//!   pool needs it for a new allocation. Never-cached free blocks are handed
//!   out first; cached ones are reclaimed least recently released first, with
//!   a second chance for blocks retained while queued (CLOCK).
//! * **Running out is an outcome.** [`BlockAllocator::allocate`] returns
//!   `None` when `n` blocks cannot be had; it never hands out part of a
//!   request. Broken contracts (releasing a block that is not held, a stale
//!   handle) are [`PoolError`]s.
//!
//! # Invariants
//!
//! * A block is either free (count 0) or referenced (count > 0), never both;
//!   counts never underflow.
//! * A block with count > 0 is never handed out by `allocate`.
//! * Blocks never move: growth adds whole batches and existing ids stay valid.
//! * An epoch never repeats: a slot whose content reached the last epoch
//!   (`u32::MAX`) is retired when freed instead of wrapping to 0, so a stale
//!   handle can never equal a live one.
//! * `allocate` returns `None` only when the pool is at its cap and its free
//!   blocks, cached or not, that no other call has already claimed are too
//!   few; growth adds only the batches a reservation's shortfall needs.
//! * `stats().in_use_bytes == stats().in_use * layout.block_bytes()` exactly.
//!
//! # Origin
//!
//! vLLM v1 `BlockPool` (free queue, lazy eviction of cached blocks, tail-first
//! release) and SGLang's token-to-KV allocator (`alloc(n)` returning `None`),
//! with generational indices in the style of `slotmap`.

#![deny(missing_docs)]

mod error;
mod layout;
mod pool;
mod sync;
mod table;
pub mod testing;
mod tiers;

pub use error::{PoolError, Result};
pub use layout::{KvLayout, StorageFormat};
pub use pool::{BlockPool, MAX_REF_COUNT, PoolConfig};
pub use table::{BlockTable, Entry, MAX_HOLED_BLOCK, Slot};
pub use tiers::{MAX_TIER_BLOCKS, MAX_TIERS, TIER_BITS, TieredPool};

use std::fmt;

/// A handle to one fixed-size KV block: slot index plus content epoch.
///
/// Two handles with the same [`index`](BlockId::index) but different epochs
/// name different *contents* of the same physical block; only the newest is
/// valid. The engine addresses its tensors with `index()`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u64);

impl BlockId {
    /// Builds a handle from a slot index and an epoch.
    pub const fn new(index: u32, epoch: u32) -> Self {
        BlockId(((epoch as u64) << 32) | index as u64)
    }

    /// The physical slot: stable for the life of the pool.
    pub const fn index(self) -> u32 {
        self.0 as u32
    }

    /// The content epoch: bumped each time the slot is handed out again.
    pub const fn epoch(self) -> u32 {
        (self.0 >> 32) as u32
    }

    /// The raw 64-bit representation (`epoch << 32 | index`).
    pub const fn to_bits(self) -> u64 {
        self.0
    }

    /// Inverse of [`to_bits`](BlockId::to_bits).
    pub const fn from_bits(bits: u64) -> Self {
        BlockId(bits)
    }
}

impl fmt::Debug for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockId({}@{})", self.index(), self.epoch())
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.index(), self.epoch())
    }
}

/// Blocks handed out by one [`BlockAllocator::allocate_into`] call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// The new blocks, each with reference count 1 and a fresh epoch.
    pub blocks: Vec<BlockId>,
    /// Old handles of cached blocks whose content was reclaimed to satisfy
    /// this allocation. A prefix index must forget them.
    pub reclaimed: Vec<BlockId>,
}

impl Allocation {
    /// Empties both lists, keeping their capacity.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.reclaimed.clear();
    }
}

/// What [`BlockAllocator::retain`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Retained {
    /// The block is now shared; the new reference count.
    Held(u32),
    /// The handle's content is gone: the block was (or is being) handed out
    /// again. Not an error: a prefix hit can race with reclamation.
    Reclaimed,
}

/// A point-in-time view of an allocator's occupancy.
///
/// Exact when the pool is quiescent. Under concurrent use (for
/// [`BlockPool`]): `capacity`, `in_use`, `cached_free` and `retired` come
/// from one consistent reading of the pool's counters, so
/// `in_use + cached_free + retired <= capacity <= max_blocks` always holds,
/// and `in_use` is off from the number of held blocks by at most the blocks
/// named by calls still in flight: it already counts the blocks an
/// `allocate` or revival has claimed but not yet returned, and still counts
/// a block whose last `release` has not returned. Never a wrapped value,
/// never a whole growth batch that is not yet published.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks that exist now (grows in batches up to `max_blocks`).
    #[cfg_attr(feature = "serde", serde(rename = "capacity_blocks"))]
    pub capacity: usize,
    /// Hard cap on `capacity`.
    pub max_blocks: usize,
    /// Blocks with reference count > 0 (or claimed by an allocation or a
    /// revival in flight).
    #[cfg_attr(feature = "serde", serde(rename = "blocks_in_use"))]
    pub in_use: usize,
    /// Free blocks that still hold reusable cached content (and that no
    /// allocation in flight has claimed).
    #[cfg_attr(feature = "serde", serde(rename = "cached_free_blocks"))]
    pub cached_free: usize,
    /// Slots retired after their last epoch: they exist but are never
    /// handed out again (one per 2^32 reuses of a slot).
    pub retired: usize,
    /// Bytes of one block, from the [`KvLayout`].
    pub block_bytes: u64,
    /// `in_use * block_bytes`.
    #[cfg_attr(feature = "serde", serde(rename = "bytes_in_use"))]
    pub in_use_bytes: u64,
    /// `capacity * block_bytes`: memory actually reserved for KV.
    pub capacity_bytes: u64,
}

impl PoolStats {
    /// Free blocks, cached or not.
    pub fn free(&self) -> usize {
        self.capacity.saturating_sub(self.in_use + self.retired)
    }

    /// Fraction of the hard cap in use, in `[0, 1]`: what a memory watermark
    /// (e.g. 0.9) is compared against.
    pub fn utilization(&self) -> f64 {
        if self.max_blocks == 0 {
            return 0.0;
        }
        self.in_use as f64 / self.max_blocks as f64
    }
}

/// A source of fixed-size KV blocks with shared ownership.
///
/// Implementations must be thread-safe; every method takes `&self`. Run
/// [`testing::check_allocator`] against any implementation.
pub trait BlockAllocator: Send + Sync {
    /// Appends `n` blocks (count 1 each) to `out.blocks`, and the old handles
    /// of any cached blocks it reclaimed to `out.reclaimed`. Returns `false`
    /// and leaves `out` untouched when `n` blocks cannot be had: allocation is
    /// all or nothing.
    fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool;

    /// Adds a reference to a held block, or revives a cached free block.
    ///
    /// Errors: unknown index, a free block that was never marked cached, or a
    /// count overflow. A handle whose content was reclaimed is
    /// [`Retained::Reclaimed`], not an error; a handle whose content is
    /// still there (same epoch, held or cached) is never `Reclaimed`, however
    /// many threads retain it at once.
    fn retain(&self, id: BlockId) -> Result<Retained>;

    /// Drops one reference; returns the remaining count. At zero the block
    /// becomes free (and, if cached, stays reusable until reclaimed).
    ///
    /// Errors: unknown index, stale handle, or a block that is not held.
    fn release(&self, id: BlockId) -> Result<u32>;

    /// Declares that a held block's content is registered in a prefix index,
    /// so it is kept (lazily) after its count reaches zero.
    fn mark_cached(&self, id: BlockId) -> Result<()>;

    /// The current reference count of a valid handle.
    fn ref_count(&self, id: BlockId) -> Result<u32>;

    /// Occupancy and bytes.
    fn stats(&self) -> PoolStats;

    /// Allocates `n` blocks, or `None` when they cannot be had.
    fn allocate(&self, n: usize) -> Option<Allocation> {
        let mut out = Allocation::default();
        self.allocate_into(n, &mut out).then_some(out)
    }

    /// Releases a sequence's blocks **tail first**, so that when they are
    /// cached the tail is reclaimed before the (more reusable) prefix.
    ///
    /// Every handle is checked before any is released: on error nothing has
    /// changed. A block listed `k` times must hold at least `k` references.
    fn release_sequence(&self, blocks: &[BlockId]) -> Result<()> {
        // Check every handle (in sequence order, so the first bad one is
        // named), then that a block listed k times holds k references.
        for &id in blocks {
            self.ref_count(id)?;
        }
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            if (self.ref_count(run[0])? as usize) < run.len() {
                return Err(PoolError::NotHeld { id: run[0] });
            }
        }
        for &id in blocks.iter().rev() {
            self.release(id)?;
        }
        Ok(())
    }
}

/// Forwards every required method through a pointer type.
macro_rules! forward_allocator {
    ($($ptr:ty),*) => {$(
        impl<A: BlockAllocator + ?Sized> BlockAllocator for $ptr {
            fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool {
                (**self).allocate_into(n, out)
            }
            fn retain(&self, id: BlockId) -> Result<Retained> {
                (**self).retain(id)
            }
            fn release(&self, id: BlockId) -> Result<u32> {
                (**self).release(id)
            }
            fn mark_cached(&self, id: BlockId) -> Result<()> {
                (**self).mark_cached(id)
            }
            fn ref_count(&self, id: BlockId) -> Result<u32> {
                (**self).ref_count(id)
            }
            fn stats(&self) -> PoolStats {
                (**self).stats()
            }
        }
    )*};
}

forward_allocator!(&A, Box<A>, std::sync::Arc<A>);

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
