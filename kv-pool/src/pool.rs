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

use std::sync::OnceLock;

use crate::error::{PoolError, Result};
use crate::layout::KvLayout;
use crate::sync::{
    AtomicU32, AtomicU64, AtomicUsize, FreeQueue, Mutex, Ordering, fence, spin_wait,
};
use crate::{Allocation, BlockAllocator, BlockId, PoolStats, Retained};

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

    fn validate(&self, layout: &KvLayout) -> Result<()> {
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

/// The shard this thread pushes to and pops from first.
#[cfg(not(loom))]
fn home_shard() -> usize {
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;
    static NEXT: StdAtomicUsize = StdAtomicUsize::new(0);
    thread_local! {
        static HOME: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS;
    }
    HOME.with(|h| *h)
}

/// Under loom every thread starts at shard 0, so all of them contend (growth
/// still spreads blocks over every shard, so stealing is exercised).
#[cfg(loom)]
fn home_shard() -> usize {
    0
}

/// What a popper does with a popped cached block.
enum Pop {
    Discard,
    SecondChance,
    Take,
}

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

    fn push_fresh(&self, index: u32, shard: usize) {
        let slot = self.slot_at(index as usize);
        let head_ref = &self.fresh[shard].0;
        let mut head = head_ref.load(Ordering::Acquire);
        loop {
            slot.next.store(head as u32, Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | u64::from(index);
            match head_ref.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }

    /// Pops from this thread's shard, then steals from the others.
    fn pop_fresh(&self) -> Option<u32> {
        let home = home_shard();
        (0..SHARDS).find_map(|k| self.pop_shard((home + k) % SHARDS))
    }

    fn pop_shard(&self, shard: usize) -> Option<u32> {
        let head_ref = &self.fresh[shard].0;
        let mut head = head_ref.load(Ordering::Acquire);
        loop {
            let index = head as u32;
            if index == NIL {
                return None;
            }
            // If `index` was popped and pushed again meanwhile, the tag moved
            // on and the exchange below fails: `next` may be stale but unused.
            let next = self.slot_at(index as usize).next.load(Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | u64::from(next);
            match head_ref.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(index),
                Err(now) => head = now,
            }
        }
    }

    /// Reserves `n` units: `(fresh, cached)` counts to pop. Fresh blocks
    /// first; when they are short the pool grows; cached blocks are
    /// reclaimed only at the cap. `None` only when, at one consistent
    /// moment, the cap and all unpromised free blocks cannot cover `n`.
    fn reserve(&self, n: usize) -> Option<(usize, usize)> {
        let max = self.config.max_blocks;
        loop {
            // Order matters: capacity, then the growth sequence, then units.
            // A capacity read before a growth's units makes headroom larger,
            // never smaller; an even sequence after it means the batch that
            // set it is fully published.
            let cap = self.capacity.load(Ordering::Acquire);
            let seq = self.growth_seq.load(Ordering::Acquire);
            let u = self.units.0.load(Ordering::Acquire);
            let (fresh, cached) = unpack(u);
            let headroom = max - cap;
            if fresh.saturating_add(cached).saturating_add(headroom) < n {
                if seq & 1 == 1 {
                    spin_wait();
                    continue;
                }
                return None;
            }
            let take = if fresh >= n {
                (n, 0)
            } else if headroom > 0 {
                self.grow_for(n);
                continue;
            } else {
                (fresh, n - fresh)
            };
            let next = pack(fresh - take.0, cached - take.1);
            if self
                .units
                .0
                .compare_exchange_weak(u, next, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(take);
            }
        }
    }

    /// Takes one unpromised cached unit (for a revival), if there is one.
    fn try_take_cached_unit(&self) -> bool {
        let mut u = self.units.0.load(Ordering::Acquire);
        while unpack(u).1 > 0 {
            match self.units.0.compare_exchange_weak(
                u,
                u - ONE_CACHED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => u = now,
            }
        }
        false
    }

    /// Pops one fresh block; the caller holds a fresh unit.
    fn take_fresh(&self, out: &mut Allocation) {
        loop {
            let Some(index) = self.pop_fresh() else {
                // The entry we are owed is being pushed by another thread.
                spin_wait();
                continue;
            };
            let slot = self.slot_at(index as usize);
            // A fresh free block is touched by nobody else: retain, release
            // and mark_cached all refuse a free, uncached block.
            let s = slot.state.load(Ordering::Acquire);
            debug_assert!(count(s) == 0 && s & (CACHED | RETIRED) == 0);
            let next = taken(epoch(s) + 1);
            slot.state.store(next, Ordering::Release);
            out.blocks.push(BlockId::new(index, epoch(next)));
            return;
        }
    }

    /// Pops until it owns one cached free block; the caller holds a cached
    /// unit.
    fn take_cached(&self, out: &mut Allocation) {
        loop {
            let Some(index) = self.evictable.pop() else {
                spin_wait();
                continue;
            };
            let slot = self.slot_at(index as usize);
            let mut s = slot.state.load(Ordering::Acquire);
            loop {
                if s & REVIVING != 0 {
                    // A reviver owns it for a moment: it commits or backs off.
                    spin_wait();
                    s = slot.state.load(Ordering::Acquire);
                    continue;
                }
                let (next, outcome) = if count(s) > 0 || s & RETIRED != 0 {
                    // Revived while queued (its release re-queues it), or
                    // retired: drop this entry.
                    (s & !(QUEUED | TOUCHED), Pop::Discard)
                } else if s & TOUCHED != 0 {
                    (s & !TOUCHED, Pop::SecondChance)
                } else {
                    (taken(epoch(s) + 1), Pop::Take)
                };
                match slot
                    .state
                    .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
                {
                    Err(now) => s = now,
                    Ok(_) => match outcome {
                        Pop::Discard => break,
                        Pop::SecondChance => {
                            self.evictable.push(index);
                            break;
                        }
                        Pop::Take => {
                            out.reclaimed.push(BlockId::new(index, epoch(s)));
                            out.blocks.push(BlockId::new(index, epoch(next)));
                            return;
                        }
                    },
                }
            }
        }
    }
}

impl BlockAllocator for BlockPool {
    fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool {
        if n == 0 {
            return true;
        }
        let Some((fresh, cached)) = self.reserve(n) else {
            return false;
        };
        out.blocks.reserve(n);
        for _ in 0..fresh {
            self.take_fresh(out);
        }
        for _ in 0..cached {
            self.take_cached(out);
        }
        true
    }

    fn retain(&self, id: BlockId) -> Result<Retained> {
        let slot = self.slot(id)?;
        let mut s = slot.state.load(Ordering::Acquire);
        loop {
            if epoch(s) != id.epoch() || s & RETIRED != 0 {
                return Ok(Retained::Reclaimed);
            }
            if s & REVIVING != 0 {
                // Another thread is reviving it: wait for the outcome.
                spin_wait();
                s = slot.state.load(Ordering::Acquire);
                continue;
            }
            let c = count(s);
            if c > 0 {
                if c == MAX_REF_COUNT {
                    return Err(PoolError::RefCountOverflow { id });
                }
                match slot.state.compare_exchange_weak(
                    s,
                    s + 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return Ok(Retained::Held(c + 1)),
                    Err(now) => s = now,
                }
                continue;
            }
            if s & CACHED == 0 {
                return Err(PoolError::NotHeld { id });
            }
            // Revive a cached free block. Own it first, so that two revivers
            // never both take a unit for it.
            if let Err(now) = slot.state.compare_exchange_weak(
                s,
                s | REVIVING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                s = now;
                continue;
            }
            let touched = if s & QUEUED != 0 { TOUCHED } else { 0 };
            if self.try_take_cached_unit() {
                // Nobody changes a REVIVING state but its owner.
                slot.state.store((s | touched) + 1, Ordering::Release);
                return Ok(Retained::Held(1));
            }
            // Every unpromised cached unit is gone: either an allocation in
            // flight will take some cached block (perhaps this one: then the
            // epoch moves and the answer is `Reclaimed`), or this block's
            // own release has not returned its unit yet. Back off, and wait
            // for one of the two before trying again (retrying at once could
            // hold REVIVING every time the allocation looks at this block).
            slot.state.store(s, Ordering::Release);
            loop {
                spin_wait();
                let now = slot.state.load(Ordering::Acquire);
                if now != s || unpack(self.units.0.load(Ordering::Acquire)).1 > 0 {
                    s = now;
                    break;
                }
            }
        }
    }

    fn release(&self, id: BlockId) -> Result<u32> {
        let slot = self.slot(id)?;
        let mut s = slot.state.load(Ordering::Acquire);
        loop {
            if epoch(s) != id.epoch() {
                return Err(PoolError::StaleBlock {
                    id,
                    current_epoch: epoch(s),
                });
            }
            let c = count(s);
            if c == 0 {
                return Err(PoolError::NotHeld { id });
            }
            let retire = c == 1 && epoch(s) == LAST_EPOCH;
            let next = if retire {
                // Its content is dropped for good; a queue entry left from a
                // revival is discarded by the popper.
                (s - 1) & !(CACHED | TOUCHED) | RETIRED
            } else if c == 1 {
                (s - 1) | QUEUED
            } else {
                s - 1
            };
            if let Err(now) =
                slot.state
                    .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                s = now;
                continue;
            }
            if retire {
                self.retired.fetch_add(1, Ordering::AcqRel);
            } else if c == 1 {
                let cached = s & CACHED != 0;
                if s & QUEUED == 0 {
                    if cached {
                        self.evictable.push(id.index());
                    } else {
                        self.push_fresh(id.index(), home_shard());
                    }
                }
                let unit = if cached { ONE_CACHED } else { ONE_FRESH };
                self.units.0.fetch_add(unit, Ordering::AcqRel);
            }
            return Ok(c - 1);
        }
    }

    fn mark_cached(&self, id: BlockId) -> Result<()> {
        let slot = self.slot(id)?;
        let mut s = slot.state.load(Ordering::Acquire);
        loop {
            if epoch(s) != id.epoch() {
                return Err(PoolError::StaleBlock {
                    id,
                    current_epoch: epoch(s),
                });
            }
            if count(s) == 0 {
                return Err(PoolError::NotHeld { id });
            }
            if s & CACHED != 0 {
                return Ok(());
            }
            match slot.state.compare_exchange_weak(
                s,
                s | CACHED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => s = now,
            }
        }
    }

    fn ref_count(&self, id: BlockId) -> Result<u32> {
        let s = self.slot(id)?.state.load(Ordering::Acquire);
        if epoch(s) != id.epoch() {
            return Err(PoolError::StaleBlock {
                id,
                current_epoch: epoch(s),
            });
        }
        Ok(count(s))
    }

    fn stats(&self) -> PoolStats {
        // Read capacity and units from one growth generation (a sequence
        // lock: growth publishes capacity before the units of its batch).
        let (capacity, units, retired) = loop {
            let before = self.growth_seq.load(Ordering::Acquire);
            if before & 1 == 1 {
                spin_wait();
                continue;
            }
            let capacity = self.capacity.load(Ordering::Acquire);
            let units = self.units.0.load(Ordering::Acquire);
            let retired = self.retired.load(Ordering::Acquire);
            fence(Ordering::Acquire);
            if self.growth_seq.load(Ordering::Relaxed) == before {
                break (capacity, units, retired);
            }
        };
        let (fresh, cached_free) = unpack(units);
        let in_use = capacity.saturating_sub(fresh + cached_free + retired);
        let block_bytes = self.layout.block_bytes();
        PoolStats {
            capacity,
            max_blocks: self.config.max_blocks,
            in_use,
            cached_free,
            retired,
            block_bytes,
            // Cannot overflow: max_blocks * block_bytes was checked in `new`.
            in_use_bytes: in_use as u64 * block_bytes,
            capacity_bytes: capacity as u64 * block_bytes,
        }
    }
}

// FLAGS documents the layout; keep the compiler honest about it.
const _: () = assert!(FLAGS & COUNT_MASK == 0 && FLAGS >> 32 == 0);

#[cfg(all(test, not(loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::layout::StorageFormat;

    fn layout() -> KvLayout {
        KvLayout::new(2, 1, 8, 4, StorageFormat::F16).unwrap()
    }

    fn pool(cfg: PoolConfig) -> BlockPool {
        BlockPool::new(layout(), cfg).unwrap()
    }

    #[test]
    fn exhaustion_returns_none_and_changes_nothing() {
        let p = pool(PoolConfig::fixed(3));
        let a = p.allocate(2).unwrap();
        let before = p.stats();
        assert!(p.allocate(2).is_none());
        assert_eq!(p.stats(), before);
        p.release_sequence(&a.blocks).unwrap();
        assert_eq!(p.stats().in_use, 0);
    }

    #[test]
    fn grows_in_batches_up_to_the_cap_without_moving_blocks() {
        let cfg = PoolConfig::fixed(4)
            .with_growth_batch(4)
            .with_max_blocks(10);
        let p = pool(cfg);
        assert_eq!(p.stats().capacity, 4);
        let first = p.allocate(4).unwrap();
        let more = p.allocate(5).unwrap();
        assert_eq!(
            p.stats().capacity,
            10,
            "two batches, the last one cut at the cap"
        );
        assert!(p.allocate(2).is_none());
        // Earlier handles still resolve after growth.
        for &b in first.blocks.iter().chain(&more.blocks) {
            assert_eq!(p.ref_count(b).unwrap(), 1);
        }
        assert_eq!(p.stats().in_use_bytes, 9 * layout().block_bytes());
    }

    #[test]
    fn growth_adds_only_the_batches_the_shortfall_needs() {
        let cfg = PoolConfig::fixed(0)
            .with_growth_batch(4)
            .with_max_blocks(64);
        let p = pool(cfg);
        let a = p.allocate(1).unwrap();
        assert_eq!(p.stats().capacity, 4);
        let b = p.allocate(3).unwrap();
        assert_eq!(p.stats().capacity, 4, "three fresh blocks were left");
        let c = p.allocate(9).unwrap();
        assert_eq!(p.stats().capacity, 16, "nine more: three batches");
        for x in [a, b, c] {
            p.release_sequence(&x.blocks).unwrap();
        }
    }

    #[test]
    fn grows_before_reclaiming_cached_blocks() {
        let cfg = PoolConfig::fixed(2).with_growth_batch(2).with_max_blocks(4);
        let p = pool(cfg);
        let a = p.allocate(2).unwrap();
        for &b in &a.blocks {
            p.mark_cached(b).unwrap();
        }
        p.release_sequence(&a.blocks).unwrap();
        let b = p.allocate(2).unwrap();
        assert!(
            b.reclaimed.is_empty(),
            "the pool grew instead of evicting cache"
        );
        assert_eq!(p.stats().capacity, 4);
        let c = p.allocate(1).unwrap();
        assert_eq!(
            c.reclaimed.len(),
            1,
            "at the cap, cached blocks are reclaimed"
        );
    }

    #[test]
    fn an_allocation_mixes_fresh_and_cached_blocks_at_the_cap() {
        let p = pool(PoolConfig::fixed(3));
        let a = p.allocate(2).unwrap();
        p.mark_cached(a.blocks[0]).unwrap();
        p.release_sequence(&a.blocks).unwrap(); // one cached, two fresh free
        let got = p.allocate(3).unwrap();
        assert_eq!(got.reclaimed, vec![a.blocks[0]]);
        assert_eq!(p.stats().in_use, 3);
        assert_eq!(p.stats().cached_free, 0);
        p.release_sequence(&got.blocks).unwrap();
    }

    #[test]
    fn tail_first_release_reclaims_the_tail_first() {
        let p = pool(PoolConfig::fixed(3));
        let a = p.allocate(3).unwrap();
        for &b in &a.blocks {
            p.mark_cached(b).unwrap();
        }
        p.release_sequence(&a.blocks).unwrap();
        let r = p.allocate(1).unwrap();
        assert_eq!(r.reclaimed, vec![a.blocks[2]]);
        let r = p.allocate(1).unwrap();
        assert_eq!(r.reclaimed, vec![a.blocks[1]]);
    }

    #[test]
    fn a_revived_block_gets_a_second_chance() {
        let p = pool(PoolConfig::fixed(2));
        let a = p.allocate(2).unwrap();
        for &b in &a.blocks {
            p.mark_cached(b).unwrap();
        }
        p.release_sequence(&a.blocks).unwrap(); // queue: [b1, b0]
        assert_eq!(p.retain(a.blocks[1]).unwrap(), Retained::Held(1));
        p.release(a.blocks[1]).unwrap(); // b1 touched while queued
        let r = p.allocate(1).unwrap();
        assert_eq!(
            r.reclaimed,
            vec![a.blocks[0]],
            "the recently used block survives"
        );
    }

    #[test]
    fn stale_handles_are_detected() {
        let p = pool(PoolConfig::fixed(1));
        let a = p.allocate(1).unwrap().blocks[0];
        p.release(a).unwrap();
        let b = p.allocate(1).unwrap().blocks[0];
        assert_eq!(a.index(), b.index());
        assert_ne!(a.epoch(), b.epoch());
        assert!(matches!(p.release(a), Err(PoolError::StaleBlock { .. })));
        assert!(matches!(p.ref_count(a), Err(PoolError::StaleBlock { .. })));
        assert_eq!(p.retain(a).unwrap(), Retained::Reclaimed);
        assert_eq!(p.ref_count(b).unwrap(), 1, "the new owner is untouched");
    }

    /// Moves slot `index` (free, fresh, on a stack) to `epoch`, as if it had
    /// been reused that many times.
    fn age_slot(p: &BlockPool, index: u32, epoch: u32) {
        let slot = p.slot_at(index as usize);
        let s = slot.state.load(Ordering::Acquire);
        slot.state
            .store((u64::from(epoch) << 32) | (s & FLAGS), Ordering::Release);
    }

    #[test]
    fn a_slot_is_retired_at_its_last_epoch_instead_of_wrapping() {
        for cached in [false, true] {
            let p = pool(PoolConfig::fixed(2));
            age_slot(&p, 0, LAST_EPOCH - 1);
            age_slot(&p, 1, LAST_EPOCH - 1);
            let a = p.allocate(2).unwrap();
            assert!(a.blocks.iter().all(|b| b.epoch() == LAST_EPOCH));
            if cached {
                p.mark_cached(a.blocks[0]).unwrap();
            }
            p.release_sequence(&a.blocks).unwrap();
            let s = p.stats();
            assert_eq!((s.retired, s.in_use, s.free()), (2, 0, 0), "{s:?}");
            assert!(p.allocate(1).is_none(), "retired slots are never reused");
            // The last handles stay recognisable: never an epoch-0 repeat.
            assert_eq!(p.retain(a.blocks[0]), Ok(Retained::Reclaimed));
            assert_eq!(
                p.release(a.blocks[0]),
                Err(PoolError::NotHeld { id: a.blocks[0] })
            );
            assert_eq!(p.ref_count(a.blocks[1]), Ok(0));
        }
    }

    #[test]
    fn a_retired_slot_left_in_the_evictable_queue_is_skipped() {
        let p = pool(PoolConfig::fixed(2));
        age_slot(&p, 0, LAST_EPOCH - 1);
        let a = p.allocate(2).unwrap();
        let last = *a.blocks.iter().find(|b| b.epoch() == LAST_EPOCH).unwrap();
        let other = *a.blocks.iter().find(|b| b.epoch() != LAST_EPOCH).unwrap();
        p.mark_cached(last).unwrap();
        p.mark_cached(other).unwrap();
        p.release(last).unwrap(); // retired
        p.release(other).unwrap(); // cached, queued
        let got = p.allocate(1).unwrap();
        assert_eq!(got.reclaimed, vec![other]);
        assert!(p.allocate(1).is_none());
        assert_eq!(p.stats().retired, 1);
    }

    #[test]
    fn a_huge_cap_does_not_allocate_its_whole_table_up_front() {
        let cfg = PoolConfig::fixed(1)
            .with_growth_batch(1)
            .with_max_blocks(u32::MAX as usize);
        let tiny = KvLayout::new(1, 1, 1, 1, StorageFormat::Int2 { group_size: 1 }).unwrap();
        let p = BlockPool::new(tiny, cfg).unwrap();
        assert!(p.segments.len() <= MAX_SEGMENTS);
        let a = p.allocate(3).unwrap();
        assert_eq!(
            p.stats().capacity,
            3,
            "growth still goes one batch at a time"
        );
        p.release_sequence(&a.blocks).unwrap();
    }

    #[test]
    fn invalid_configs_are_rejected() {
        let l = layout();
        for cfg in [
            PoolConfig::fixed(0),
            PoolConfig::fixed(4).with_growth_batch(3),
            PoolConfig::fixed(8).with_max_blocks(4),
            PoolConfig::fixed(1).with_max_blocks(u32::MAX as usize + 1),
        ] {
            let e = BlockPool::new(l, cfg).unwrap_err();
            assert!(matches!(e, PoolError::InvalidConfig { .. }), "{cfg:?}: {e}");
        }
        let huge = KvLayout::new(1 << 20, 1 << 10, 1 << 10, 1, StorageFormat::F32).unwrap();
        let e = BlockPool::new(huge, PoolConfig::fixed(1 << 22)).unwrap_err();
        assert!(matches!(e, PoolError::Overflow { .. }));
    }

    #[test]
    fn seed_sizing_rule_adds_twenty_percent() {
        let l = KvLayout::new(30, 3, 64, 128, StorageFormat::F16).unwrap();
        // 8 requests x 4096 tokens / 128 = 256 blocks, + 20% = 307.2 -> 308.
        let cfg = PoolConfig::sized_for(8, 4096, &l).unwrap();
        assert_eq!(cfg.initial_blocks, 308);
        let cfg = cfg.with_memory_budget(1 << 30, &l);
        assert_eq!(cfg.max_blocks as u64, (1u64 << 30) / l.block_bytes());
        assert!(PoolConfig::sized_for(usize::MAX, 2, &l).is_err());
        let one = KvLayout::new(1, 1, 1, 1, StorageFormat::F16).unwrap();
        assert!(matches!(
            PoolConfig::sized_for(usize::MAX, 1, &one),
            Err(PoolError::Overflow { .. })
        ));
    }
}
