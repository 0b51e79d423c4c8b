//! Loom models of the pool's races: revival, release, reuse, growth and the
//! fresh stacks.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kvforge-pool --test loom --release`
//! (`cargo xtask ci` does). Each model was checked to fail on the code it
//! guards against (see the crate README, "Tests").
#![cfg(loom)]
#![allow(clippy::unwrap_used)]

use kvforge_pool::{
    BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, Retained, StorageFormat,
};
use loom::sync::Arc;

fn layout() -> KvLayout {
    KvLayout::new(1, 1, 4, 1, StorageFormat::F16).unwrap()
}

fn pool(blocks: usize) -> BlockPool {
    BlockPool::new(layout(), PoolConfig::fixed(blocks)).unwrap()
}

/// Explores every interleaving with up to three preemptions (loom's
/// recommended bound: exhaustive search of four threads does not finish).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
}

/// A cached block, released to count 0 (free but revivable).
fn cached_free_block(p: &BlockPool) -> BlockId {
    let b = p.allocate(1).unwrap().blocks[0];
    p.mark_cached(b).unwrap();
    p.release(b).unwrap();
    b
}

/// After the model's threads are done and every block was released: all
/// blocks are free, each exactly once, and nothing more.
fn assert_all_free_exactly_once(p: &BlockPool) {
    let s = p.stats();
    assert_eq!(s.in_use, 0, "{s:?}");
    let all = p.allocate(s.capacity).expect("every block is free again");
    let mut idx: Vec<u32> = all.blocks.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), s.capacity, "a block was handed out twice");
    if s.capacity == s.max_blocks {
        assert!(p.allocate(1).is_none(), "a block sits twice in a free list");
    }
    p.release_sequence(&all.blocks).unwrap();
}

/// The main thread drops the last reference of a cached block while thread B
/// revives it through its old handle (a prefix hit) and thread C allocates.
/// Exactly one of B and C ends up with the block; counts and the free list
/// stay consistent.
#[test]
fn revive_races_with_release_and_reuse() {
    model(|| {
        let p = Arc::new(pool(1));
        let b = p.allocate(1).unwrap().blocks[0];
        p.mark_cached(b).unwrap();

        let pb = p.clone();
        let revive = loom::thread::spawn(move || pb.retain(b).unwrap());
        let pc = p.clone();
        let alloc = loom::thread::spawn(move || pc.allocate(1));
        p.release(b).unwrap();

        let revived = revive.join().unwrap();
        let got = alloc.join().unwrap();
        match (revived, got) {
            (Retained::Held(_), None) => {
                assert_eq!(p.stats().in_use, 1);
                assert_eq!(p.ref_count(b), Ok(1));
                assert!(p.release(b).is_ok());
            }
            (Retained::Held(_), Some(_)) => panic!("a held block was handed out again"),
            (Retained::Reclaimed, Some(a)) => {
                assert_eq!(a.reclaimed, vec![b]);
                assert_eq!(p.ref_count(a.blocks[0]), Ok(1));
                assert!(p.release(b).is_err(), "the old handle is stale");
                p.release(a.blocks[0]).unwrap();
            }
            (Retained::Reclaimed, None) => panic!("the block was neither revived nor reused"),
        }
        assert_all_free_exactly_once(&p);
    });
}

/// Two threads release the two last references of a block while a third
/// allocates: the block goes back to the free list exactly once.
#[test]
fn concurrent_last_releases_free_once() {
    model(|| {
        let p = Arc::new(pool(1));
        let b = p.allocate(1).unwrap().blocks[0];
        p.retain(b).map(|_| ()).unwrap();
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                loom::thread::spawn(move || p.release(b).unwrap())
            })
            .collect();
        let pc = p.clone();
        let alloc = loom::thread::spawn(move || pc.allocate(1));
        let mut left: Vec<u32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        left.sort_unstable();
        assert_eq!(left, vec![0, 1]);
        if let Some(a) = alloc.join().unwrap() {
            p.release(a.blocks[0]).unwrap();
        }
        assert_all_free_exactly_once(&p);
    });
}

/// Two prefix hits on the same cached free block at once (the shared system
/// prompt): both must get it, since its content is there all along.
#[test]
fn two_revivers_of_one_block_both_hold_it() {
    model(|| {
        let p = Arc::new(pool(1));
        let b = cached_free_block(&p);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                loom::thread::spawn(move || p.retain(b).unwrap())
            })
            .collect();
        let mut got: Vec<Retained> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        got.sort_by_key(|r| match r {
            Retained::Held(n) => *n,
            Retained::Reclaimed => 0,
        });
        assert_eq!(got, vec![Retained::Held(1), Retained::Held(2)]);
        assert_eq!(p.ref_count(b), Ok(2));
        assert_eq!(p.stats().cached_free, 0);
        p.release(b).unwrap();
        p.release(b).unwrap();
        assert_eq!(p.stats().cached_free, 1);
        assert_all_free_exactly_once(&p);
    });
}

