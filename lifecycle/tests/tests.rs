//! `kvforge-lifecycle`: the conformance suite on every policy.
#![allow(clippy::unwrap_used, clippy::single_range_in_vec_init)]

use kvforge_lifecycle::{
    Label, LabelSource, Lifecycle, LifecycleParams, LifecyclePolicy, ModelLabels, RecentTurns,
    RuleFallback, Segment, TurnEnd, testing,
};

fn rule() -> RuleFallback {
    RuleFallback::new(2, 512).unwrap()
}

#[test]
fn every_policy_passes_the_conformance_suite() {
    let makers: Vec<Box<dyn Fn() -> Box<dyn LifecyclePolicy>>> = vec![
        Box::new(|| Box::new(RecentTurns::new(1).unwrap())),
        Box::new(|| Box::new(RecentTurns::new(3).unwrap())),
        Box::new(|| Box::new(RuleFallback::new(1, 100).unwrap())),
        Box::new(|| Box::new(rule())),
        Box::new(|| Box::new(ModelLabels::new(LabelSource::Free, rule()).unwrap())),
        Box::new(|| Box::new(ModelLabels::new(LabelSource::Constrained, rule()).unwrap())),
    ];
    for make in &makers {
        testing::check_policy(make().as_mut());
        testing::check_lifecycle(&**make);
    }
}

fn seg(id: u32, a: u64, b: u64, turn: u32) -> Segment {
    Segment {
        id,
        range: a..b,
        turn,
    }
}

fn labels(p: &mut dyn LifecyclePolicy, segs: &[Segment], model: Option<&[Label]>) -> Vec<Label> {
    let mut out = Vec::new();
    p.label(7, segs, model, &mut out);
    out
}

#[test]
fn recent_turns_keeps_the_first_and_the_last_turns() {
    use Label::{Drop, Keep};
    let segs = [
        seg(0, 0, 10, 0),
        seg(1, 10, 20, 1),
        seg(2, 20, 25, 2),
        seg(3, 25, 30, 2),
        seg(4, 30, 40, 3),
        seg(5, 40, 50, 4),
    ];
    let got = labels(&mut RecentTurns::new(2).unwrap(), &segs, None);
    assert_eq!(got, [Keep, Drop, Drop, Drop, Keep, Keep]);
    assert!(RecentTurns::new(0).is_err());
}

#[test]
fn the_rule_keeps_two_rounds_and_drops_or_compresses_by_length() {
    use Label::{Compress, Drop, Keep};
    let segs = [
        seg(0, 0, 600, 0),
        seg(1, 600, 610, 1),
        seg(2, 610, 1200, 1),
        seg(3, 1200, 1210, 2),
        seg(4, 1210, 1220, 3),
    ];
    let got = labels(&mut rule(), &segs, None);
    assert_eq!(got, [Keep, Drop, Compress, Keep, Keep]);
    assert!(RuleFallback::new(0, 512).is_err(), "protect 0");
    let e = RuleFallback::new(2, 0).unwrap_err().to_string();
    assert!(e.contains("threshold"), "{e}");
}

