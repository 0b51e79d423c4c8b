//! Integration tests of `kvforge-pool`: the conformance suite on every
//! allocator, property tests of the invariants, and a multi-threaded stress
//! test on shared blocks.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used)]

mod util;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use kvforge_pool::{
    Allocation, BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, PoolError, Retained,
    StorageFormat, TieredPool, testing,
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

/// Monotonic event counters of the stress test, for bounding `stats()`.
#[derive(Default)]
struct Events {
    /// Blocks an `allocate` or a revival was asked for / got / did not get.
    claim_started: AtomicU64,
    claim_done: AtomicU64,
    claim_aborted: AtomicU64,
    /// Blocks whose last reference is being / has been released.
    free_started: AtomicU64,
    free_done: AtomicU64,
    /// Outcomes that must never happen in this workload.
    spurious_none: AtomicU64,
    spurious_reclaimed: AtomicU64,
    ops: AtomicU64,
    checks: AtomicU64,
}

fn bump(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::SeqCst);
}

/// Releases every reference in `mine` (tail first) and records the blocks
/// that go free (a block listed once is held by this thread alone).
fn release_all(pool: &BlockPool, mine: &mut Vec<BlockId>, shared: &[BlockId], ev: &Events) {
    let mut distinct: Vec<BlockId> = mine
        .iter()
        .copied()
        .filter(|b| !shared.contains(b))
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    bump(&ev.free_started, distinct.len());
    pool.release_sequence(mine).unwrap();
    bump(&ev.free_done, distinct.len());
    mine.clear();
}

/// ≥ 8 threads, ≥ 10^6 random operations, with shared, cached and revived
/// blocks, on a pool whose cap covers the largest possible demand, so every
/// `None` is spurious, and so is every `Reclaimed` whose epoch still matches:
/// both are counted and must be zero. Every 32 of its operations each
/// worker checks `stats()` against the event counters, mid-run. Ends with
/// zero leaked blocks.
///
/// With a roomy cap, cached blocks pile up and the pool grows throughout the
/// run; with a tight one it reaches the cap early and reclaims cached blocks
/// for the rest.
#[test]
fn stress_eight_threads_a_million_ops_growing_throughout() {
    let growth = stress(1 << 20);
    let late = growth
        .iter()
        .filter(|&&(op, _)| op > STRESS_OPS * 3 / 4)
        .count();
    assert!(late > 0, "no growth in the last quarter: {growth:?}");
}

#[test]
fn stress_eight_threads_a_million_ops_reclaiming_at_the_cap() {
    let growth = stress(STRESS_CAP);
    assert_eq!(
        growth.last().map(|g| g.1),
        Some(STRESS_CAP),
        "reached the cap"
    );
}

const THREADS: u64 = 8;
const OPS_PER_THREAD: u64 = 125_000;
const STRESS_OPS: u64 = THREADS * OPS_PER_THREAD;
const MAX_HELD: usize = 32;
/// Per thread at most `MAX_HELD - 1 + 4` distinct blocks, plus 4 shared.
const STRESS_CAP: usize = THREADS as usize * (MAX_HELD + 4) + 4 + 28;

