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

use crate::{BlockId, BlockRef, ExtraKeys, PrefixError, PrefixMatch, PrefixMatcher};

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
}

/// A handle for tests: slot `i`, epoch `e`.
pub fn block(i: u32) -> BlockId {
    BlockId::new(i, 1)
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
    // Whether entries below a forgotten one are dropped now or when their own
    // block is reclaimed is up to the index; they are unreachable either way.
    assert!(m.forget_all(&[block(0), block(1)]) >= 1);
    assert_eq!(m.match_prefix(&seq(0..16), &e).tokens, 0);
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
    // A full block wins over a sealed one at the same place.
    m.insert(
        &turn3,
        &e,
        &[BlockRef::new(block(0), 4), BlockRef::new(block(9), 4)],
    )
    .expect("insert");
    let r = m.match_prefix(&turn3, &e);
    assert_eq!(ids(&r)[..2], [block(0), block(9)]);
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