/// Two revivers of a cached block race an allocation while a fresh block is
/// free throughout: the allocation gets the fresh block (never `None`), and
/// both revivers hold the cached one (never `Reclaimed`).
#[test]
fn revival_racing_allocation_takes_nothing_it_should_not() {
    model(|| {
        let p = Arc::new(pool(2));
        let b = cached_free_block(&p);
        let revivers: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                loom::thread::spawn(move || p.retain(b).unwrap())
            })
            .collect();
        let pc = p.clone();
        let alloc = loom::thread::spawn(move || pc.allocate(1));
        for r in revivers {
            assert!(matches!(r.join().unwrap(), Retained::Held(_)));
        }
        let a = alloc
            .join()
            .unwrap()
            .expect("a fresh block was free throughout");
        assert!(a.reclaimed.is_empty(), "fresh blocks go first");
        assert_ne!(a.blocks[0].index(), b.index());
        p.release(a.blocks[0]).unwrap();
        p.release(b).unwrap();
        p.release(b).unwrap();
        assert_all_free_exactly_once(&p);
    });
}

/// A block revived and released while queued gets a second chance against a
/// concurrent allocation at the cap (the CLOCK path), or is reclaimed before
/// the revival: either way exactly one owner at a time, nothing lost.
#[test]
fn second_chance_races_allocation_at_the_cap() {
    model(|| {
        let p = Arc::new(pool(1));
        let b = cached_free_block(&p);
        let pa = p.clone();
        let touch = loom::thread::spawn(move || match pa.retain(b).unwrap() {
            Retained::Held(1) => {
                pa.release(b).unwrap();
                true
            }
            Retained::Held(n) => panic!("count {n} on a block nobody else holds"),
            Retained::Reclaimed => false,
        });
        let pc = p.clone();
        let alloc = loom::thread::spawn(move || pc.allocate(1));
        let touched = touch.join().unwrap();
        match alloc.join().unwrap() {
            Some(a) => {
                assert_eq!(a.reclaimed, vec![b]);
                p.release(a.blocks[0]).unwrap();
            }
            // Only while the reviver held the block.
            None => assert!(touched),
        }
        assert_all_free_exactly_once(&p);
    });
}

/// Two threads allocate one block each from an empty growable pool: both
/// succeed (growth in flight is not exhaustion) and exactly one batch is
/// added (a thread that waited for the growth lock does not add another).
#[test]
fn growth_races_allocation() {
    model(|| {
        let cfg = PoolConfig::fixed(0).with_growth_batch(2).with_max_blocks(4);
        let p = Arc::new(BlockPool::new(layout(), cfg).unwrap());
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                loom::thread::spawn(move || p.allocate(1))
            })
            .collect();
        let s = p.stats();
        assert!(s.in_use <= s.capacity && s.capacity <= 4, "{s:?}");
        let got: Vec<_> = threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap()
                    .expect("growth in flight is not exhaustion")
            })
            .collect();
        assert_eq!(p.stats().capacity, 2, "one batch covers both");
        assert_ne!(got[0].blocks[0], got[1].blocks[0]);
        for a in got {
            p.release(a.blocks[0]).unwrap();
        }
        assert_all_free_exactly_once(&p);
    });
}

/// Three fresh blocks on one stack: one thread pops while another pops two
/// and pushes the first back (the ABA pattern). The tag on the stack head
/// must make the first pop retry; without it a held block is left on the
/// stack and is handed out twice.
#[test]
fn fresh_stack_survives_aba() {
    model(|| {
        // Growth spreads blocks 0, 1, 2 over shards 0, 1, 2; releasing them
        // on the main thread (home shard 0 under loom) stacks all three on
        // shard 0, tail first: [b0, b1, b2] with b0 on top.
        let p = Arc::new(pool(3));
        let all = p.allocate(3).unwrap();
        p.release_sequence(&all.blocks).unwrap();
        let p1 = p.clone();
        let one = loom::thread::spawn(move || {
            let a = p1.allocate(1).unwrap();
            p1.release(a.blocks[0]).unwrap();
        });
        let p2 = p.clone();
        let two = loom::thread::spawn(move || {
            let a = p2.allocate(2).unwrap();
            p2.release(a.blocks[0]).unwrap();
            a.blocks[1]
        });
        one.join().unwrap();
        let still_held = two.join().unwrap();
        assert_eq!(p.ref_count(still_held), Ok(1));
        let rest = p.allocate(2).expect("two blocks are free");
        assert!(
            rest.blocks.iter().all(|b| b.index() != still_held.index()),
            "a held block was handed out again"
        );
        assert!(p.allocate(1).is_none());
        p.release_sequence(&rest.blocks).unwrap();
        p.release(still_held).unwrap();
        assert_all_free_exactly_once(&p);
    });
}
