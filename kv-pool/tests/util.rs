//! A deliberately simple reference allocator: one mutex around plain vectors.
//!
//! It defines the expected behaviour in the clearest possible terms and runs
//! the same conformance suite as the lock-free pool.

use std::collections::VecDeque;
use std::sync::Mutex;

use kvforge_pool::{Allocation, BlockAllocator, BlockId, PoolError, PoolStats, Result, Retained};

#[derive(Clone, Copy, Default)]
struct Block {
    count: u32,
    epoch: u32,
    cached: bool,
}

struct State {
    blocks: Vec<Block>,
    /// Free blocks never cached, FIFO.
    fresh: VecDeque<u32>,
    /// Free cached blocks, least recently released first.
    evictable: VecDeque<u32>,
}

pub(crate) struct ReferenceAllocator {
    state: Mutex<State>,
    block_bytes: u64,
}

impl ReferenceAllocator {
    pub(crate) fn new(blocks: usize, block_bytes: u64) -> Self {
        ReferenceAllocator {
            state: Mutex::new(State {
                blocks: vec![Block::default(); blocks],
                fresh: (0..blocks as u32).collect(),
                evictable: VecDeque::new(),
            }),
            block_bytes,
        }
    }

    fn with<T>(&self, id: BlockId, f: impl FnOnce(&mut State, usize) -> Result<T>) -> Result<T> {
        let mut st = self.state.lock().unwrap();
        let capacity = st.blocks.len();
        let i = id.index() as usize;
        if i >= capacity {
            return Err(PoolError::UnknownBlock { id, capacity });
        }
        f(&mut st, i)
    }
}

impl BlockAllocator for ReferenceAllocator {
    fn allocate_into(&self, n: usize, out: &mut Allocation) -> bool {
        let mut st = self.state.lock().unwrap();
        if st.fresh.len() + st.evictable.len() < n {
            return false;
        }
        for _ in 0..n {
            let (i, cached) = match st.fresh.pop_front() {
                Some(i) => (i, false),
                None => (st.evictable.pop_front().unwrap(), true),
            };
            let b = &mut st.blocks[i as usize];
            if cached {
                out.reclaimed.push(BlockId::new(i, b.epoch));
            }
            b.epoch = b.epoch.wrapping_add(1);
            b.count = 1;
            b.cached = false;
            out.blocks.push(BlockId::new(i, b.epoch));
        }
        true
    }

    fn retain(&self, id: BlockId) -> Result<Retained> {
        self.with(id, |st, i| {
            let b = st.blocks[i];
            if b.epoch != id.epoch() {
                return Ok(Retained::Reclaimed);
            }
            if b.count == 0 {
                if !b.cached {
                    return Err(PoolError::NotHeld { id });
                }
                st.evictable.retain(|&x| x as usize != i);
            }
            st.blocks[i].count += 1;
            Ok(Retained::Held(st.blocks[i].count))
        })
    }

    fn release(&self, id: BlockId) -> Result<u32> {
        self.with(id, |st, i| {
            let b = &mut st.blocks[i];
            if b.epoch != id.epoch() {
                return Err(PoolError::StaleBlock {
                    id,
                    current_epoch: b.epoch,
                });
            }
            if b.count == 0 {
                return Err(PoolError::NotHeld { id });
            }
            b.count -= 1;
            let (count, cached) = (b.count, b.cached);
            if count == 0 {
                if cached {
                    st.evictable.push_back(i as u32);
                } else {
                    st.fresh.push_back(i as u32);
                }
            }
            Ok(count)
        })
    }

    fn mark_cached(&self, id: BlockId) -> Result<()> {
        self.with(id, |st, i| {
            let b = &mut st.blocks[i];
            if b.epoch != id.epoch() {
                return Err(PoolError::StaleBlock {
                    id,
                    current_epoch: b.epoch,
                });
            }
            if b.count == 0 {
                return Err(PoolError::NotHeld { id });
            }
            b.cached = true;
            Ok(())
        })
    }

    fn ref_count(&self, id: BlockId) -> Result<u32> {
        self.with(id, |st, i| {
            let b = st.blocks[i];
            if b.epoch != id.epoch() {
                return Err(PoolError::StaleBlock {
                    id,
                    current_epoch: b.epoch,
                });
            }
            Ok(b.count)
        })
    }

    fn stats(&self) -> PoolStats {
        let st = self.state.lock().unwrap();
        let capacity = st.blocks.len();
        let in_use = st.blocks.iter().filter(|b| b.count > 0).count();
        PoolStats {
            capacity,
            max_blocks: capacity,
            in_use,
            cached_free: st.evictable.len(),
            retired: 0,
            block_bytes: self.block_bytes,
            in_use_bytes: in_use as u64 * self.block_bytes,
            capacity_bytes: capacity as u64 * self.block_bytes,
        }
    }
}
