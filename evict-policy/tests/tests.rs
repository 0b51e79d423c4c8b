//! `kvforge-evict`: the conformance suite on every policy, and what
//! StreamingLLM's sink plus window keeps.
#![allow(clippy::unwrap_used)]

use kvforge_evict::{EvictionPolicy, Pressure, Score, Scored, SinkWindow, Trigger, testing};
use kvforge_pool::{BlockId, BlockTable, Slot};

#[test]
fn sink_window_passes_the_conformance_suite() {
    for (bs, sink, window) in [(4, 4, 8), (4, 0, 1), (1, 2, 3), (16, 32, 64), (4, 6, 5)] {
        testing::check_policy(&mut SinkWindow::new(sink, window).unwrap(), bs);
    }
}

#[test]
fn sink_window_keeps_the_sink_and_the_window_in_whole_entries() {
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    t.push(Slot::Hot(BlockId::new(10, 1)), 2, true).unwrap();
    // 42 positions: sink 4 keeps entry 0; window 10 keeps positions 32..42,
    // i.e. entries 8 (32..36), 9 and 10; entry 7 (28..32) ends at 32: dropped.
    let mut p = SinkWindow::new(4, 10).unwrap();
    let mut out = Vec::new();
    let pressure = Pressure::new(0.0, 1);
    p.victims(0, &t, pressure, &mut out);
    assert_eq!(out, (1..=7).collect::<Vec<_>>());
    assert_eq!(p.name(), "sink4-window10");
    // A sink that is not block aligned keeps the entry it touches.
    let mut out = Vec::new();
    SinkWindow::new(5, 10)
        .unwrap()
        .victims(0, &t, pressure, &mut out);
    assert_eq!(out, (2..=7).collect::<Vec<_>>());
}

#[test]
fn a_window_of_nothing_is_refused() {
    let e = SinkWindow::new(4, 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "eviction policy: the recent window must keep at least one token"
    );
}

fn scored(score: Score, trigger: Trigger) -> Scored {
    Scored::new(score, trigger, 4, 8).unwrap()
}

const SCORES: [Score; 3] = [
    Score::AttentionEma { decay: 0.5 },
    Score::Lfu,
    Score::Hybrid {
        alpha: 1.0,
        beta: 1.0,
        gamma: 1.0,
    },
];

#[test]
fn scored_policies_pass_the_conformance_suite() {
    for score in SCORES {
        for trigger in [
            Trigger::Tokens(13),
            Trigger::Tokens(40),
            Trigger::Watermark {
                high: 0.9,
                low: 0.5,
            },
        ] {
            for bs in [1, 4, 16] {
                testing::check_policy(&mut scored(score, trigger), bs);
            }
        }
    }
}

/// Ten full entries of 4 tokens; entry `heavy` draws most of the attention
/// over `steps` steps.
fn observed(p: &mut Scored, heavy: usize, steps: usize) -> BlockTable {
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    for _ in 0..steps {
        let mass: Vec<f32> = (0..10)
            .map(|i| if i == heavy { 5.0 } else { 0.5 })
            .collect();
        p.observe(0, &t, &mass);
    }
    t
}

#[test]
fn h2o_lfu_and_hybrid_keep_the_heavy_hitter_under_a_token_budget() {
    // 40 live tokens + 1 coming, budget 20: 21 tokens (6 entries) go, out of
    // the candidates 1..=7 (sink 4 keeps entry 0, window 8 keeps 8 and 9).
    for score in SCORES {
        let mut p = scored(score, Trigger::Tokens(20));
        let t = observed(&mut p, 3, 4);
        let mut out = Vec::new();
        p.victims(0, &t, Pressure::new(0.1, 1), &mut out);
        assert_eq!(out, [1, 2, 4, 5, 6, 7], "{}", p.name());
    }
    // Recency alone: the oldest go, the heavy hitter too.
    let age = Score::Hybrid {
        alpha: 1.0,
        beta: 0.0,
        gamma: 0.0,
    };
    let mut p = scored(age, Trigger::Tokens(36));
    let t = observed(&mut p, 1, 4);
    let mut out = Vec::new();
    p.victims(0, &t, Pressure::new(0.1, 1), &mut out);
    assert_eq!(out, [1, 2]);
    // Within budget: nothing.
    let mut p = scored(SCORES[0], Trigger::Tokens(41));
    let t = observed(&mut p, 3, 1);
    let mut out = Vec::new();
    p.victims(0, &t, Pressure::new(0.99, 1), &mut out);
    assert!(out.is_empty());
}

#[test]
fn the_watermark_evicts_from_high_down_to_low_in_bytes() {
    let trigger = Trigger::Watermark {
        high: 0.9,
        low: 0.8,
    };
    let mut p = scored(SCORES[0], trigger);
    let t = observed(&mut p, 3, 2);
    let at = |used: f64| Pressure {
        used,
        new_tokens: 1,
        budget_bytes: 10_000,
        hot_block_bytes: 400,
        cold_block_bytes: 100,
    };
    let mut out = Vec::new();
    p.victims(0, &t, at(0.89), &mut out);
    assert!(out.is_empty(), "below the high mark");
    // 0.95 -> 0.8 of 10,000 bytes: 1,500 bytes, four hot blocks of 400.
    p.victims(0, &t, at(0.95), &mut out);
    assert_eq!(out.len(), 4);
    assert!(!out.contains(&3), "the heavy hitter stays: {out:?}");
    p.forget(0);
}

