//! What a lookup finds: full blocks up to the first miss, within one
//! namespace, the longest path, peeks that count nothing.

use super::{block, full_blocks, ids, seq};
use crate::{BlockRef, ExtraKeys, PrefixMatch, PrefixMatcher};

pub(super) fn empty_index_matches_nothing<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    let r = m.match_prefix(&seq(0..10), &e);
    assert_eq!(r, PrefixMatch::default());
    assert_eq!(m.match_prefix(&[], &e), PrefixMatch::default());
    let s = m.stats();
    assert_eq!((s.queries, s.query_tokens, s.hit_tokens), (2, 10, 0));
    assert_eq!(s.cached_blocks, 0);
}

pub(super) fn a_peek_matches_and_counts_nothing<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn full_blocks_match_and_partial_tails_do_not<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn lookup_stops_at_the_first_miss<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn namespaces_and_adapters_never_share<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn sealed_blocks_hit_on_the_next_turn<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn the_longest_path_wins_when_sealed_and_full_blocks_compete<M: PrefixMatcher>(
    mut m: M,
) {
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

pub(super) fn equal_paths_prefer_full_blocks<M: PrefixMatcher>(mut m: M) {
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
