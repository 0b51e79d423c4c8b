//! [`BlockAllocator`] for [`BlockPool`]: allocate, retain, release, cache.

use super::free::home_shard;
use super::{
    BlockPool, CACHED, COUNT_MASK, FLAGS, LAST_EPOCH, MAX_REF_COUNT, ONE_CACHED, ONE_FRESH, QUEUED,
    RETIRED, REVIVING, TOUCHED, count, epoch, unpack,
};
use crate::error::{PoolError, Result};
use crate::sync::{Ordering, fence, spin_wait};
use crate::{Allocation, BlockAllocator, BlockId, PoolStats, Retained};

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
