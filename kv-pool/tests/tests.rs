//! Integration tests of `kvforge-pool`: the conformance suite on every
//! allocator, property tests of the invariants, and a multi-threaded stress
//! test on shared blocks.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

mod util;

use std::sync::atomic::{AtomicBool, Ordering};

use kvforge_pool::{
    Allocation, BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, PoolError, Retained,
    StorageFormat, testing,
};
use proptest::prelude::*;
use util::ReferenceAllocator;

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 16, 4, StorageFormat::F16).unwrap()
}

#[test]
fn block_pool_passes_the_conformance_suite() {
    testing::check_allocator(|n| BlockPool::new(layout(), PoolConfig::fixed(n)).unwrap());
}

#[test]
fn growable_block_pool_passes_the_conformance_suite() {
    // Starts with one small batch and grows to the requested size on demand.
    testing::check_allocator(|n| {
        let cfg = PoolConfig::fixed(1).with_growth_batch(1).with_max_blocks(n);
        BlockPool::new(layout(), cfg).unwrap()
    });
}

#[test]
fn reference_allocator_passes_the_conformance_suite() {
    testing::check_allocator(|n| ReferenceAllocator::new(n, layout().block_bytes()));
}

#[test]
fn allocators_work_through_dyn_and_arc() {
    let pool: Box<dyn BlockAllocator> =
        Box::new(BlockPool::new(layout(), PoolConfig::fixed(4)).unwrap());
    testing::check_allocator(|n| {
        std::sync::Arc::new(BlockPool::new(layout(), PoolConfig::fixed(n)).unwrap())
    });
    assert!(pool.allocate(4).is_some());
    assert!(pool.allocate(1).is_none());
}

/// One step of a random single-threaded workload.
#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Retain(usize),
    Release(usize),
    MarkCached(usize),
    ReviveStale(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Retain),
        any::<usize>().prop_map(Op::Release),
        any::<usize>().prop_map(Op::MarkCached),
        any::<usize>().prop_map(Op::ReviveStale),
    ]
}

