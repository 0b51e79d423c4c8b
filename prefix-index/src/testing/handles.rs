//! Blocks forgotten, relocated, reused and stale: what the index answers
//! for a handle after the pool changed it.

use super::{block, full_blocks, ids, seq};
use crate::{BlockRef, ExtraKeys, PrefixMatcher};
use kvforge_pool::BlockId;

pub(super) fn forgotten_blocks_end_the_match<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..16), &e, &full_blocks(0, 4, 4))
        .expect("insert");
    assert!(
        !m.forget(BlockId::new(2, 9)),
        "another epoch of the slot is not indexed"
    );
    assert!(!m.forget(block(77)), "unknown block");
    assert!(m.forget(block(2)));
    assert!(!m.forget(block(2)), "already forgotten");
    let r = m.match_prefix(&seq(0..16), &e);
    assert_eq!(
        ids(&r),
        vec![block(0), block(1)],
        "block 3 hangs below the forgotten one"
    );
    assert!(!m.forget(block(3)), "removed with the entry above it");
    assert_eq!(m.stats().cached_blocks, 2);
    assert_eq!(
        m.forget_all(&[block(0), block(1)]),
        1,
        "block 1 went with block 0"
    );
    assert_eq!(m.match_prefix(&seq(0..16), &e).tokens, 0);
    assert_eq!(m.stats().cached_blocks, 0);
}

pub(super) fn reinsertion_after_forget_is_reachable_again<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..12), &e, &full_blocks(0, 3, 4))
        .expect("insert");
    assert!(m.forget(block(1)));
    // The caller recomputed block 1 (and 2) into new blocks.
    let blocks = vec![
        BlockRef::new(block(0), 4),
        BlockRef::new(block(5), 4),
        BlockRef::new(block(6), 4),
    ];
    let ins = m.insert(&seq(0..12), &e, &blocks).expect("insert");
    assert_eq!((ins.new, ins.already_cached, ins.collisions), (2, 1, 0));
    assert_eq!(
        ids(&m.match_prefix(&seq(0..12), &e)),
        vec![block(0), block(5), block(6)]
    );
}

pub(super) fn relocated_blocks_keep_their_place_and_subtree<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..16), &e, &full_blocks(0, 4, 4))
        .expect("insert");
    let cold = BlockId::new(40, 1);
    assert!(m.relocate(block(1), cold));
    let r = m.match_prefix(&seq(0..16), &e);
    assert_eq!(ids(&r), vec![block(0), cold, block(2), block(3)]);
    assert_eq!(m.stats().cached_blocks, 4);
    assert!(
        !m.relocate(block(1), BlockId::new(41, 1)),
        "no longer indexed"
    );
    assert!(!m.relocate(block(77), BlockId::new(42, 1)), "never indexed");
    assert!(!m.relocate(block(2), block(3)), "the target is indexed");
    assert!(!m.relocate(block(2), block(2)), "the same handle");
    // The new handle names the entry: forgetting it removes the subtree,
    // the old one is unknown.
    assert!(!m.forget(block(1)));
    assert!(m.forget(cold));
    assert_eq!(ids(&m.match_prefix(&seq(0..16), &e)), vec![block(0)]);
    assert_eq!(m.stats().cached_blocks, 1);
    // A stale epoch of the target's slot is forgotten first.
    m.insert(&seq(100..104), &e, &[BlockRef::new(BlockId::new(50, 1), 4)])
        .expect("insert");
    assert!(m.relocate(block(0), BlockId::new(50, 2)));
    assert_eq!(m.match_prefix(&seq(100..104), &e).tokens, 0);
    assert_eq!(
        ids(&m.match_prefix(&seq(0..16), &e)),
        vec![BlockId::new(50, 2)]
    );
    // Relocating below the stale one it forgets is refused.
    m.insert(
        &seq(200..208),
        &e,
        &[
            BlockRef::new(BlockId::new(60, 1), 4),
            BlockRef::new(block(61), 4),
        ],
    )
    .expect("insert");
    assert!(!m.relocate(block(61), BlockId::new(60, 2)));
    assert_eq!(m.match_prefix(&seq(200..208), &e).tokens, 0);
}

