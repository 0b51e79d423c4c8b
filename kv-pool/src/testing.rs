//! The conformance suite every [`BlockAllocator`] must pass.
//!
//! ```
//! use kvforge_pool::{testing, BlockPool, KvLayout, PoolConfig, StorageFormat};
//! let layout = KvLayout::new(2, 1, 8, 4, StorageFormat::F16).unwrap();
//! testing::check_allocator(|blocks| BlockPool::new(layout, PoolConfig::fixed(blocks)).unwrap());
//! ```
//!
//! `make(n)` must return an allocator with exactly `n` blocks and no growth.
//! The suite panics (with the failing property) on the first violation, so
//! call it from a `#[test]`.

use crate::error::PoolError;
use crate::{Allocation, BlockAllocator, BlockId, Retained};

/// Runs every conformance check against allocators built by `make`.
pub fn check_allocator<A: BlockAllocator>(make: impl Fn(usize) -> A) {
    allocate_hands_out_distinct_held_blocks(&make(8));
    exhaustion_is_all_or_nothing(&make(4));
    retain_and_release_count_references(&make(2));
    bad_handles_are_errors_and_change_nothing(&make(2));
    cached_blocks_are_revived_or_reclaimed(&make(2));
    release_sequence_checks_before_releasing(&make(4));
    bytes_follow_blocks(&make(5));
    concurrent_sharing_leaks_nothing(&make(16));
}

fn assert_quiescent_empty<A: BlockAllocator>(a: &A) {
    let s = a.stats();
    assert_eq!(s.in_use, 0, "blocks leaked: {s:?}");
    assert_eq!(s.in_use_bytes, 0, "bytes leaked: {s:?}");
}

fn allocate_hands_out_distinct_held_blocks<A: BlockAllocator>(a: &A) {
    let empty = a
        .allocate(0)
        .expect("allocating zero blocks always succeeds");
    assert!(empty.blocks.is_empty());
    let got = a.allocate(8).expect("8 of 8 free blocks");
    assert_eq!(got.blocks.len(), 8);
    let mut idx: Vec<u32> = got.blocks.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), 8, "allocate returned a block twice");
    for &b in &got.blocks {
        assert_eq!(a.ref_count(b), Ok(1));
    }
    assert!(got.reclaimed.is_empty(), "nothing was cached");
    assert_eq!(a.stats().in_use, 8);
    a.release_sequence(&got.blocks)
        .expect("release held blocks");
    assert_quiescent_empty(a);
}

fn exhaustion_is_all_or_nothing<A: BlockAllocator>(a: &A) {
    let held = a.allocate(3).expect("3 of 4");
    let before = a.stats();
    let mut out = Allocation::default();
    assert!(!a.allocate_into(2, &mut out), "only 1 block is free");
    assert_eq!(
        out,
        Allocation::default(),
        "a failed allocation touches nothing"
    );
    assert_eq!(a.stats(), before);
    let last = a.allocate(1).expect("the last block");
    a.release_sequence(&held.blocks).expect("release");
    a.release_sequence(&last.blocks).expect("release");
    assert_quiescent_empty(a);
}

fn retain_and_release_count_references<A: BlockAllocator>(a: &A) {
    let b = a.allocate(1).expect("1 of 2").blocks[0];
    assert_eq!(a.retain(b), Ok(Retained::Held(2)));
    assert_eq!(a.retain(b), Ok(Retained::Held(3)));
    assert_eq!(a.stats().in_use, 1, "sharing does not consume blocks");
    assert_eq!(a.release(b), Ok(2));
    assert_eq!(a.release(b), Ok(1));
    assert_eq!(a.release(b), Ok(0));
    assert_quiescent_empty(a);
}