#[test]
fn bad_scored_configurations_are_refused() {
    let err = |score, trigger, sink, window| {
        Scored::new(score, trigger, sink, window)
            .unwrap_err()
            .to_string()
    };
    let t = Trigger::Tokens(100);
    assert!(err(Score::AttentionEma { decay: 1.0 }, t, 4, 8).contains("decay"));
    let zero = Score::Hybrid {
        alpha: 0.0,
        beta: 0.0,
        gamma: 0.0,
    };
    assert!(err(zero, t, 4, 8).contains("not all 0"));
    let negative = Score::Hybrid {
        alpha: -1.0,
        beta: 1.0,
        gamma: 0.0,
    };
    assert!(err(negative, t, 4, 8).contains(">= 0"));
    assert!(err(Score::Lfu, Trigger::Tokens(12), 4, 8).contains("nothing to choose"));
    for (high, low) in [(0.5, 0.5), (1.5, 0.5), (0.9, 0.0)] {
        let w = Trigger::Watermark { high, low };
        assert!(err(Score::Lfu, w, 4, 8).contains("0 < low < high <= 1"));
    }
    assert!(err(Score::Lfu, t, 4, 0).contains("at least one token"));
}

#[test]
fn keydiff_passes_the_conformance_suite_and_drops_the_keys_nearest_the_mean() {
    for trigger in [Trigger::Tokens(13), Trigger::Tokens(40)] {
        for bs in [1, 4, 16] {
            testing::check_policy(&mut scored(Score::KeyDiff, trigger), bs);
        }
    }
    let mut p = scored(Score::KeyDiff, Trigger::Tokens(20));
    assert!(p.wants_keys() && !p.wants_attention());
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    // Entries 1..=7 are candidates; 21 tokens (6 entries) must go: all but
    // the one whose keys stand farthest from the mean (entry 5).
    let novelty: Vec<f32> = (0..10)
        .map(|i| if i == 5 { 0.9 } else { 0.1 + i as f32 * 0.01 })
        .collect();
    p.observe_keys(0, &t, &novelty);
    let mut out = Vec::new();
    p.victims(0, &t, Pressure::new(0.1, 1), &mut out);
    assert_eq!(out, [1, 2, 3, 4, 6, 7]);
    assert!(p.name().starts_with("keydiff"));
}

#[test]
fn per_head_keydiff_passes_the_lane_suite_and_each_lane_keeps_its_own_pages() {
    for trigger in [Trigger::Tokens(13), Trigger::Tokens(40)] {
        for bs in [1, 4, 16] {
            for lanes in [1, 3] {
                let mut p = scored(Score::KeyDiff, trigger).per_head().unwrap();
                testing::check_lane_policy(&mut p, bs, lanes);
            }
        }
    }
    let mut p = scored(Score::KeyDiff, Trigger::Tokens(20))
        .per_head()
        .unwrap();
    assert!(p.per_lane() && p.wants_keys());
    assert_eq!(p.name(), "keydiff-per-head-budget20-sink4-window8");
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    // Two lanes; candidates 1..=7; 21 tokens over: 6 pages per lane go.
    // Lane 0 keeps entry 2, lane 1 entry 6: their farthest keys.
    let mut novelty = Vec::new();
    for i in 0..10 {
        novelty.push(if i == 2 { 0.9 } else { 0.1 });
        novelty.push(if i == 6 { 0.9 } else { 0.1 });
    }
    p.observe_keys(0, &t, &novelty);
    let mut out = Vec::new();
    p.lane_victims(0, &t, Pressure::new(0.1, 1), 2, &mut out);
    assert_eq!(out, [1, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 7]);
    // Nothing over the budget: nothing named.
    let mut out = Vec::new();
    let mut p = scored(Score::KeyDiff, Trigger::Tokens(60))
        .per_head()
        .unwrap();
    p.lane_victims(0, &t, Pressure::new(0.1, 1), 2, &mut out);
    assert!(out.is_empty());
    // Only KeyDiff and SnapKV rank per lane.
    let e = scored(Score::Lfu, Trigger::Tokens(20))
        .per_head()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("per-head eviction ranks by key novelty"),
        "{e}"
    );
}

const SNAP: Score = Score::SnapKv { window: 32 };