#[test]
fn model_labels_act_after_the_protected_rounds_and_fall_back_to_the_rule() {
    use Label::{Compress, Drop, Keep};
    let mut p = ModelLabels::new(LabelSource::Constrained, rule()).unwrap();
    assert!(ModelLabels::new(LabelSource::Rule, rule()).is_err());
    // Turn 1: two segments, the model keeps the first, drops the second.
    let mut segs = vec![seg(0, 0, 5, 0), seg(1, 5, 9, 1), seg(2, 9, 20, 1)];
    assert_eq!(labels(&mut p, &segs, None), [Keep, Keep, Keep]);
    segs.truncate(1);
    // (turn 0's labels were missing: the rule decides turn 0, which keeps.)
    let mut p = ModelLabels::new(LabelSource::Constrained, rule()).unwrap();
    let mut out = Vec::new();
    assert!(
        p.label(7, &segs, None, &mut out),
        "no labels: the rule stands in"
    );
    segs.extend([seg(1, 5, 9, 1), seg(2, 9, 20, 1)]);
    out.clear();
    assert!(!p.label(7, &segs, Some(&[Keep, Drop]), &mut out));
    assert_eq!(out, [Keep, Keep, Keep], "turn 1 is still protected");
    segs.push(seg(3, 20, 700, 2));
    out.clear();
    // A block of the wrong length is unusable.
    assert!(p.label(7, &segs, Some(&[Drop, Drop]), &mut out));
    segs.push(seg(4, 700, 710, 3));
    out.clear();
    p.label(7, &segs, Some(&[Drop]), &mut out);
    assert_eq!(
        out,
        [Keep, Keep, Drop, Keep, Keep],
        "turn 1's labels now apply"
    );
    segs.push(seg(5, 710, 720, 4));
    out.clear();
    p.label(7, &segs, Some(&[Keep]), &mut out);
    // Turn 2 had no usable labels: the rule compresses its long segment.
    assert_eq!(out, [Keep, Keep, Drop, Compress, Keep, Keep]);
}

fn turn<'a>(
    end: u64,
    cuts: &'a [u64],
    tokens: &'a [u32],
    model: Option<&'a [Label]>,
) -> TurnEnd<'a> {
    TurnEnd {
        end,
        cuts,
        tokens,
        stop: &[999],
        refer: None,
        model,
    }
}

#[test]
fn dropped_segments_wait_k_rounds_then_their_positions_are_freed() {
    let params = LifecycleParams {
        delay: 2,
        ..LifecycleParams::default()
    };
    let mut lc = Lifecycle::new(Box::new(RecentTurns::new(1).unwrap()), params).unwrap();
    let toks: Vec<u32> = (0..1000).collect();
    let o = lc.end_turn(1, turn(10, &[], &toks, None));
    assert_eq!((o.segments, o.queued), (1, 0));
    let o = lc.end_turn(1, turn(30, &[20], &toks, None));
    assert_eq!((o.segments, o.queued), (2, 0));
    // Turn 2 ends: turn 1's two segments are dropped, into the queue.
    let o = lc.end_turn(1, turn(40, &[], &toks, None));
    assert_eq!((o.queued, o.reclaimed), (2, 0));
    assert_eq!(lc.pending(1).len(), 2);
    let o = lc.end_turn(1, turn(50, &[], &toks, None));
    assert!(o.reclaim.is_empty(), "one round waited");
    let o = lc.end_turn(1, turn(60, &[], &toks, None));
    assert_eq!(o.reclaim, vec![10..30], "K = 2 rounds: freed, merged");
    assert_eq!(o.reclaimed, 2);
    // Turns 2 and 3 have been dropped since; turn 1 is gone from the queue.
    assert!(lc.pending(1).iter().all(|s| s.range.start >= 30));
    // K = 0: freed at the turn end that drops it.
    let mut lc = Lifecycle::new(
        Box::new(RecentTurns::new(1).unwrap()),
        LifecycleParams {
            delay: 0,
            ..LifecycleParams::default()
        },
    )
    .unwrap();
    lc.end_turn(1, turn(10, &[], &toks, None));
    lc.end_turn(1, turn(20, &[], &toks, None));
    let o = lc.end_turn(1, turn(30, &[], &toks, None));
    assert_eq!((o.queued, o.reclaim.clone()), (0, vec![10..20]));
}