fn bad_handles_are_errors_and_change_nothing<A: BlockAllocator>(a: &A) {
    let b = a.allocate(1).expect("1 of 2").blocks[0];
    a.release(b).expect("release");
    let before = a.stats();
    assert_eq!(
        a.release(b),
        Err(PoolError::NotHeld { id: b }),
        "double free"
    );
    assert_eq!(
        a.retain(b),
        Err(PoolError::NotHeld { id: b }),
        "retain of an uncached free block"
    );
    assert_eq!(a.mark_cached(b), Err(PoolError::NotHeld { id: b }));
    let unknown = BlockId::new(1_000_000, 0);
    assert!(matches!(
        a.release(unknown),
        Err(PoolError::UnknownBlock { .. })
    ));
    assert!(matches!(
        a.retain(unknown),
        Err(PoolError::UnknownBlock { .. })
    ));
    assert!(matches!(
        a.ref_count(unknown),
        Err(PoolError::UnknownBlock { .. })
    ));
    assert_eq!(a.stats(), before, "errors change nothing");
    // A handle from before a reuse is stale, not the new owner's.
    let all = a.allocate(2).expect("2 of 2");
    let reused = all.blocks.iter().find(|x| x.index() == b.index()).copied();
    if let Some(new) = reused {
        assert_ne!(new, b);
        assert!(matches!(a.release(b), Err(PoolError::StaleBlock { .. })));
        assert_eq!(a.ref_count(new), Ok(1));
    }
    a.release_sequence(&all.blocks).expect("release");
    assert_quiescent_empty(a);
}

fn cached_blocks_are_revived_or_reclaimed<A: BlockAllocator>(a: &A) {
    let b = a.allocate(1).expect("1 of 2").blocks[0];
    a.mark_cached(b).expect("mark a held block");
    assert_eq!(a.release(b), Ok(0));
    assert_eq!(a.stats().cached_free, 1);
    assert_eq!(a.stats().in_use, 0);
    // Revive: a prefix hit on a free cached block.
    assert_eq!(a.retain(b), Ok(Retained::Held(1)));
    assert_eq!(a.stats().cached_free, 0);
    assert_eq!(a.stats().in_use, 1);
    assert_eq!(a.release(b), Ok(0));
    // Exhaust the pool: the cached block's content is reclaimed.
    let all = a.allocate(2).expect("cached blocks count as free");
    assert_eq!(
        all.reclaimed,
        vec![b],
        "the old handle is reported for the index"
    );
    assert_eq!(a.stats().cached_free, 0);
    assert_eq!(a.retain(b), Ok(Retained::Reclaimed));
    assert!(matches!(a.release(b), Err(PoolError::StaleBlock { .. })));
    a.release_sequence(&all.blocks).expect("release");
    assert_quiescent_empty(a);
}

fn release_sequence_checks_before_releasing<A: BlockAllocator>(a: &A) {
    let got = a.allocate(3).expect("3 of 4");
    let free = a.allocate(1).expect("1").blocks[0];
    a.release(free).expect("release");
    let mut bad = got.blocks.clone();
    bad.push(free);
    let before = a.stats();
    assert!(a.release_sequence(&bad).is_err());
    assert_eq!(a.stats(), before, "nothing released on error");
    let twice = [got.blocks[0], got.blocks[0]];
    assert_eq!(
        a.release_sequence(&twice),
        Err(PoolError::NotHeld { id: got.blocks[0] }),
        "a block listed twice needs two references"
    );
    a.release_sequence(&got.blocks).expect("release");
    assert_quiescent_empty(a);
}

fn bytes_follow_blocks<A: BlockAllocator>(a: &A) {
    let s = a.stats();
    assert!(s.block_bytes > 0);
    assert_eq!(s.capacity_bytes, s.capacity as u64 * s.block_bytes);
    let got = a.allocate(3).expect("3 of 5");
    let s = a.stats();
    assert_eq!(s.in_use_bytes, 3 * s.block_bytes);
    assert!((s.utilization() - 3.0 / s.max_blocks as f64).abs() < 1e-12);
    a.release_sequence(&got.blocks).expect("release");
    assert_quiescent_empty(a);
}

fn concurrent_sharing_leaks_nothing<A: BlockAllocator>(a: &A) {
    let shared = a.allocate(4).expect("4 of 16");
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let shared = &shared.blocks;
            s.spawn(move || {
                for i in 0..2_000u32 {
                    let b = shared[((i + t) % 4) as usize];
                    assert!(matches!(a.retain(b), Ok(Retained::Held(_))));
                    if let Some(mine) = a.allocate(1 + (i % 3) as usize) {
                        a.release_sequence(&mine.blocks)
                            .expect("release own blocks");
                    }
                    a.release(b).expect("release shared block");
                }
            });
        }
    });
    for &b in &shared.blocks {
        assert_eq!(a.ref_count(b), Ok(1), "shared counts back to the owner's");
    }
    a.release_sequence(&shared.blocks).expect("release");
    assert_quiescent_empty(a);
}
