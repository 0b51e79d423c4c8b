//! Insertion and extension: duplicates, continuations, bad arguments.

use super::{block, full, full_blocks, ids, seq};
use crate::error::PrefixError;
use crate::{BlockRef, ExtraKeys, PrefixMatcher};
use kvforge_pool::BlockId;

pub(super) fn duplicates_keep_the_first_block<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn extend_continues_below_a_block_for_the_cost_of_the_new_tokens<M: PrefixMatcher>(
    mut m: M,
) {
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
}

pub(super) fn extend_refuses_an_unknown_stale_or_misplaced_parent<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::namespace("s");
    let all = seq(0..40);
    m.insert(&all[..12], &e, &full_blocks(0, 3, 4))
        .expect("insert");
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

pub(super) fn bad_insertions_are_errors_and_change_nothing<M: PrefixMatcher>(mut m: M) {
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

pub(super) fn block_size_one_works<M: PrefixMatcher>(mut m: M) {
    let e = ExtraKeys::default();
    assert_eq!(m.block_size(), 1);
    m.insert(&[7, 8, 9], &e, &full_blocks(0, 3, 1))
        .expect("insert");
    assert_eq!(m.match_prefix(&[7, 8, 1], &e).tokens, 2);
    assert_eq!(m.match_prefix(&[8], &e).tokens, 0);
}

pub(super) fn empty_namespaces_leave_nothing_behind<M: PrefixMatcher>(mut m: M) {
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