#[test]
fn a_pending_segment_quoted_by_a_later_turn_is_revived() {
    let params = LifecycleParams {
        delay: 2,
        min_match: 4,
        compress_min: None,
    };
    let mut lc = Lifecycle::new(Box::new(RecentTurns::new(1).unwrap()), params).unwrap();
    // Positions 10..20 hold 100..110; turn 3 quotes 103..107.
    let mut toks: Vec<u32> = (0..60).map(|i| 1000 + i).collect();
    for i in 0..10 {
        toks[10 + i] = 100 + i as u32;
    }
    toks[35..39].copy_from_slice(&[103, 104, 105, 106]);
    // Turn 2 repeats a run through a stop token only: not a reference.
    toks[25..29].copy_from_slice(&[100, 101, 999, 102]);
    lc.end_turn(1, turn(10, &[], &toks, None));
    lc.end_turn(1, turn(20, &[], &toks, None));
    let o = lc.end_turn(1, turn(30, &[], &toks, None));
    assert_eq!((o.queued, o.revived), (1, 0));
    let o = lc.end_turn(1, turn(40, &[], &toks, None));
    assert_eq!(o.revived, 1);
    assert!(lc.pending(1).iter().all(|s| s.range.start >= 20));
    for _ in 0..4 {
        let end = lc.live(1).last().unwrap().range.end + 5;
        let o = lc.end_turn(1, turn(end, &[], &toks, None));
        assert!(
            o.reclaim.iter().all(|r| r.end <= 10 || r.start >= 20),
            "revived: kept for good"
        );
    }
}

/// Labels the first turn `compress` and every other turn but the newest
/// `drop`.
struct CompressFirst;

impl LifecyclePolicy for CompressFirst {
    fn name(&self) -> String {
        "compress-first".into()
    }
    fn label(
        &mut self,
        _seq: u64,
        segments: &[Segment],
        _model: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let newest = segments.last().map_or(0, |s| s.turn);
        out.extend(segments.iter().map(|s| match s.turn {
            t if t == newest => Label::Keep,
            0 => Label::Compress,
            _ => Label::Drop,
        }));
        false
    }
}

#[test]
fn the_freed_union_merges_segments_freed_at_different_turns() {
    let params = LifecycleParams {
        delay: 0,
        compress_min: Some(1),
        ..LifecycleParams::default()
    };
    let mut lc = Lifecycle::new(Box::new(CompressFirst), params).unwrap();
    let toks = [];
    let mut handed = Vec::new();
    for end in [6, 12, 18, 24, 30] {
        handed.extend(lc.end_turn(1, turn(end, &[], &toks, None)).compress);
    }
    assert_eq!(handed, vec![seg(0, 0, 6, 0)]);
    assert_eq!(lc.freed(1), vec![6..24]);
    lc.compressed(1, handed[0].clone(), true).unwrap();
    assert_eq!(lc.freed(1), vec![0..24]);
}

#[test]
fn an_answer_for_a_segment_never_handed_out_is_refused_and_changes_nothing() {
    let params = LifecycleParams {
        delay: 0,
        compress_min: Some(1),
        ..LifecycleParams::default()
    };
    let mut lc = Lifecycle::new(Box::new(CompressFirst), params).unwrap();
    let toks = [];
    lc.end_turn(1, turn(6, &[], &toks, None));
    let o = lc.end_turn(1, turn(12, &[], &toks, None));
    let live = lc.live(1);
    // Never handed out: another range, another sequence, a kept segment.
    for (seq, bad) in [
        (1, seg(0, 0, 5, 0)),
        (2, o.compress[0].clone()),
        (1, seg(1, 6, 12, 1)),
    ] {
        let e = lc.compressed(seq, bad, true).unwrap_err();
        assert!(e.to_string().contains("was not handed out"), "{e}");
        assert_eq!(lc.freed(1), Vec::<std::ops::Range<u64>>::new());
        assert_eq!(lc.live(1), live);
    }
    // Answered once: a second answer is refused too.
    lc.compressed(1, o.compress[0].clone(), false).unwrap();
    assert!(lc.compressed(1, o.compress[0].clone(), true).is_err());
    assert_eq!(lc.freed(1), Vec::<std::ops::Range<u64>>::new());
}

