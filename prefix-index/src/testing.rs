//! The conformance suite every [`PrefixMatcher`] must pass.
//!
//! ```
//! use kvforge_prefix::{testing, HashChainIndex, RadixIndex};
//! testing::check_matcher(|bs| HashChainIndex::with_seed(bs, 1).unwrap());
//! testing::check_matcher(|bs| RadixIndex::new(bs).unwrap());
//! ```
//!
//! `make(block_size)` must return an empty index. The suite panics on the
//! first violated property, so call it from a `#[test]`.

use crate::error::PrefixError;
use crate::{BlockRef, ExtraKeys, PrefixMatch, PrefixMatcher};
use kvforge_pool::BlockId;

/// Runs every conformance check against indexes built by `make`.
pub fn check_matcher<M: PrefixMatcher>(make: impl Fn(usize) -> M) {
    empty_index_matches_nothing(make(4));
    full_blocks_match_and_partial_tails_do_not(make(4));
    lookup_stops_at_the_first_miss(make(4));
    namespaces_and_adapters_never_share(make(4));
    forgotten_blocks_end_the_match(make(4));
    reinsertion_after_forget_is_reachable_again(make(4));
    sealed_blocks_hit_on_the_next_turn(make(4));
    duplicates_keep_the_first_block(make(4));
    a_reused_slot_replaces_its_old_content(make(4));
    bad_insertions_are_errors_and_change_nothing(make(4));
    block_size_one_works(make(1));
    a_handle_is_indexed_at_most_once(make(4));
    a_stale_handle_never_replaces_a_newer_one(make(4));
    forget_removes_the_subtree_and_counts_agree(make(4));
    empty_namespaces_leave_nothing_behind(make(4));
    the_longest_path_wins_when_sealed_and_full_blocks_compete(make(8));
    equal_paths_prefer_full_blocks(make(4));
    relocated_blocks_keep_their_place_and_subtree(make(4));
    extend_continues_below_a_block_for_the_cost_of_the_new_tokens(make(4));
    a_peek_matches_and_counts_nothing(make(4));
}

/// A handle for tests: slot `i`, epoch `e`.
pub fn block(i: u32) -> BlockId {
    BlockId::new(i, 1)
}

/// Block `i` holding a full block of 4 tokens.
fn full(i: u32) -> BlockRef {
    BlockRef::new(block(i), 4)
}

/// Full blocks `first..first + n` of size `bs`.
pub fn full_blocks(first: u32, n: usize, bs: usize) -> Vec<BlockRef> {
    (0..n as u32)
        .map(|i| BlockRef::new(block(first + i), bs as u32))
        .collect()
}

fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

fn ids(m: &PrefixMatch) -> Vec<BlockId> {
    m.blocks.iter().map(|b| b.block).collect()
}

fn empty_index_matches_nothing<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    let r = m.match_prefix(&seq(0..10), &e);
    assert_eq!(r, PrefixMatch::default());
    assert_eq!(m.match_prefix(&[], &e), PrefixMatch::default());
    let s = m.stats();
    assert_eq!((s.queries, s.query_tokens, s.hit_tokens), (2, 10, 0));
    assert_eq!(s.cached_blocks, 0);
}

fn a_peek_matches_and_counts_nothing<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    let t = seq(0..14);
    m.insert(&t, &e, &full_blocks(0, 2, 4))
        .expect("valid insert");
    for q in [seq(0..14), seq(0..6), seq(3..9), Vec::new()] {
        let before = m.stats();
        let peeked = m.peek_prefix(&q, &e);
        assert_eq!(m.stats(), before, "a peek counts nothing");
        assert_eq!(peeked, m.match_prefix(&q, &e), "a peek is the match");
        assert_eq!(m.stats().queries, before.queries + 1);
    }
}

fn full_blocks_match_and_partial_tails_do_not<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    let t = seq(0..10); // 2 full blocks of 4, a partial tail of 2
    let ins = m
        .insert(&t, &e, &full_blocks(0, 2, 4))
        .expect("valid insert");
    assert_eq!((ins.new, ins.already_cached), (2, 0));
    assert_eq!(m.stats().cached_blocks, 2);
    let r = m.match_prefix(&t, &e);
    assert_eq!(ids(&r), vec![block(0), block(1)]);
    assert_eq!(r.tokens, 8);
    // A longer query still matches the cached prefix only.
    let r = m.match_prefix(&seq(0..100), &e);
    assert_eq!(r.tokens, 8);
    // A shorter query matches only whole blocks.
    let r = m.match_prefix(&seq(0..7), &e);
    assert_eq!(ids(&r), vec![block(0)]);
    let s = m.stats();
    assert_eq!(s.query_tokens, 10 + 100 + 7);
    assert_eq!(s.hit_tokens, 8 + 8 + 4);
    assert_eq!(s.hit_blocks, 5);
    assert!((s.hit_rate() - 20.0 / 117.0).abs() < 1e-12);
}

