//! The [`LifecyclePolicy`] conformance suite.

use std::ops::Range;

use crate::{LifecyclePolicy, Segment};

/// Conversations of 1 to 12 turns with segments of varied lengths (one
/// turn of several segments). Panics on the first violation of the
/// [`LifecyclePolicy`] contract.
pub fn check_policy<P: LifecyclePolicy + ?Sized>(p: &mut P) {
    for turns in 1..=12u32 {
        let mut segments = Vec::new();
        let mut pos = 0u64;
        for t in 0..turns {
            let pieces = if t % 3 == 1 { 3 } else { 1 };
            for k in 0..pieces {
                let len = 5 + u64::from((t * 7 + k) % 11);
                segments.push(Segment {
                    range: pos..pos + len,
                    turn: t,
                });
                pos += len;
            }
        }
        let mut out: Vec<Range<u64>> = Vec::new();
        p.end_turn(u64::from(turns), &segments, &mut out);
        let last = turns - 1;
        let newest_start = segments
            .iter()
            .find(|s| s.turn == last)
            .map_or(pos, |s| s.range.start);
        for (i, r) in out.iter().enumerate() {
            assert!(r.start < r.end, "{}: empty range {r:?}", p.name());
            assert!(
                r.end <= newest_start,
                "{}: {r:?} touches the last turn",
                p.name()
            );
            if i > 0 {
                assert!(
                    out[i - 1].end <= r.start,
                    "ranges overlap or descend: {out:?}"
                );
            }
        }
        p.forget(u64::from(turns));
    }
}
