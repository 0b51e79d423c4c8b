//! The [`LifecyclePolicy`] conformance suite.

use std::collections::BTreeSet;
use std::ops::Range;

use crate::labels::Label;
use crate::lifecycle::{Lifecycle, LifecycleParams, TurnEnd};
use crate::{LifecyclePolicy, Segment};

/// Conversations of 1 to 12 turns, segments of varied lengths (some turns
/// of several segments, some segments gone as if reclaimed), with the
/// model's labels present, absent, or of the wrong length. Then the policy
/// drives a [`Lifecycle`] (K = 0 and K = 2) for 12 turns. Panics on the
/// first violation of the [`LifecyclePolicy`] contract: one label per
/// segment; the newest turn kept; reclaimed ranges ascending, disjoint, of
/// segments that existed, never the newest turn's, each freed once.
pub fn check_policy<P: LifecyclePolicy + ?Sized>(p: &mut P) {
    let model_variants: [&dyn Fn(usize) -> Option<Vec<Label>>; 4] = [
        &|_| None,
        &|n| Some(vec![Label::Drop; n]),
        &|n| {
            Some(
                (0..n)
                    .map(|i| [Label::Keep, Label::Compress, Label::Drop][i % 3])
                    .collect(),
            )
        },
        &|n| Some(vec![Label::Drop; n + 1]),
    ];
    for (v, model) in model_variants.iter().enumerate() {
        for turns in 1..=12u32 {
            let seq = u64::from(turns) * 10 + v as u64;
            let mut all = Vec::new();
            let mut pos = 0u64;
            let mut id = 0u32;
            for t in 0..turns {
                let pieces = if t % 3 == 1 { 3 } else { 1 };
                for k in 0..pieces {
                    let len = 5 + u64::from((t * 7 + k) % 11) * 60;
                    all.push(Segment {
                        id,
                        range: pos..pos + len,
                        turn: t,
                    });
                    id += 1;
                    pos += len;
                }
                // Ask about every turn as it ends, as a Lifecycle would.
                let live: Vec<Segment> = all
                    .iter()
                    .filter(|s| s.turn == t || (s.id + t) % 4 != 0)
                    .cloned()
                    .collect();
                let newest = live.iter().filter(|s| s.turn == t).count();
                let mut out = Vec::new();
                let m = model(newest);
                p.label(seq, &live, m.as_deref(), &mut out);
                assert_eq!(out.len(), live.len(), "{}: one label per segment", p.name());
                for (s, l) in live.iter().zip(&out) {
                    if s.turn == t {
                        assert_eq!(*l, Label::Keep, "{}: {s:?} of the newest turn", p.name());
                    }
                }
            }
            p.forget(seq);
        }
    }
}

/// Drives `p` through a [`Lifecycle`] with K = 0 and K = 2 over a
/// 12-turn conversation of 1–3 segments per turn and checks what it
/// frees: ranges ascending and disjoint within a turn, inside the
/// segments that existed, never the newest turn's, each position freed
/// once.
pub fn check_lifecycle(make: &dyn Fn() -> Box<dyn LifecyclePolicy>) {
    for delay in [0, 2] {
        let params = LifecycleParams {
            delay,
            ..LifecycleParams::default()
        };
        let mut lc = match Lifecycle::new(make(), params) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        };
        let mut freed: BTreeSet<u64> = BTreeSet::new();
        let mut end = 0u64;
        let tokens: Vec<u32> = (0..20_000u32).map(|i| i % 97).collect();
        for t in 0..12u32 {
            let start = end;
            end += 40 + u64::from(t % 4) * 300;
            let cuts: Vec<u64> = (1..=t % 3).map(|k| start + 10 * u64::from(k)).collect();
            let n = cuts.len() + 1;
            let model: Vec<Label> = (0..n).map(|i| [Label::Drop, Label::Keep][i % 2]).collect();
            let o = lc.end_turn(
                1,
                TurnEnd {
                    end,
                    cuts: &cuts,
                    tokens: &tokens,
                    stop: &[],
                    refer: None,
                    model: Some(&model),
                },
            );
            assert_eq!(
                o.segments as usize,
                n,
                "{}: segments of turn {t}",
                lc.name()
            );
            let mut prev: Option<&Range<u64>> = None;
            for r in &o.reclaim {
                assert!(
                    r.start < r.end && r.end <= start,
                    "{}: {r:?} at turn {t}",
                    lc.name()
                );
                if let Some(p) = prev {
                    assert!(p.end < r.start, "{}: {p:?} then {r:?}", lc.name());
                }
                prev = Some(r);
                for x in r.clone() {
                    assert!(freed.insert(x), "{}: position {x} freed twice", lc.name());
                }
            }
            for g in &o.compress {
                lc.compressed(1, g.clone(), false)
                    .unwrap_or_else(|e| panic!("{}: a segment handed out: {e}", lc.name()));
            }
        }
        lc.forget(1);
    }
}