fn lookup_stops_at_the_first_miss<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..16), &e, &full_blocks(0, 4, 4))
        .expect("insert");
    let mut q = seq(0..16);
    q[5] = 999; // inside block 1
    let r = m.match_prefix(&q, &e);
    assert_eq!(
        ids(&r),
        vec![block(0)],
        "blocks 2 and 3 are not reachable past the miss"
    );
    // Same block contents after a different first block: no hit at all.
    let mut q = seq(0..16);
    q[0] = 999;
    assert_eq!(m.match_prefix(&q, &e).tokens, 0);
}

fn namespaces_and_adapters_never_share<M: PrefixMatcher>(mut m: M) {
    let a = ExtraKeys::namespace("tenant-a");
    let b = ExtraKeys::namespace("tenant-b");
    let a7 = a.clone().with_adapter(7);
    m.insert(&seq(0..8), &a, &full_blocks(0, 2, 4))
        .expect("insert");
    assert_eq!(m.match_prefix(&seq(0..8), &a).tokens, 8);
    assert_eq!(m.match_prefix(&seq(0..8), &b).tokens, 0);
    assert_eq!(m.match_prefix(&seq(0..8), &a7).tokens, 0);
    assert_eq!(m.match_prefix(&seq(0..8), &ExtraKeys::default()).tokens, 0);
    m.insert(&seq(0..8), &b, &full_blocks(10, 2, 4))
        .expect("insert");
    assert_eq!(
        ids(&m.match_prefix(&seq(0..8), &b)),
        vec![block(10), block(11)]
    );
    assert_eq!(
        ids(&m.match_prefix(&seq(0..8), &a)),
        vec![block(0), block(1)]
    );
}

fn forgotten_blocks_end_the_match<M: PrefixMatcher>(mut m: M) {
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

fn reinsertion_after_forget_is_reachable_again<M: PrefixMatcher>(mut m: M) {
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

fn sealed_blocks_hit_on_the_next_turn<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    // Turn 1: 6 tokens = one full block + the turn's last 2 tokens sealed.
    let turn1 = seq(0..6);
    let sealed = vec![BlockRef::new(block(0), 4), BlockRef::new(block(1), 2)];
    m.insert(&turn1, &e, &sealed).expect("insert");
    // Turn 2 extends turn 1: the sealed block hits, new blocks start after it.
    let turn2 = seq(0..13);
    let r = m.match_prefix(&turn2, &e);
    assert_eq!(r.blocks, sealed);
    assert_eq!(r.tokens, 6);
    let mut blocks = sealed.clone();
    blocks.push(BlockRef::new(block(2), 4));
    blocks.push(BlockRef::new(block(3), 3)); // turn 2's own sealed tail
    m.insert(&turn2, &e, &blocks).expect("insert");
    let turn3 = seq(0..20);
    assert_eq!(m.match_prefix(&turn3, &e).blocks, blocks);
    // A competing full block at the same place does not cut the match
    // short: the sealed path is longer.
    m.insert(
        &turn3,
        &e,
        &[BlockRef::new(block(0), 4), BlockRef::new(block(9), 4)],
    )
    .expect("insert");
    assert_eq!(m.match_prefix(&turn3, &e).blocks, blocks);
    // Where the full block's path is the longer one, it wins.
    assert_eq!(
        ids(&m.match_prefix(&seq(0..9), &e)),
        vec![block(0), block(9)]
    );
    // A sealed block needs all its tokens.
    assert_eq!(m.match_prefix(&seq(0..5), &e).tokens, 4);
}

fn duplicates_keep_the_first_block<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..8), &e, &full_blocks(0, 2, 4))
        .expect("insert");
    let ins = m
        .insert(&seq(0..12), &e, &full_blocks(20, 3, 4))
        .expect("insert");
    assert_eq!((ins.new, ins.already_cached), (1, 2));
    assert_eq!(
        ids(&m.match_prefix(&seq(0..12), &e)),
        vec![block(0), block(1), block(22)]
    );
    assert_eq!(m.stats().cached_blocks, 3);
}