/// Drives `a` with `ops` while tracking every handle ever handed out, and
/// checks the invariants after each step.
fn check_invariants<A: BlockAllocator>(a: &A, capacity: usize, ops: &[Op]) {
    // References this test holds, per handle (a handle may be held many times).
    let mut held: Vec<BlockId> = Vec::new();
    // Handles we released to zero or that were reclaimed: never valid to release.
    let mut seen: Vec<BlockId> = Vec::new();
    let mut cached: Vec<BlockId> = Vec::new();
    let block_bytes = a.stats().block_bytes;
    for op in ops {
        match *op {
            Op::Allocate(n) => {
                let free_before = a.stats().free();
                match a.allocate(n) {
                    Some(Allocation { blocks, reclaimed }) => {
                        assert_eq!(blocks.len(), n);
                        for r in &reclaimed {
                            assert!(cached.contains(r), "reclaimed a block that was not cached");
                            assert!(!held.contains(r), "reclaimed a held block");
                        }
                        cached.retain(|c| !reclaimed.contains(c));
                        held.extend(blocks);
                    }
                    None => assert!(free_before < n, "refused {n} with {free_before} free"),
                }
            }
            Op::Retain(i) if !held.is_empty() => {
                let b = held[i % held.len()];
                let before = held.iter().filter(|&&x| x == b).count() as u32;
                assert_eq!(a.retain(b), Ok(Retained::Held(before + 1)));
                held.push(b);
            }
            Op::Release(i) if !held.is_empty() => {
                let b = held.swap_remove(i % held.len());
                let left = held.iter().filter(|&&x| x == b).count() as u32;
                assert_eq!(a.release(b), Ok(left));
                if left == 0 {
                    seen.push(b);
                    // Counts never underflow: one more release is an error.
                    assert_eq!(a.release(b), Err(PoolError::NotHeld { id: b }));
                }
            }
            Op::MarkCached(i) if !held.is_empty() => {
                let b = held[i % held.len()];
                a.mark_cached(b).unwrap();
                if !cached.contains(&b) {
                    cached.push(b);
                }
            }
            Op::ReviveStale(i) if !seen.is_empty() => {
                let b = seen[i % seen.len()];
                match a.retain(b) {
                    Ok(Retained::Held(1)) => {
                        assert!(cached.contains(&b), "revived an uncached block");
                        held.push(b);
                        seen.retain(|&x| x != b);
                    }
                    Ok(Retained::Reclaimed) => assert!(!cached.contains(&b)),
                    Err(PoolError::NotHeld { .. }) => assert!(!cached.contains(&b)),
                    other => panic!("unexpected retain outcome {other:?}"),
                }
            }
            _ => {}
        }
        // A block is free xor referenced, and bytes are exact.
        let mut distinct = held.clone();
        distinct.sort_unstable();
        distinct.dedup();
        for &b in &distinct {
            let n = held.iter().filter(|&&x| x == b).count() as u32;
            assert_eq!(a.ref_count(b), Ok(n));
        }
        let s = a.stats();
        assert_eq!(s.in_use, distinct.len(), "in_use counts referenced blocks");
        assert!(s.in_use <= capacity);
        assert_eq!(s.in_use_bytes, s.in_use as u64 * block_bytes);
        let cached_free = cached.iter().filter(|c| !held.contains(c)).count();
        assert_eq!(s.cached_free, cached_free, "cached-but-free blocks");
    }
    a.release_sequence(&held).unwrap();
    assert_eq!(a.stats().in_use, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pool_invariants_hold_under_random_ops(ops in prop::collection::vec(op(), 1..200)) {
        let pool = BlockPool::new(layout(), PoolConfig::fixed(6)).unwrap();
        check_invariants(&pool, 6, &ops);
    }

    #[test]
    fn growable_pool_invariants_hold_under_random_ops(ops in prop::collection::vec(op(), 1..200)) {
        let cfg = PoolConfig::fixed(0).with_growth_batch(2).with_max_blocks(7);
        let pool = BlockPool::new(layout(), cfg).unwrap();
        check_invariants(&pool, 7, &ops);
    }

    #[test]
    fn pool_and_reference_agree_on_reclaim_order(ops in prop::collection::vec(op(), 1..120)) {
        // Same ops on both: allocation outcomes and reclaim lists must match
        // while no revived block sits in a queue (CLOCK is an approximation of
        // the reference's exact LRU, so skip revivals here).
        let ops: Vec<Op> = ops.into_iter().filter(|o| !matches!(o, Op::ReviveStale(_))).collect();
        let pool = BlockPool::new(layout(), PoolConfig::fixed(5)).unwrap();
        let reference = ReferenceAllocator::new(5, layout().block_bytes());
        let mut held: Vec<(BlockId, BlockId)> = Vec::new();
        for op in &ops {
            match *op {
                Op::Allocate(n) => match (pool.allocate(n), reference.allocate(n)) {
                    (Some(p), Some(r)) => {
                        let map = |x: &BlockId| held.iter().find(|h| h.0 == *x).map(|h| h.1);
                        let _ = map;
                        prop_assert_eq!(p.reclaimed.len(), r.reclaimed.len());
                        held.extend(p.blocks.into_iter().zip(r.blocks));
                    }
                    (None, None) => {}
                    (p, r) => prop_assert!(false, "pool {:?} vs reference {:?}", p, r),
                },
                Op::Retain(i) if !held.is_empty() => {
                    let (p, r) = held[i % held.len()];
                    prop_assert_eq!(pool.retain(p).unwrap(), reference.retain(r).unwrap());
                    held.push((p, r));
                }
                Op::Release(i) if !held.is_empty() => {
                    let (p, r) = held.swap_remove(i % held.len());
                    prop_assert_eq!(pool.release(p).unwrap(), reference.release(r).unwrap());
                }
                Op::MarkCached(i) if !held.is_empty() => {
                    let (p, r) = held[i % held.len()];
                    pool.mark_cached(p).unwrap();
                    reference.mark_cached(r).unwrap();
                }
                _ => {}
            }
            let (ps, rs) = (pool.stats(), reference.stats());
            prop_assert_eq!((ps.in_use, ps.cached_free), (rs.in_use, rs.cached_free));
        }
    }
}

/// xorshift64*: a tiny deterministic RNG for the stress test.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// ≥ 8 threads, ≥ 10^6 random operations on a small pool with shared,
/// cached and revived blocks; ends with zero leaked blocks.
#[test]
fn stress_eight_threads_a_million_ops_leak_nothing() {
    const THREADS: u64 = 8;
    const OPS_PER_THREAD: u64 = 125_000;
    let cfg = PoolConfig::fixed(16)
        .with_growth_batch(16)
        .with_max_blocks(64);
    let pool = BlockPool::new(layout(), cfg).unwrap();
    // A few long-lived shared blocks every thread retains and releases.
    let shared = pool.allocate(4).unwrap().blocks;
    for &b in &shared {
        pool.mark_cached(b).unwrap();
    }
    let failed = AtomicBool::new(false);
    let revived_total = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (pool, shared, failed, revived_total) = (&pool, &shared, &failed, &revived_total);
            s.spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
                let mut mine: Vec<BlockId> = Vec::new();
                let mut dropped_cached: Vec<BlockId> = Vec::new();
                let mut revived = 0u64;
                for _ in 0..OPS_PER_THREAD {
                    let r = rng.next();
                    match r % 8 {
                        0 | 1 => {
                            if let Some(a) = pool.allocate(1 + (r >> 8) as usize % 4) {
                                mine.extend(a.blocks);
                            }
                        }
                        2 | 3 if !mine.is_empty() => {
                            let b = mine.swap_remove((r >> 8) as usize % mine.len());
                            let cached = pool.ref_count(b).is_ok() && (r >> 20) % 2 == 0;
                            if cached {
                                pool.mark_cached(b).unwrap();
                            }
                            if pool.release(b).unwrap() == 0 && cached {
                                dropped_cached.push(b);
                            }
                        }
                        4 => {
                            let b = shared[(r >> 8) as usize % shared.len()];
                            assert!(matches!(pool.retain(b), Ok(Retained::Held(_))));
                            mine.push(b);
                        }
                        5 if !dropped_cached.is_empty() => {
                            let b = dropped_cached
                                .swap_remove((r >> 8) as usize % dropped_cached.len());
                            match pool.retain(b) {
                                Ok(Retained::Held(_)) => {
                                    revived += 1;
                                    mine.push(b);
                                }
                                Ok(Retained::Reclaimed) => {}
                                Err(e) => {
                                    failed.store(true, Ordering::Relaxed);
                                    panic!("retain of a cached handle failed: {e}");
                                }
                            }
                        }
                        6 if !mine.is_empty() => {
                            let b = mine[(r >> 8) as usize % mine.len()];
                            assert!(matches!(pool.retain(b), Ok(Retained::Held(_))));
                            mine.push(b);
                        }
                        _ => {
                            if mine.len() > 32 {
                                pool.release_sequence(&mine).unwrap();
                                mine.clear();
                            }
                        }
                    }
                }
                pool.release_sequence(&mine).unwrap();
                revived_total.fetch_add(revived, Ordering::Relaxed);
            });
        }
    });
    assert!(!failed.load(Ordering::Relaxed));
    for &b in &shared {
        assert_eq!(pool.ref_count(b), Ok(1), "shared blocks back to one owner");
    }
    pool.release_sequence(&shared).unwrap();
    let s = pool.stats();
    assert_eq!(s.in_use, 0, "leaked blocks: {s:?}");
    assert_eq!(s.in_use_bytes, 0);
    assert!(s.capacity <= 64);
    // Every block must be allocatable again: nothing was lost from the free lists.
    let all = pool
        .allocate(s.capacity)
        .expect("every block is free again");
    assert_eq!(all.blocks.len(), s.capacity);
    assert!(
        revived_total.load(Ordering::Relaxed) > 0,
        "the revive path was exercised"
    );
}
