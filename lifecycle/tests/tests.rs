//! `kvforge-lifecycle`: the conformance suite on every policy.
#![allow(clippy::unwrap_used)]

use kvforge_lifecycle::{LifecyclePolicy, RecentTurns, Segment, testing};

#[test]
fn recent_turns_passes_the_conformance_suite() {
    for keep in [1, 2, 3, 20] {
        testing::check_policy(&mut RecentTurns::new(keep).unwrap());
    }
}

#[test]
fn recent_turns_keeps_the_first_and_the_last_turns() {
    let seg = |a, b, turn| Segment { range: a..b, turn };
    let segs = [
        seg(0, 10, 0),
        seg(10, 20, 1),
        seg(20, 25, 2),
        seg(25, 30, 2),
        seg(30, 40, 3),
        seg(40, 50, 4),
    ];
    let mut out = Vec::new();
    RecentTurns::new(2).unwrap().end_turn(7, &segs, &mut out);
    assert_eq!(out, vec![10..30]);
    assert!(RecentTurns::new(0).is_err());
}
