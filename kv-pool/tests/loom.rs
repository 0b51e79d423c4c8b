//! Loom model of the retain / release / reuse race on one cached block.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p kvforge-pool --test loom --release`
//! (`cargo xtask ci` does).
#![cfg(loom)]
#![allow(clippy::unwrap_used)]

use kvforge_pool::{BlockAllocator, BlockPool, KvLayout, PoolConfig, Retained, StorageFormat};
use loom::sync::Arc;

fn pool(blocks: usize) -> BlockPool {
    let layout = KvLayout::new(1, 1, 4, 1, StorageFormat::F16).unwrap();
    BlockPool::new(layout, PoolConfig::fixed(blocks)).unwrap()
}

/// Explores every interleaving with up to three preemptions (loom's
/// recommended bound: exhaustive search of four threads does not finish).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(f);
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
            (Retained::Reclaimed, None) => {
                // Allowed only if the allocator lost the race for the unit
                // and the block is still free: then it must be allocatable.
                let a = p.allocate(1).expect("the block is free");
                p.release(a.blocks[0]).unwrap();
            }
        }
        assert_eq!(p.stats().in_use, 0);
        let s = p.stats();
        assert_eq!(s.capacity, 1);
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
        assert_eq!(p.stats().in_use, 0);
        assert!(p.allocate(2).is_none());
        let again = p.allocate(1).expect("exactly one free block");
        p.release(again.blocks[0]).unwrap();
    });
}
