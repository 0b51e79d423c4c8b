//! [`BlockPool`]: the lock-free, growable, reference-counted block pool.
//!
//! Each block is one `AtomicU64` packing its whole state, so every transition
//! is a single compare-and-swap:
//!
//! ```text
//!  63          32   31      30     29      28       27       26          0
//! +--------------+--------+------+------+---------+-------+-------------+
//! |    epoch     |TOUCHED |QUEUED|CACHED|REVIVING |RETIRED|  ref count  |
//! +--------------+--------+------+------+---------+-------+-------------+
//! ```
//!
//! * `QUEUED`: the index sits in a free list. Set when the count drops to 0
//!   (and the index is pushed), cleared when a popper takes or discards it.
//!   At most one entry per block, so free lists never exceed capacity.
//! * `CACHED`: the content is registered in a prefix index; at count 0 the
//!   block waits in the *evictable* FIFO (crossbeam `SegQueue`, least
//!   recently released first) instead of a *fresh* stack.
//! * `TOUCHED`: a cached block was revived while queued; the popper gives it
//!   a second chance at the tail (CLOCK) instead of reclaiming it.
//! * `REVIVING`: one thread is reviving this cached free block (it owns the
//!   block until it commits or backs off; everyone else waits). So two
//!   revivers of one block never both take a unit of availability for it.
//! * `RETIRED`: the slot used its last epoch (`u32::MAX`) and will never be
//!   handed out again, so an epoch never repeats while a handle may exist.
//!
//! Fresh (never cached) blocks live on intrusive Treiber stacks, one per
//! shard, linked through each slot's `next` field and tagged against ABA;
//! a thread pushes to its home shard and pops from it first, so a single
//! thread's allocate + release pair costs a handful of uncontended CAS.
//!
//! # Availability
//!
//! One `AtomicU64` (`units`) counts the free blocks not yet promised to an
//! allocation or revival, split into *fresh* (low half) and *cached* (high
//! half). A thread *reserves* units with one CAS before it pops, so a pop
//! after a successful reservation always finds a block of that kind
//! (possibly after a short wait for an entry another thread is pushing).
//! Because both kinds sit in one word, "fresh first, then grow, then reclaim
//! cached" is decided on one consistent snapshot, and `allocate` fails only
//! when, at the cap, the unpromised free blocks of both kinds are too few.
//!
//! Growth happens under a lock, only when a reservation finds too few fresh
//! units *under that lock*, and adds the fewest whole batches that cover the
//! shortfall. It publishes in this order: slots, `capacity`, stack entries,
//! units; a sequence counter (`growth_seq`, odd while a batch is being
//! published) lets readers see capacity and units consistently.

mod alloc;
mod config;
mod free;
#[cfg(all(test, not(loom)))]
#[allow(clippy::unwrap_used)]
mod tests;

use std::sync::OnceLock;

pub use config::PoolConfig;

use crate::error::{PoolError, Result};
use crate::layout::KvLayout;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, FreeQueue, Mutex, Ordering, fence};
use crate::{BlockAllocator, BlockId};

const COUNT_MASK: u64 = (1 << 27) - 1;
const RETIRED: u64 = 1 << 27;
const REVIVING: u64 = 1 << 28;
const CACHED: u64 = 1 << 29;
const QUEUED: u64 = 1 << 30;
const TOUCHED: u64 = 1 << 31;
const FLAGS: u64 = RETIRED | REVIVING | CACHED | QUEUED | TOUCHED;

/// The last epoch a slot can hold; its content is retired when freed.
const LAST_EPOCH: u32 = u32::MAX;

/// Most references one block can hold (`2^27 - 1`).
pub const MAX_REF_COUNT: u32 = COUNT_MASK as u32;

#[inline]
const fn count(s: u64) -> u32 {
    (s & COUNT_MASK) as u32
}

#[inline]
const fn epoch(s: u64) -> u32 {
    (s >> 32) as u32
}

/// A taken block's state: count 1, no flags, the given epoch.
#[inline]
const fn taken(epoch: u32) -> u64 {
    ((epoch as u64) << 32) | 1
}

/// `units` packs `cached << 32 | fresh`; each half is at most `u32::MAX`.
#[inline]
const fn unpack(u: u64) -> (usize, usize) {
    ((u as u32) as usize, (u >> 32) as usize)
}

#[inline]
const fn pack(fresh: usize, cached: usize) -> u64 {
    ((cached as u64) << 32) | fresh as u64
}

const ONE_FRESH: u64 = 1;
const ONE_CACHED: u64 = 1 << 32;

/// One block's packed state (see the module docs) and its link in the
/// fresh stack.
struct Slot {
    state: AtomicU64,
    /// Next index in the fresh stack while this block is on it.
    next: AtomicU32,
}

/// End of a fresh stack.
const NIL: u32 = u32::MAX;

/// Fresh-stack shards; threads are spread over them round-robin.
const SHARDS: usize = 4;

/// The segment directory never has more entries than this, so a huge cap
/// costs a small table up front; segments are allocated as growth reaches
/// them.
const MAX_SEGMENTS: usize = 4096;

/// Keeps each shard head on its own cache lines.
#[repr(align(128))]
struct Padded<T>(T);

