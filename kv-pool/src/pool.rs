//! [`BlockPool`]: the lock-free, growable, reference-counted block pool.
//!
//! Each block is one `AtomicU64` packing its whole state, so every transition
//! is a single compare-and-swap:
//!
//! ```text
//!  63            32  31       30      29      28            0
//! +----------------+--------+-------+-------+---------------+
//! |     epoch      | TOUCHED|QUEUED |CACHED |  ref count    |
//! +----------------+--------+-------+-------+---------------+
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
//!
//! Fresh (never cached) blocks live on intrusive Treiber stacks, one per
//! shard, linked through each slot's `next` field and tagged against ABA;
//! a thread pushes to its home shard and pops from it first, so a single
//! thread's allocate + release pair costs a handful of uncontended CAS.
//!
//! `available` counts free blocks not yet promised to an allocation; a thread
//! *reserves* units there before it pops, so a pop after a successful
//! reservation always finds a block (possibly after a short wait for an entry
//! that another thread is re-queueing).

use std::sync::{Mutex, OnceLock};

use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, FreeQueue, Ordering, spin_wait};
use crate::{
    Allocation, BlockAllocator, BlockId, KvLayout, PoolError, PoolStats, Result, Retained,
};

const COUNT_MASK: u64 = (1 << 29) - 1;
const CACHED: u64 = 1 << 29;
const QUEUED: u64 = 1 << 30;
const TOUCHED: u64 = 1 << 31;
const FLAGS: u64 = CACHED | QUEUED | TOUCHED;

#[inline]
const fn count(s: u64) -> u32 {
    (s & COUNT_MASK) as u32
}

#[inline]
const fn epoch(s: u64) -> u32 {
    (s >> 32) as u32
}

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
        let initial = blocks + blocks.div_ceil(5);
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

/// Under loom every thread starts at shard 0, so all of them contend.
#[cfg(loom)]
fn home_shard() -> usize {
    0
}

/// A thread-safe pool of fixed-size KV blocks.
///
/// Allocation and release are lock-free (sharded Treiber stacks for fresh
/// blocks, a crossbeam queue for cached ones, one CAS on the block's state);
/// only growth takes a lock, once per batch.
pub struct BlockPool {
    layout: KvLayout,
    config: PoolConfig,
    /// Segment `k` holds blocks `k * batch .. (k + 1) * batch`; never moves.
    segments: Box<[OnceLock<Box<[Slot]>>]>,
    shift: u32,
    capacity: AtomicUsize,
    cached_free: AtomicUsize,
    /// The hottest counter: on its own cache lines.
    available: Padded<AtomicUsize>,
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
        let batch = config.growth_batch;
        let segments = config.max_blocks.div_ceil(batch);
        let pool = BlockPool {
            layout,
            config,
            segments: (0..segments).map(|_| OnceLock::new()).collect(),
            shift: batch.trailing_zeros(),
            capacity: AtomicUsize::new(0),
            available: Padded(AtomicUsize::new(0)),
            cached_free: AtomicUsize::new(0),
            fresh: std::array::from_fn(|_| Padded(AtomicU64::new(u64::from(NIL)))),
            evictable: FreeQueue::new(),
            grow_lock: Mutex::new(()),
        };
        if config.initial_blocks > 0 {
            pool.grow(config.initial_blocks);
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

    /// Adds whole batches until at least `want` more blocks exist or the cap
    /// is reached. Returns whether any block was added (by this call or by a
    /// concurrent one while it waited for the lock).
    fn grow(&self, want: usize) -> bool {
        let before = self.capacity.load(Ordering::Acquire);
        let _guard = self.grow_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut cap = self.capacity.load(Ordering::Acquire);
        if cap != before {
            return true;
        }
        let target = cap.saturating_add(want).min(self.config.max_blocks);
        while cap < target {
            let seg = cap >> self.shift;
            let len = self.config.growth_batch.min(self.config.max_blocks - cap);
            let slots: Box<[Slot]> = (0..len)
                .map(|_| Slot {
                    state: AtomicU64::new(QUEUED),
                    next: AtomicU32::new(NIL),
                })
                .collect();
            if self.segments[seg].set(slots).is_err() {
                unreachable!("segments are filled in order under the growth lock");
            }
            let first = cap as u32;
            cap += len;
            // Publish the slots before they are linked or reservable.
            self.capacity.store(cap, Ordering::Release);
            for i in (0..len as u32).rev() {
                let index = first + i;
                self.push_fresh(index, index as usize % SHARDS);
            }
            self.available.0.fetch_add(len, Ordering::AcqRel);
        }
        cap != before
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
        let seg = &self.segments[index >> self.shift];
        match seg.get() {
            Some(slots) => &slots[index & (self.config.growth_batch - 1)],
            None => unreachable!("index below capacity lies in a published segment"),
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

    /// Reserves `n` units of `available`, growing first when fresh blocks
    /// are short (cached blocks are only reclaimed once the cap is reached).
    fn reserve(&self, n: usize) -> bool {
        loop {
            let avail = self.available.0.load(Ordering::Acquire);
            let fresh = avail.saturating_sub(self.cached_free.load(Ordering::Acquire));
            let headroom = self.config.max_blocks - self.capacity.load(Ordering::Acquire);
            if avail.saturating_add(headroom) < n {
                // Not even full growth would do: fail without growing.
                return false;
            }
            if fresh < n && headroom > 0 && self.grow(n - fresh) {
                continue;
            }
            if avail < n {
                return false;
            }
            if self
                .available
                .0
                .compare_exchange_weak(avail, avail - n, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return true;
            }
        }
    }

    fn try_reserve_one(&self) -> bool {
        let mut avail = self.available.0.load(Ordering::Acquire);
        while avail > 0 {
            match self.available.0.compare_exchange_weak(
                avail,
                avail - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => avail = now,
            }
        }
        false
    }

    /// Pops until it owns one free block; the caller holds a reservation.
    fn take_one(&self, out: &mut Allocation) {
        loop {
            let Some(index) = self.pop_fresh().or_else(|| self.evictable.pop()) else {
                // The entry we are owed is being re-queued by another thread.
                spin_wait();
                continue;
            };
            let slot = self.slot_at(index as usize);
            let mut s = slot.state.load(Ordering::Acquire);
            loop {
                let (next, outcome) = if count(s) > 0 {
                    // Revived while queued: drop this entry; release re-queues it.
                    (s & !(QUEUED | TOUCHED), Pop::Discard)
                } else if s & TOUCHED != 0 {
                    (s & !TOUCHED, Pop::SecondChance)
                } else {
                    ((u64::from(epoch(s).wrapping_add(1)) << 32) | 1, Pop::Take)
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
                            if s & CACHED != 0 {
                                self.cached_free.fetch_sub(1, Ordering::AcqRel);
                                out.reclaimed.push(BlockId::new(index, epoch(s)));
                            }
                            out.blocks.push(BlockId::new(index, epoch(next)));
                            return;
                        }
                    },
                }
            }
        }
    }
}

enum Pop {
    Discard,
    SecondChance,
    Take,
}

impl BlockAllocator for BlockPool {
    fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool {
        if n == 0 {
            return true;
        }
        if !self.reserve(n) {
            return false;
        }
        out.blocks.reserve(n);
        for _ in 0..n {
            self.take_one(out);
        }
        true
    }

