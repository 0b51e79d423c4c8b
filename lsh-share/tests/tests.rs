//! `kvforge-lsh`: the conformance suite on every deduplicator.
#![allow(clippy::unwrap_used)]

use kvforge_lsh::{Deduplicator, ExactDedup, testing};
use kvforge_pool::BlockId;

#[test]
fn exact_dedup_passes_the_conformance_suite() {
    testing::check_deduplicator(&mut ExactDedup::new());
}

#[test]
fn exact_dedup_shares_identical_bytes_only() {
    let mut d = ExactDedup::new();
    let (a, b, c) = (BlockId::new(1, 1), BlockId::new(2, 1), BlockId::new(3, 1));
    assert_eq!(d.offer(a, &[1, 2, 3], &mut |_| true), None);
    assert_eq!(d.offer(b, &[1, 2, 4], &mut |_| true), None, "other bytes");
    assert_eq!(d.offer(c, &[1, 2, 3], &mut |x| x == a), Some(a));
    d.forget(a);
    assert_eq!(d.offer(c, &[1, 2, 3], &mut |_| true), None, "a is gone");
    let s = d.stats();
    assert_eq!((s.offered, s.shared, s.canonical), (4, 1, 2));
}