/// A thread-safe pool of fixed-size KV blocks.
///
/// Allocation and release are lock-free (sharded Treiber stacks for fresh
/// blocks, a crossbeam queue for cached ones, one CAS on the block's state,
/// one on the availability word); only growth takes a lock, once per batch.
pub struct BlockPool {
    layout: KvLayout,
    config: PoolConfig,
    /// Segment `k` holds slots `k << seg_shift ..`; allocated by growth,
    /// never moved or freed.
    segments: Box<[OnceLock<Box<[Slot]>>]>,
    seg_shift: u32,
    capacity: AtomicUsize,
    /// Odd while a growth batch is being published (a sequence lock).
    growth_seq: AtomicUsize,
    retired: AtomicUsize,
    /// The hottest counter: unpromised free blocks, `cached << 32 | fresh`.
    units: Padded<AtomicU64>,
    /// Never-cached free blocks: intrusive Treiber stacks (LIFO keeps
    /// recently used blocks hot), sharded so threads mostly touch their own
    /// head. Each head packs `tag << 32 | index`; the tag defeats ABA.
    fresh: [Padded<AtomicU64>; SHARDS],
    /// Cached free blocks, least recently released first (FIFO).
    evictable: FreeQueue,
    grow_lock: Mutex<()>,
}

impl std::fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPool")
            .field("layout", &self.layout)
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl BlockPool {
    /// Builds a pool; `config` is checked against `layout`.
    pub fn new(layout: KvLayout, config: PoolConfig) -> Result<Self> {
        config.validate(&layout)?;
        let per_segment = config
            .max_blocks
            .div_ceil(MAX_SEGMENTS)
            .next_power_of_two()
            .max(config.growth_batch);
        let segments = config.max_blocks.div_ceil(per_segment);
        let pool = BlockPool {
            layout,
            config,
            segments: (0..segments).map(|_| OnceLock::new()).collect(),
            seg_shift: per_segment.trailing_zeros(),
            capacity: AtomicUsize::new(0),
            growth_seq: AtomicUsize::new(0),
            retired: AtomicUsize::new(0),
            units: Padded(AtomicU64::new(0)),
            fresh: std::array::from_fn(|_| Padded(AtomicU64::new(u64::from(NIL)))),
            evictable: FreeQueue::new(),
            grow_lock: Mutex::new(()),
        };
        if config.initial_blocks > 0 {
            let _guard = pool.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
            pool.add_blocks(config.initial_blocks);
        }
        Ok(pool)
    }

    /// The layout the byte accounting uses.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The (validated) configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Grows, if still needed once the growth lock is held, so that `n`
    /// fresh blocks are unpromised: the fewest whole batches that cover the
    /// shortfall, up to the cap.
    fn grow_for(&self, n: usize) {
        let _guard = self.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
        let (fresh, _) = unpack(self.units.0.load(Ordering::Acquire));
        if fresh < n {
            self.add_blocks(n - fresh);
        }
    }

    /// Adds whole batches (the last one cut at the cap) until at least
    /// `want` blocks were added or the cap is reached. Caller holds the
    /// growth lock.
    fn add_blocks(&self, want: usize) {
        let batch = self.config.growth_batch;
        let mut cap = self.capacity.load(Ordering::Acquire);
        let target = cap
            .saturating_add(want.div_ceil(batch).saturating_mul(batch))
            .min(self.config.max_blocks);
        while cap < target {
            let len = batch.min(self.config.max_blocks - cap);
            self.growth_seq.fetch_add(1, Ordering::AcqRel);
            fence(Ordering::Release);
            let seg = cap >> self.seg_shift;
            let slots = self.segments[seg].get_or_init(|| {
                let start = seg << self.seg_shift;
                let len = (1usize << self.seg_shift).min(self.config.max_blocks - start);
                (0..len)
                    .map(|_| Slot {
                        state: AtomicU64::new(0),
                        next: AtomicU32::new(NIL),
                    })
                    .collect()
            });
            let offset = cap & ((1 << self.seg_shift) - 1);
            for slot in &slots[offset..offset + len] {
                slot.state.store(QUEUED, Ordering::Relaxed);
            }
            let first = cap as u32;
            cap += len;
            // Slots first, then capacity (handles below it are valid), then
            // stack entries, then units (reservable only once poppable).
            self.capacity.store(cap, Ordering::Release);
            for i in (0..len as u32).rev() {
                let index = first + i;
                self.push_fresh(index, index as usize % SHARDS);
            }
            self.units
                .0
                .fetch_add(len as u64 * ONE_FRESH, Ordering::AcqRel);
            self.growth_seq.fetch_add(1, Ordering::Release);
        }
    }

    #[inline]
    fn slot(&self, id: BlockId) -> Result<&Slot> {
        let index = id.index() as usize;
        let capacity = self.capacity.load(Ordering::Acquire);
        if index >= capacity {
            return Err(PoolError::UnknownBlock { id, capacity });
        }
        Ok(self.slot_at(index))
    }

    #[inline]
    fn slot_at(&self, index: usize) -> &Slot {
        let seg = &self.segments[index >> self.seg_shift];
        match seg.get() {
            Some(slots) => &slots[index & ((1 << self.seg_shift) - 1)],
            None => unreachable!("index below capacity lies in an allocated segment"),
        }
    }
}