    fn retain(&self, id: BlockId) -> Result<Retained> {
        let slot = self.slot(id)?;
        let mut s = slot.state.load(Ordering::Acquire);
        loop {
            if epoch(s) != id.epoch() {
                return Ok(Retained::Reclaimed);
            }
            let c = count(s);
            if c > 0 {
                if u64::from(c) == COUNT_MASK {
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
            // Revive a cached free block: it stops being available.
            if !self.try_reserve_one() {
                // Every free block is promised to an allocation in flight.
                return Ok(Retained::Reclaimed);
            }
            let touched = if s & QUEUED != 0 { TOUCHED } else { 0 };
            match slot.state.compare_exchange(
                s,
                (s + 1) | touched,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.cached_free.fetch_sub(1, Ordering::AcqRel);
                    return Ok(Retained::Held(1));
                }
                Err(now) => {
                    self.available.0.fetch_add(1, Ordering::AcqRel);
                    s = now;
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
            let next = if c == 1 { (s - 1) | QUEUED } else { s - 1 };
            if let Err(now) =
                slot.state
                    .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                s = now;
                continue;
            }
            if c == 1 {
                let cached = s & CACHED != 0;
                if cached {
                    self.cached_free.fetch_add(1, Ordering::AcqRel);
                }
                if s & QUEUED == 0 {
                    if cached {
                        self.evictable.push(id.index());
                    } else {
                        self.push_fresh(id.index(), home_shard());
                    }
                }
                self.available.0.fetch_add(1, Ordering::AcqRel);
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
        let capacity = self.capacity.load(Ordering::Acquire);
        let available = self.available.0.load(Ordering::Acquire);
        let in_use = capacity.saturating_sub(available);
        let block_bytes = self.layout.block_bytes();
        PoolStats {
            capacity,
            max_blocks: self.config.max_blocks,
            in_use,
            cached_free: self.cached_free.load(Ordering::Acquire),
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
    use crate::StorageFormat;

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
    }
}