#[test]
fn only_the_referring_part_of_a_turn_revives() {
    let params = LifecycleParams {
        delay: 2,
        min_match: 4,
        compress_min: None,
    };
    let mut lc = Lifecycle::new(Box::new(RecentTurns::new(1).unwrap()), params).unwrap();
    let mut toks: Vec<u32> = (0..60).map(|i| 1000 + i).collect();
    for i in 0..10 {
        toks[10 + i] = 100 + i as u32;
    }
    // Turn 3 (30..40) repeats 103..107 in its reply (35..39), not in its
    // user part (30..35).
    toks[35..39].copy_from_slice(&[103, 104, 105, 106]);
    let end = |lc: &mut Lifecycle, e: u64, refer| {
        lc.end_turn(
            1,
            TurnEnd {
                end: e,
                cuts: &[],
                tokens: &toks,
                stop: &[],
                refer,
                model: None,
            },
        )
    };
    end(&mut lc, 10, None);
    end(&mut lc, 20, None);
    assert_eq!(end(&mut lc, 30, None).queued, 1);
    assert_eq!(
        end(&mut lc, 40, Some(30..35)).revived,
        0,
        "the reply does not count"
    );
    assert!(lc.pending(1).iter().any(|s| s.range.start == 10));
}

#[test]
fn long_segments_labelled_compress_are_handed_out_short_ones_kept() {
    let params = LifecycleParams {
        delay: 2,
        compress_min: Some(100),
        ..LifecycleParams::default()
    };
    let mut lc = Lifecycle::new(Box::new(RuleFallback::new(1, 50).unwrap()), params).unwrap();
    let toks = [];
    lc.end_turn(1, turn(10, &[], &toks, None));
    // Turn 1: a 60-token and a 200-token segment; the rule compresses both
    // (>= 50) once old, the lifecycle only hands out the one >= 100.
    lc.end_turn(1, turn(270, &[70], &toks, None));
    let o = lc.end_turn(1, turn(280, &[], &toks, None));
    assert_eq!(o.compress, vec![seg(2, 70, 270, 1)]);
    assert_eq!(o.queued, 0);
    lc.compressed(1, o.compress[0].clone(), false).unwrap();
    let live: Vec<u64> = lc.live(1).iter().map(|s| s.range.start).collect();
    assert_eq!(
        live,
        [0, 10, 70, 270],
        "a refused summary keeps the segment"
    );
    let e = Lifecycle::new(
        Box::new(rule()),
        LifecycleParams {
            compress_min: Some(0),
            ..LifecycleParams::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("at least 1 token"), "{e}");
}

/// A policy that answers what the test scripted.
struct Scripted(Vec<Label>);

impl LifecyclePolicy for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn label(
        &mut self,
        _: u64,
        segs: &[Segment],
        _: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let last = segs.last().map_or(0, |s| s.turn);
        out.extend(segs.iter().enumerate().map(|(i, s)| {
            if s.turn == last {
                Label::Keep
            } else {
                self.0[(s.id as usize + i) % self.0.len()]
            }
        }));
        false
    }
}

proptest::proptest! {
    /// Whatever the labels, a segment is freed only after it was labelled
    /// drop, `delay` rounds later, and never twice; compress hands out only
    /// segments of at least the threshold.
    #[test]
    fn nothing_is_freed_that_was_not_dropped_k_rounds_before(
        script in proptest::collection::vec(0u8..3, 1..8),
        delay in 0u32..4,
        lens in proptest::collection::vec(1u64..40, 3..14),
    ) {
        let labels: Vec<Label> = script
            .iter()
            .map(|&x| [Label::Keep, Label::Compress, Label::Drop][x as usize])
            .collect();
        let params = LifecycleParams { delay, min_match: 0, compress_min: Some(20) };
        let mut lc = Lifecycle::new(Box::new(Scripted(labels)), params).unwrap();
        let mut end = 0u64;
        let mut dropped_at: std::collections::HashMap<u64, u32> = Default::default();
        let mut freed = std::collections::HashSet::new();
        for (t, &len) in lens.iter().enumerate() {
            let pending_before: Vec<u64> = lc.pending(1).iter().map(|s| s.range.start).collect();
            end += len;
            let cut = [end - len / 2];
            let o = lc.end_turn(1, turn(end, &cut, &[], None));
            for s in lc.pending(1) {
                if !pending_before.contains(&s.range.start) {
                    dropped_at.insert(s.range.start, t as u32);
                }
            }
            for g in &o.compress {
                proptest::prop_assert!(g.len() >= 20);
                lc.compressed(1, g.clone(), false).unwrap();
            }
            for r in &o.reclaim {
                proptest::prop_assert!(r.end <= end - len, "the newest turn is never freed");
                for x in r.clone() {
                    proptest::prop_assert!(freed.insert(x), "position {} freed twice", x);
                }
                if delay > 0 {
                    let at = dropped_at.get(&r.start).copied();
                    proptest::prop_assert_eq!(at.map(|a| a + delay), Some(t as u32), "{:?}", r);
                }
            }
        }
    }
}

