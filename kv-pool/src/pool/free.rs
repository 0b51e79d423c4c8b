//! The free lists ([`BlockPool`]'s sharded fresh stacks and its evictable
//! queue) and the availability word that promises their blocks.

use super::{
    BlockPool, CACHED, NIL, ONE_CACHED, QUEUED, RETIRED, REVIVING, SHARDS, TOUCHED, count, epoch,
    pack, taken, unpack,
};
use crate::sync::{Ordering, spin_wait};
use crate::{Allocation, BlockId};

/// The shard this thread pushes to and pops from first.
#[cfg(not(loom))]
pub(super) fn home_shard() -> usize {
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
pub(super) fn home_shard() -> usize {
    0
}

/// What a popper does with a popped cached block.
enum Pop {
    Discard,
    SecondChance,
    Take,
}

impl BlockPool {
    pub(super) fn push_fresh(&self, index: u32, shard: usize) {
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
    pub(super) fn pop_fresh(&self) -> Option<u32> {
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
    pub(super) fn reserve(&self, n: usize) -> Option<(usize, usize)> {
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
    pub(super) fn try_take_cached_unit(&self) -> bool {
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
    pub(super) fn take_fresh(&self, out: &mut Allocation) {
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
    pub(super) fn take_cached(&self, out: &mut Allocation) {
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