/// SnapKV: the latest observation, not an average, ranks the entries —
/// an entry that drew the attention for many steps and then none goes,
/// one that draws it in the last step stays; the observation window is
/// what the policy asks the engine for.
#[test]
fn snapkv_passes_the_conformance_suite_and_ranks_by_the_latest_window() {
    for trigger in [Trigger::Tokens(13), Trigger::Tokens(40)] {
        for bs in [1, 4, 16] {
            testing::check_policy(&mut scored(SNAP, trigger), bs);
        }
    }
    let mut p = scored(SNAP, Trigger::Tokens(20));
    assert!(p.wants_attention() && !p.wants_keys());
    assert_eq!(p.observation_window(), 32);
    assert_eq!(
        scored(Score::Lfu, Trigger::Tokens(20)).observation_window(),
        0
    );
    assert_eq!(p.name(), "snapkv32-budget20-sink4-window8");
    // Entry 3 heavy for four steps, then entry 5 in the last one.
    let t = observed(&mut p, 3, 4);
    let last: Vec<f32> = (0..10).map(|i| if i == 5 { 5.0 } else { 0.5 }).collect();
    p.observe(0, &t, &last);
    let mut out = Vec::new();
    p.victims(0, &t, Pressure::new(0.1, 1), &mut out);
    assert_eq!(out, [1, 2, 3, 4, 6, 7]);
    // H2O on the same observations keeps the long-time heavy hitter.
    let mut h = scored(Score::AttentionEma { decay: 0.9 }, Trigger::Tokens(20));
    let t = observed(&mut h, 3, 4);
    h.observe(0, &t, &last);
    let mut out = Vec::new();
    h.victims(0, &t, Pressure::new(0.1, 1), &mut out);
    assert!(!out.contains(&3), "{out:?}");
    // An empty window is refused.
    let e = Scored::new(Score::SnapKv { window: 0 }, Trigger::Tokens(20), 4, 8).unwrap_err();
    assert!(e.to_string().contains("at least one query"), "{e}");
}

#[test]
fn per_head_snapkv_passes_the_lane_suite_and_each_lane_keeps_what_it_attended() {
    for trigger in [Trigger::Tokens(13), Trigger::Tokens(40)] {
        for bs in [1, 4, 16] {
            for lanes in [1, 3] {
                let mut p = scored(SNAP, trigger).per_head().unwrap();
                testing::check_lane_policy(&mut p, bs, lanes);
            }
        }
    }
    let mut p = scored(SNAP, Trigger::Tokens(20)).per_head().unwrap();
    assert!(p.per_lane() && p.wants_attention() && !p.wants_keys());
    assert_eq!(p.name(), "snapkv32-per-head-budget20-sink4-window8");
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    // Lane 0 attended entry 2, lane 1 entry 6: each keeps its own.
    let mut mass = Vec::new();
    for i in 0..10 {
        mass.push(if i == 2 { 3.0 } else { 0.1 });
        mass.push(if i == 6 { 3.0 } else { 0.1 });
    }
    p.observe(0, &t, &mass);
    let mut out = Vec::new();
    p.lane_victims(0, &t, Pressure::new(0.1, 1), 2, &mut out);
    assert_eq!(out, [1, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 7]);
}

/// Token-level KeyDiff and SnapKV: the contract on every table, and the
/// rows with the lowest signal go, whichever block they sit in.
#[test]
fn token_level_policies_pass_the_token_suite_and_name_the_lowest_rows() {
    for score in [Score::KeyDiff, SNAP] {
        for trigger in [Trigger::Tokens(13), Trigger::Tokens(40)] {
            for bs in [1, 4, 16] {
                let mut p = scored(score, trigger).per_token().unwrap();
                testing::check_token_policy(&mut p, bs);
            }
        }
    }
    let mut p = scored(Score::KeyDiff, Trigger::Tokens(36))
        .per_token()
        .unwrap();
    assert!(p.token_level() && !p.per_lane() && p.wants_keys());
    assert_eq!(p.name(), "keydiff-per-token-budget36-sink4-window8");
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    // 40 live + 1 coming, budget 36: five rows go — the five lowest of
    // entries 1..=7 (sink 4 and window 8 protect 0, 8 and 9).
    let mut novelty = vec![0.5f32; 40];
    for (at, v) in [
        (5, 0.1),
        (14, 0.05),
        (15, 0.2),
        (22, 0.15),
        (29, 0.3),
        (2, 0.0),
    ] {
        novelty[at] = v;
    }
    p.observe_keys(0, &t, &novelty);
    let mut out = Vec::new();
    p.token_victims(0, &t, Pressure::new(0.1, 1), &mut out);
    assert_eq!(out, [(1, 1), (3, 2), (3, 3), (5, 2), (7, 1)]);
    // Punched, they are not named again.
    for (i, rows) in [(1, 0b10), (3, 0b1100), (5, 0b100), (7, 0b10)] {
        t.punch(i, rows).unwrap();
    }
    let mut again = Vec::new();
    p.token_victims(0, &t, Pressure::new(0.1, 1), &mut again);
    assert!(again.iter().all(|v| !out.contains(v)), "{again:?}");
    // Only KeyDiff and SnapKV rank single tokens.
    let e = scored(Score::Lfu, Trigger::Tokens(20))
        .per_token()
        .unwrap_err();
    assert!(e.to_string().contains("token-level eviction ranks"), "{e}");
}