mod segments {
    use kvforge_lifecycle::split_sentences;

    #[test]
    fn sentences_and_lines_cut_short_pieces_join() {
        let p = [
            "<|im_start|>",
            "user",
            "\n",
            "My",
            " code",
            " is",
            " 4821",
            ".",
            " The",
            " sky",
            " is",
            " blue",
            ".",
            " Ok",
            ".",
            "\n",
            "Next",
            " line",
            "<|im_end|>",
        ];
        let got = split_sentences(&p, 2);
        // The header, two sentences, "Ok." with its line break, the last
        // line with its end token.
        assert_eq!(got, vec![0..3, 3..8, 8..13, 13..16, 16..19]);
        // At 3 tokens "Ok." and the last line join the sentence before.
        assert_eq!(split_sentences(&p, 3), vec![0..3, 3..8, 8..19]);
        let got = split_sentences(&p, 1);
        assert_eq!(got.first(), Some(&(0..1)));
        assert!(split_sentences::<&str>(&[], 4).is_empty());
        // No boundary at all: one segment; "3.5" is not a sentence end.
        assert_eq!(split_sentences(&["a", " 3", ".", "5", " b"], 2), vec![0..5]);
        // Tiling holds for any minimum.
        for min in 0..8 {
            let r = split_sentences(&p, min);
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, p.len());
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}

mod grammar {
    use kvforge_lifecycle::{Label, LabelGrammar, Viability, parse_labels};

    #[test]
    fn the_label_grammar_accepts_its_blocks_and_their_prefixes_only() {
        let g = LabelGrammar::new(3);
        let block = LabelGrammar::render(&[Label::Keep, Label::Drop, Label::Compress]);
        assert_eq!(
            block,
            "[LIFECYCLE] seg_0: keep seg_1: drop seg_2: compress [/LIFECYCLE]"
        );
        assert_eq!(g.check(&block), Viability::Complete);
        for i in 0..block.len() {
            assert_eq!(g.check(&block[..i]), Viability::Open, "{:?}", &block[..i]);
        }
        for bad in [
            "x",
            "[LIFECYCLE] seg_1",
            "[LIFECYCLE] seg_0: maybe",
            "[LIFECYCLE] seg_0: keep seg_1: drop seg_2: compress [/LIFECYCLE] ",
            "[LIFECYCLE] seg_0: keep [/LIFECYCLE]",
        ] {
            assert_eq!(g.check(bad), Viability::Dead, "{bad}");
        }
        assert_eq!(
            LabelGrammar::new(0).check("[LIFECYCLE] [/LIFECYCLE]"),
            Viability::Complete
        );
        // Every complete block parses into a valid one with its labels.
        for n in 1..5usize {
            for code in 0..3usize.pow(n as u32) {
                let ls: Vec<Label> = (0..n)
                    .map(|i| {
                        [Label::Keep, Label::Compress, Label::Drop][code / 3usize.pow(i as u32) % 3]
                    })
                    .collect();
                let b = LabelGrammar::render(&ls);
                assert_eq!(LabelGrammar::new(n).check(&b), Viability::Complete);
                let p = parse_labels(&b, n);
                assert!(p.valid() && p.labels == ls, "{b}");
            }
        }
    }
}

mod labels {
    use kvforge_lifecycle::{Label, parse_labels};
    use proptest::prelude::*;

    use Label::{Compress, Drop, Keep};

