//! Unit tests of BlockPool: growth, reclaim order, stale handles, epochs.

use super::*;
use crate::Retained;
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