/// Runs the workload; returns `(operations done, capacity)` at each growth
/// the checks saw.
fn stress(cap: usize) -> Vec<(u64, usize)> {
    let cfg = PoolConfig::fixed(4)
        .with_growth_batch(4)
        .with_max_blocks(cap);
    let pool = BlockPool::new(layout(), cfg).unwrap();
    // A few long-lived shared blocks every thread retains and releases.
    let shared = pool.allocate(4).unwrap().blocks;
    for &b in &shared {
        pool.mark_cached(b).unwrap();
    }
    let ev = Events::default();
    let revived_total = AtomicU64::new(0);
    let growth = std::sync::Mutex::new(Vec::new());
    let seen_capacity = AtomicUsize::new(0);
    // Called by every worker between its own operations, so only the other
    // threads' calls are in flight.
    let check_stats = || {
        let claimed = ev.claim_done.load(Ordering::SeqCst);
        let aborted = ev.claim_aborted.load(Ordering::SeqCst);
        let freed = ev.free_done.load(Ordering::SeqCst);
        let st = pool.stats();
        let started = ev.claim_started.load(Ordering::SeqCst);
        let freeing = ev.free_started.load(Ordering::SeqCst);
        let lo = (4 + claimed).saturating_sub(freeing);
        let hi = 4 + started - aborted - freed;
        assert!(
            lo <= st.in_use as u64 && st.in_use as u64 <= hi,
            "in_use {} outside [{lo}, {hi}]: {st:?}",
            st.in_use
        );
        assert!(st.in_use + st.cached_free <= st.capacity, "{st:?}");
        assert!(st.capacity <= cap, "{st:?}");
        if seen_capacity.fetch_max(st.capacity, Ordering::SeqCst) < st.capacity {
            let op = ev.ops.load(Ordering::SeqCst);
            growth.lock().unwrap().push((op, st.capacity));
        }
        ev.checks.fetch_add(1, Ordering::Relaxed);
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (pool, shared, ev, revived_total) = (&pool, &shared, &ev, &revived_total);
                let check_stats = &check_stats;
                s.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
                    let mut mine: Vec<BlockId> = Vec::new();
                    let mut dropped_cached: Vec<BlockId> = Vec::new();
                    let mut revived = 0u64;
                    for i in 0..OPS_PER_THREAD {
                        ev.ops.fetch_add(1, Ordering::Relaxed);
                        if i % 32 == 0 {
                            check_stats();
                        }
                        // The working set grows over the run, so does the pool.
                        let limit = 2 + (MAX_HELD - 2) * i as usize / OPS_PER_THREAD as usize;
                        let r = rng.next();
                        match r % 8 {
                            0 | 1 if mine.len() < limit => {
                                let n = 1 + (r >> 8) as usize % 4;
                                bump(&ev.claim_started, n);
                                match pool.allocate(n) {
                                    Some(a) => {
                                        bump(&ev.claim_done, n);
                                        mine.extend(a.blocks);
                                    }
                                    None => {
                                        bump(&ev.claim_aborted, n);
                                        bump(&ev.spurious_none, 1);
                                    }
                                }
                            }
                            2 | 3 if !mine.is_empty() => {
                                let b = mine.swap_remove((r >> 8) as usize % mine.len());
                                let last = !shared.contains(&b) && !mine.contains(&b);
                                if last && (r >> 20) % 2 == 0 {
                                    pool.mark_cached(b).unwrap();
                                }
                                bump(&ev.free_started, usize::from(last));
                                let left = pool.release(b).unwrap();
                                bump(&ev.free_done, usize::from(last));
                                assert_eq!(left == 0, last);
                                if last && (r >> 20) % 2 == 0 {
                                    dropped_cached.push(b);
                                }
                            }
                            4 => {
                                let b = shared[(r >> 8) as usize % shared.len()];
                                assert!(matches!(pool.retain(b), Ok(Retained::Held(_))));
                                mine.push(b);
                            }
                            5 if !dropped_cached.is_empty() && mine.len() < limit => {
                                let b = dropped_cached
                                    .swap_remove((r >> 8) as usize % dropped_cached.len());
                                bump(&ev.claim_started, 1);
                                match pool.retain(b) {
                                    Ok(Retained::Held(1)) => {
                                        bump(&ev.claim_done, 1);
                                        revived += 1;
                                        mine.push(b);
                                    }
                                    Ok(Retained::Reclaimed) => {
                                        bump(&ev.claim_aborted, 1);
                                        if pool.ref_count(b).is_ok() {
                                            bump(&ev.spurious_reclaimed, 1);
                                        }
                                    }
                                    other => panic!("revival of a private cached block: {other:?}"),
                                }
                            }
                            6 if !mine.is_empty() => {
                                let b = mine[(r >> 8) as usize % mine.len()];
                                assert!(matches!(pool.retain(b), Ok(Retained::Held(_))));
                                mine.push(b);
                            }
                            7 if mine.len() >= limit => release_all(pool, &mut mine, shared, ev),
                            _ => {}
                        }
                    }
                    release_all(pool, &mut mine, shared, ev);
                    revived_total.fetch_add(revived, Ordering::Relaxed);
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
    });
    assert_eq!(
        ev.spurious_none.load(Ordering::SeqCst),
        0,
        "allocate failed below the cap's demand"
    );
    assert_eq!(
        ev.spurious_reclaimed.load(Ordering::SeqCst),
        0,
        "retain answered Reclaimed for a block whose epoch still matched"
    );
    for &b in &shared {
        assert_eq!(pool.ref_count(b), Ok(1), "shared blocks back to one owner");
    }
    pool.release_sequence(&shared).unwrap();
    let s = pool.stats();
    assert_eq!(s.in_use, 0, "leaked blocks: {s:?}");
    assert_eq!(s.in_use_bytes, 0);
    assert!(s.capacity <= cap);
    // Every block must be allocatable again: nothing was lost from the free lists.
    let all = pool
        .allocate(s.capacity)
        .expect("every block is free again");
    assert_eq!(all.blocks.len(), s.capacity);
    assert!(
        revived_total.load(Ordering::Relaxed) > 0,
        "the revive path was exercised"
    );
    assert!(ev.checks.load(Ordering::Relaxed) >= STRESS_OPS / 32);
    growth.into_inner().unwrap()
}