fn relocated_blocks_keep_their_place_and_subtree<M: PrefixMatcher>(mut m: M) {
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

fn extend_continues_below_a_block_for_the_cost_of_the_new_tokens<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::namespace("s");
    let all = seq(0..40);
    m.insert(&all[..12], &e, &full_blocks(0, 3, 4))
        .expect("insert");
    // Turn after turn, only what is new: the cost is the new tokens.
    let before = m.stats().insert_tokens;
    let got = m
        .extend(full(2), 12, &all[12..20], &full_blocks(3, 2, 4))
        .expect("extend")
        .expect("parent indexed");
    assert_eq!(got.new, 2);
    assert_eq!(m.stats().insert_tokens - before, 8, "the new tokens only");
    assert_eq!(
        ids(&m.match_prefix(&all[..20], &e)),
        (0..5).map(block).collect::<Vec<_>>()
    );
    assert_eq!(m.stats().cached_blocks, 5);
    // A sealed (short) tail, then the same tail extended again: the
    // owner's longer registration goes through forget + extend.
    let tail = [BlockRef::new(block(5), 2)];
    assert_eq!(
        m.extend(full(4), 20, &all[20..22], &tail)
            .expect("extend")
            .map(|i| i.new),
        Some(1)
    );
    assert_eq!(m.match_prefix(&all[..23], &e).tokens, 22);
    assert!(m.forget(block(5)));
    let longer = [BlockRef::new(block(5), 4)];
    assert_eq!(
        m.extend(full(4), 20, &all[20..24], &longer)
            .expect("extend")
            .map(|i| i.new),
        Some(1)
    );
    assert_eq!(m.match_prefix(&all[..25], &e).tokens, 24);
    // From a block in the middle: the same continuation is already there,
    // another one branches off.
    let same = m
        .extend(full(1), 8, &all[8..16], &full_blocks(2, 2, 4))
        .expect("extend")
        .expect("indexed");
    assert_eq!((same.new, same.already_cached), (0, 2));
    let mut other = all[..8].to_vec();
    other.extend(seq(100..108));
    let branch = m
        .extend(full(1), 8, &other[8..], &full_blocks(20, 2, 4))
        .expect("extend")
        .expect("indexed");
    assert_eq!(branch.new, 2);
    assert_eq!(
        ids(&m.match_prefix(&other, &e)),
        vec![block(0), block(1), block(20), block(21)]
    );
    assert_eq!(
        m.match_prefix(&all[..25], &e).tokens,
        24,
        "the old path stays"
    );
    // Unknown or stale parent: nothing happens, the caller inserts instead.
    let stats = m.stats();
    assert_eq!(
        m.extend(full(77), 4, &all[..4], &full_blocks(30, 1, 4))
            .expect("ok"),
        None
    );
    assert_eq!(
        m.extend(
            BlockRef::new(BlockId::new(1, 9), 4),
            8,
            &all[..4],
            &full_blocks(30, 1, 4)
        )
        .expect("ok"),
        None
    );
    assert_eq!(m.stats().cached_blocks, stats.cached_blocks);
    // The right handle at another length or another place (a block shared
    // by two sequences, indexed as one's shorter sealed entry): continuing
    // there would index KV at the wrong positions.
    assert_eq!(
        m.extend(
            BlockRef::new(block(1), 3),
            7,
            &all[7..11],
            &full_blocks(30, 1, 4)
        )
        .expect("ok"),
        None,
        "another length"
    );
    assert_eq!(
        m.extend(full(1), 12, &all[12..16], &full_blocks(30, 1, 4))
            .expect("ok"),
        None,
        "another place"
    );
    assert_eq!(m.stats().cached_blocks, stats.cached_blocks);
    // Bad input is an error that changes nothing.
    assert!(
        m.extend(full(1), 8, &all[..4], &full_blocks(1, 1, 4))
            .is_err(),
        "parent listed"
    );
    assert!(
        m.extend(full(1), 8, &all[..3], &full_blocks(30, 1, 4))
            .is_err(),
        "too few tokens"
    );
    assert_eq!(m.stats().cached_blocks, stats.cached_blocks);
}