    #[test]
    fn the_seed_format_parses_and_leaves_the_context() {
        let p = parse_labels(
            "Sure, here it is.\n[LIFECYCLE] seg_0: keep seg_1: drop seg_2: compress [/LIFECYCLE]",
            4,
        );
        assert_eq!(p.text, "Sure, here it is.\n");
        assert_eq!(p.labels, vec![Keep, Drop, Compress, Keep], "missing = keep");
        assert!(p.valid());
        assert_eq!((p.blocks, p.labelled, p.ignored), (1, 3, 0));
    }

    #[test]
    fn case_spacing_and_separators_vary() {
        for text in [
            "[lifecycle]seg_0:DROP,seg_1 : Compress;seg_2=keep[/lifecycle]",
            "[ LifeCycle ]\n segment 0 - drop\n seg-1 summarize\n SEG_2: retain\n[ / LIFECYCLE ]",
            "[LIFECYCLE] seg_0 : remove , seg_1 :summarise , seg_2: keep [/LIFECYCLE] trailing",
        ] {
            let p = parse_labels(text, 3);
            assert_eq!(p.labels, vec![Drop, Compress, Keep], "{text}");
            assert!(p.complete && p.valid(), "{text}");
            assert!(!p.text.to_ascii_lowercase().contains("lifecycle"), "{text}");
        }
    }

    #[test]
    fn unknown_labels_missing_segments_and_truncation_are_tolerated() {
        let p = parse_labels(
            "ok [LIFECYCLE] seg_0: maybe seg_9: drop seg_1: drop seg_2",
            3,
        );
        assert_eq!(p.labels, vec![Keep, Drop, Keep]);
        assert_eq!(p.text, "ok ");
        assert_eq!((p.labelled, p.ignored), (1, 3));
        assert!(!p.complete && !p.valid(), "cut off and partly unusable");
        // No block: everything is kept, the text is unchanged.
        let p = parse_labels("no labels here [/LIFECYCLE]", 2);
        assert_eq!(p.labels, vec![Keep, Keep]);
        assert_eq!(p.text, "no labels here [/LIFECYCLE]");
        assert_eq!(p.blocks, 0);
        // A later block overrides an earlier one; both leave the text.
        let p = parse_labels(
            "a[LIFECYCLE]seg_0: drop[/LIFECYCLE]b[LIFECYCLE]seg_0: keep seg_1: drop[/LIFECYCLE]c",
            2,
        );
        assert_eq!(p.labels, vec![Keep, Drop]);
        assert_eq!(p.text, "abc");
        // Removing a block joins a tag from the text around it: gone too.
        let p = parse_labels(
            "[LIFE[LIFECYCLE]seg_0: drop[/LIFECYCLE]CYCLE] seg_1: drop",
            2,
        );
        assert_eq!(p.labels, vec![Drop, Drop]);
        assert_eq!(p.text, "");
        // A huge segment number is ignored, not an overflow.
        let p = parse_labels(
            "[LIFECYCLE] seg_99999999999999999999999: drop [/LIFECYCLE]",
            2,
        );
        assert_eq!((p.labels, p.ignored), (vec![Keep, Keep], 1));
    }

    #[test]
    fn nested_enormous_and_mid_answer_blocks_are_defined() {
        // Nested: the inner opening tag ends the outer body (cut off); the
        // inner block is parsed; both leave the text.
        let p = parse_labels(
            "a [LIFECYCLE] seg_0: drop [LIFECYCLE] seg_1: drop [/LIFECYCLE] b [/LIFECYCLE] c",
            3,
        );
        assert_eq!(p.labels, vec![Drop, Drop, Keep]);
        assert!(!p.text.to_ascii_lowercase().contains("[lifecycle]"));
        // Mid-answer: the block leaves, the answer around it stays.
        let p = parse_labels("The code is [LIFECYCLE] seg_0: keep [/LIFECYCLE]4821.", 1);
        assert_eq!(p.text, "The code is 4821.");
        assert!(p.valid());
        // A 1 MB block: parsed in one pass, no label outside the segments.
        let mut big = String::from("[LIFECYCLE]");
        while big.len() < 1 << 20 {
            big.push_str(" seg_1: drop seg_77: keep junk");
        }
        big.push_str("[/LIFECYCLE]");
        let p = parse_labels(&big, 2);
        assert_eq!(p.labels, vec![Keep, Drop]);
        assert!(p.ignored > 10_000 && !p.valid());
        assert!(p.text.is_empty());
    }