pub(super) fn a_reused_slot_replaces_its_old_content<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..8), &e, &full_blocks(0, 2, 4))
        .expect("insert");
    // The pool handed slot 1 out again (epoch 2) for other content, and the
    // caller never called forget: inserting the new handle drops the old one.
    let other = seq(100..108);
    let reused = [
        BlockRef::new(block(5), 4),
        BlockRef::new(BlockId::new(1, 2), 4),
    ];
    m.insert(&other, &e, &reused).expect("insert");
    assert_eq!(ids(&m.match_prefix(&seq(0..8), &e)), vec![block(0)]);
    assert_eq!(
        ids(&m.match_prefix(&other, &e)),
        vec![block(5), BlockId::new(1, 2)]
    );
}

pub(super) fn a_handle_is_indexed_at_most_once<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..8), &e, &full_blocks(0, 2, 4))
        .expect("insert");
    // Block 1 again, under another first block: refused, insertion stops.
    let other = [
        BlockRef::new(block(5), 4),
        BlockRef::new(block(1), 4),
        BlockRef::new(block(6), 4),
    ];
    let ins = m.insert(&seq(100..112), &e, &other).expect("insert");
    assert_eq!((ins.new, ins.already_indexed), (1, 1), "{ins:?}");
    assert_eq!(ids(&m.match_prefix(&seq(100..112), &e)), vec![block(5)]);
    assert_eq!(m.stats().cached_blocks, 3);
    // Forgetting it removes its one entry, and the first path ends there.
    assert!(m.forget(block(1)));
    assert_eq!(ids(&m.match_prefix(&seq(0..8), &e)), vec![block(0)]);
    assert!(!m.forget(block(1)), "it was indexed once");
    assert_eq!(m.stats().cached_blocks, 2);
}

pub(super) fn a_stale_handle_never_replaces_a_newer_one<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    let newer = BlockId::new(3, 7);
    m.insert(&seq(0..4), &e, &[BlockRef::new(newer, 4)])
        .expect("insert");
    let stale = BlockId::new(3, 6);
    let ins = m
        .insert(&seq(50..54), &e, &[BlockRef::new(stale, 4)])
        .expect("insert");
    assert_eq!((ins.new, ins.already_indexed), (0, 1));
    assert_eq!(ids(&m.match_prefix(&seq(0..4), &e)), vec![newer]);
    assert_eq!(m.match_prefix(&seq(50..54), &e).tokens, 0);
}

pub(super) fn forget_removes_the_subtree_and_counts_agree<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    // A tree: 0 -> 1 -> {2 -> 3, 4}.
    m.insert(&seq(0..16), &e, &full_blocks(0, 4, 4))
        .expect("insert");
    let mut t = seq(0..8);
    t.extend(100..104);
    m.insert(
        &t,
        &e,
        &[
            BlockRef::new(block(0), 4),
            BlockRef::new(block(1), 4),
            BlockRef::new(block(4), 4),
        ],
    )
    .expect("insert");
    assert_eq!(m.stats().cached_blocks, 5);
    let before = m.stats().forgotten_blocks;
    assert!(m.forget(block(1)));
    let s = m.stats();
    assert_eq!(s.cached_blocks, 1, "1, 2, 3 and 4 are gone");
    assert_eq!(s.forgotten_blocks - before, 4);
    for b in [1, 2, 3, 4] {
        assert!(!m.forget(block(b)), "block {b} is no longer indexed");
    }
    // Its slots are free for other content at once.
    let ins = m
        .insert(&seq(200..204), &e, &[BlockRef::new(block(3), 4)])
        .expect("insert");
    assert_eq!(ins.new, 1);
}