fn a_reused_slot_replaces_its_old_content<M: PrefixMatcher>(mut m: M) {
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

fn bad_insertions_are_errors_and_change_nothing<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..8), &e, &full_blocks(0, 2, 4))
        .expect("insert");
    let before = m.stats();
    let t = seq(0..8);
    let zero = [BlockRef::new(block(5), 0)];
    assert!(matches!(
        m.insert(&t, &e, &zero),
        Err(PrefixError::BlockLength { len: 0, .. })
    ));
    let long = [BlockRef::new(block(5), 5)];
    assert!(matches!(
        m.insert(&t, &e, &long),
        Err(PrefixError::BlockLength { len: 5, .. })
    ));
    let too_many = full_blocks(5, 3, 4);
    assert_eq!(
        m.insert(&t, &e, &too_many),
        Err(PrefixError::BlocksExceedTokens {
            covered: 12,
            tokens: 8
        })
    );
    let twice = [BlockRef::new(block(5), 4), BlockRef::new(block(5), 4)];
    assert!(matches!(
        m.insert(&t, &e, &twice),
        Err(PrefixError::DuplicateBlock { .. })
    ));
    assert_eq!(m.stats(), before, "failed insertions change nothing");
    assert_eq!(ids(&m.match_prefix(&t, &e)), vec![block(0), block(1)]);
}

fn block_size_one_works<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    assert_eq!(m.block_size(), 1);
    m.insert(&[7, 8, 9], &e, &full_blocks(0, 3, 1))
        .expect("insert");
    assert_eq!(m.match_prefix(&[7, 8, 1], &e).tokens, 2);
    assert_eq!(m.match_prefix(&[8], &e).tokens, 0);
}

fn a_handle_is_indexed_at_most_once<M: PrefixMatcher>(mut m: M) {
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

fn a_stale_handle_never_replaces_a_newer_one<M: PrefixMatcher>(mut m: M) {
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

fn forget_removes_the_subtree_and_counts_agree<M: PrefixMatcher>(mut m: M) {
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

fn empty_namespaces_leave_nothing_behind<M: PrefixMatcher>(mut m: M) {
    for i in 0..100u32 {
        let e = ExtraKeys::namespace(format!("tenant-{i}"));
        // Eight pool slots, reused with a new epoch by each tenant.
        let b = BlockId::new(i % 8, i + 1);
        m.insert(&seq(0..4), &e, &[BlockRef::new(b, 4)])
            .expect("insert");
    }
    let s = m.stats();
    assert_eq!((s.cached_blocks, s.namespaces), (8, 8), "{s:?}");
    for i in 92..100u32 {
        assert!(m.forget(BlockId::new(i % 8, i + 1)));
    }
    let s = m.stats();
    assert_eq!((s.cached_blocks, s.namespaces), (0, 0), "{s:?}");
    // An insertion that adds nothing leaves no namespace behind either.
    let e = ExtraKeys::namespace("empty");
    m.insert(&seq(0..2), &e, &[]).expect("insert");
    assert_eq!(m.stats().namespaces, 0);
}

fn the_longest_path_wins_when_sealed_and_full_blocks_compete<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    // Turn 1, sealed: [0..8) full, [8..10) sealed, [10..18) full.
    let turn = seq(0..18);
    let sealed = [
        BlockRef::new(block(0), 8),
        BlockRef::new(block(1), 2),
        BlockRef::new(block(2), 8),
    ];
    m.insert(&turn, &e, &sealed).expect("insert");
    // Another request cached [8..16) as a full block after the same first one.
    m.insert(
        &seq(0..16),
        &e,
        &[BlockRef::new(block(0), 8), BlockRef::new(block(3), 8)],
    )
    .expect("insert");
    let r = m.match_prefix(&seq(0..30), &e);
    assert_eq!(r.tokens, 18, "{r:?}");
    assert_eq!(r.blocks, sealed);
}

fn equal_paths_prefer_full_blocks<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    m.insert(&seq(0..8), &e, &full_blocks(0, 2, 4))
        .expect("insert");
    let halves = [
        BlockRef::new(block(0), 4),
        BlockRef::new(block(5), 2),
        BlockRef::new(block(6), 2),
    ];
    m.insert(&seq(0..8), &e, &halves).expect("insert");
    assert_eq!(
        ids(&m.match_prefix(&seq(0..8), &e)),
        vec![block(0), block(1)]
    );
    assert!(m.forget(block(1)));
    assert_eq!(m.match_prefix(&seq(0..8), &e).blocks, halves);
}