    /// Fragments the model (and a fuzzer) might write.
    const PIECES: &[&str] = &[
        "[LIFECYCLE]",
        "[/LIFECYCLE]",
        "[ lifecycle ]",
        "[/",
        "[",
        "]",
        "seg_",
        "seg",
        "segment ",
        "0",
        "1",
        "2",
        "17",
        "99999999999999999999",
        ":",
        "=",
        ",",
        ";",
        " ",
        "\n",
        "keep",
        "drop",
        "compress",
        "Drop",
        "KEEP",
        "summarize",
        "maybe",
        "é",
        "日本",
        "\u{0}",
        "LIFECYCLE",
        "-",
        "[LIFE",
        "CYCLE]",
    ];

    fn assemble(picks: &[usize]) -> String {
        picks.iter().map(|&i| PIECES[i % PIECES.len()]).collect()
    }

    proptest! {
        /// Any text: no panic, one label per segment, never a label for a
        /// segment that does not exist, no complete opening tag left.
        #[test]
        fn parsing_never_labels_a_segment_that_does_not_exist(
            picks in proptest::collection::vec(0usize..64, 0..60),
            segments in 0usize..6,
        ) {
            let text = assemble(&picks);
            let p = parse_labels(&text, segments);
            prop_assert_eq!(p.labels.len(), segments);
            prop_assert!(p.labelled as usize <= text.matches("seg").count());
            let lower = p.text.to_ascii_lowercase();
            prop_assert!(!lower.contains("[lifecycle]"), "{:?} -> {:?}", text, p.text);
            prop_assert!(!lower.contains("[ lifecycle ]"), "{:?} -> {:?}", text, p.text);
            // Only labelled segments change from keep, and only by a label
            // the text names.
            let named = |w: &str| text.to_ascii_lowercase().contains(w);
            for l in &p.labels {
                match l {
                    Drop => prop_assert!(named("drop") || named("remove") || named("discard")),
                    Compress => prop_assert!(named("compress") || named("summari")),
                    Keep => {}
                }
            }
        }
    }

    /// A seeded mutation loop of 10^6 inputs (the toolchain's cargo-fuzz
    /// target `labels` explores further: `cargo xtask fuzz`): byte flips,
    /// insertions of fragments, truncations of valid blocks. No panic, and
    /// the invariants of the property test.
    #[test]
    fn a_million_mutated_blocks_never_panic() {
        let seeds = [
            "[LIFECYCLE] seg_0: keep seg_1: drop seg_2: compress [/LIFECYCLE]",
            "reply text [ lifecycle ] segment 3 = Drop; seg-1 summarize [ / LIFECYCLE ]",
            "[LIFECYCLE]seg_0:drop[/LIFECYCLE][LIFECYCLE]seg_1:keep",
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut labelled = 0u64;
        for i in 0..1_000_000u32 {
            let mut b = seeds[i as usize % seeds.len()].as_bytes().to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % (b.len() + 1);
                match next() % 4 {
                    0 if !b.is_empty() => {
                        let at = at.min(b.len() - 1);
                        b[at] ^= 1 << (next() % 8);
                    }
                    1 => {
                        let piece = PIECES[(next() as usize) % PIECES.len()].as_bytes();
                        b.splice(at..at, piece.iter().copied());
                    }
                    2 => b.truncate(at),
                    _ => {
                        if at < b.len() {
                            b.remove(at);
                        }
                    }
                }
            }
            let text = String::from_utf8_lossy(&b);
            let segments = (next() % 5) as usize;
            let p = parse_labels(&text, segments);
            assert_eq!(p.labels.len(), segments);
            labelled += u64::from(p.labelled);
        }
        assert!(
            labelled > 100_000,
            "the mutations kept many blocks parseable: {labelled}"
        );
    }
}