/// Threads only retain and release the one cached block of a one-block pool:
/// nothing is ever allocated, so its content can never be reclaimed, and
/// `Reclaimed` is always wrong.
#[test]
fn retain_and_release_alone_never_report_reclaimed() {
    let pool = BlockPool::new(layout(), PoolConfig::fixed(1)).unwrap();
    let b = pool.allocate(1).unwrap().blocks[0];
    pool.mark_cached(b).unwrap();
    pool.release(b).unwrap();
    let reclaimed = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..100_000 {
                    match pool.retain(b).unwrap() {
                        Retained::Held(_) => {
                            pool.release(b).unwrap();
                        }
                        Retained::Reclaimed => {
                            reclaimed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    assert_eq!(reclaimed.load(Ordering::Relaxed), 0, "spurious Reclaimed");
    assert_eq!(pool.ref_count(b), Ok(0));
    assert_eq!(pool.stats().cached_free, 1);
}

/// Two threads revive and release a cached block while a third allocates
/// and releases one block: a fresh block is free throughout, so the
/// allocation never fails and never takes the cached block.
#[test]
fn revivals_never_starve_an_allocation() {
    let pool = BlockPool::new(layout(), PoolConfig::fixed(2)).unwrap();
    let b = pool.allocate(1).unwrap().blocks[0];
    pool.mark_cached(b).unwrap();
    pool.release(b).unwrap();
    let (none, reclaimed) = (AtomicU64::new(0), AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    match pool.retain(b).unwrap() {
                        Retained::Held(_) => {
                            pool.release(b).unwrap();
                        }
                        Retained::Reclaimed => {
                            reclaimed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        s.spawn(|| {
            for _ in 0..200_000 {
                match pool.allocate(1) {
                    Some(a) => {
                        assert!(a.reclaimed.is_empty());
                        pool.release(a.blocks[0]).unwrap();
                    }
                    None => {
                        none.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    assert_eq!(none.load(Ordering::Relaxed), 0, "spurious None");
    assert_eq!(reclaimed.load(Ordering::Relaxed), 0, "spurious Reclaimed");
}

/// 3,000 trials of four threads each allocating one block at once from an
/// empty pool that grows in batches of 64 up to `max_blocks`: returns
/// (allocations that got `None`, trials that grew more than one batch).
fn first_allocations(max_blocks: usize) -> (usize, usize) {
    let (mut none, mut overshoot) = (0, 0);
    for _ in 0..3_000 {
        let cfg = PoolConfig::fixed(0)
            .with_growth_batch(64)
            .with_max_blocks(max_blocks);
        let pool = BlockPool::new(layout(), cfg).unwrap();
        let barrier = std::sync::Barrier::new(4);
        let got: Vec<Option<Allocation>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        pool.allocate(1)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        none += got.iter().filter(|a| a.is_none()).count();
        overshoot += usize::from(pool.stats().capacity != 64);
    }
    (none, overshoot)
}

/// Never `None`, and never more than the one batch the four need.
#[test]
fn concurrent_first_allocations_grow_exactly_one_batch() {
    assert_eq!(
        first_allocations(256),
        (0, 0),
        "(spurious None, trials over one batch)"
    );
}

/// At a cap of exactly one batch: growth in flight is not exhaustion.
#[test]
fn growth_in_flight_is_not_exhaustion() {
    assert_eq!(
        first_allocations(64).0,
        0,
        "spurious None while a batch was being published"
    );
}

#[test]
fn tiered_pool_passes_the_conformance_suite() {
    testing::check_allocator(|n| TieredPool::new([(layout(), PoolConfig::fixed(n))]).unwrap());
}

#[test]
fn tiers_have_disjoint_handles_and_their_own_bytes() {
    let hot = layout();
    let cold = hot
        .with_format(StorageFormat::Int4 { group_size: 32 })
        .unwrap();
    let pool =
        TieredPool::new([(hot, PoolConfig::fixed(4)), (cold, PoolConfig::fixed(4))]).unwrap();
    let mut a = Allocation::default();
    assert!(pool.allocate_in(0, 2, &mut a).unwrap());
    assert!(pool.allocate_in(1, 2, &mut a).unwrap());
    let ids = a.blocks.clone();
    assert_eq!(
        ids.iter()
            .map(|&b| TieredPool::tier_of(b))
            .collect::<Vec<_>>(),
        [0, 0, 1, 1]
    );
    // Same slots in both tiers, different global handles.
    assert_eq!(TieredPool::slot_of(ids[0]), TieredPool::slot_of(ids[2]));
    assert_ne!(ids[0], ids[2]);
    assert_eq!(pool.retain(ids[2]).unwrap(), Retained::Held(2));
    assert_eq!(pool.release(ids[2]).unwrap(), 1);
    let s1 = pool.tier_stats(1).unwrap();
    assert_eq!(s1.in_use_bytes, 2 * cold.block_bytes());
    assert_eq!(
        pool.in_use_bytes(),
        2 * hot.block_bytes() + 2 * cold.block_bytes()
    );
    assert_eq!(pool.stats().in_use, 4);
    // A handle of a tier that does not exist, and a tier out of range.
    let bogus = BlockId::new(5 << 28, 1);
    assert!(matches!(
        pool.release(bogus),
        Err(PoolError::UnknownTier { tier: 5, tiers: 2 })
    ));
    assert!(pool.allocate_in(3, 1, &mut a).is_err());
    assert!(!pool.allocate_in(1, 3, &mut a).unwrap());
    pool.release_sequence(&ids).unwrap();
    assert_eq!(pool.stats().in_use, 0);
    assert!(TieredPool::new(Vec::new()).is_err());
    let too_many = (0..17).map(|_| (hot, PoolConfig::fixed(1)));
    assert!(TieredPool::new(too_many).is_err());
}
