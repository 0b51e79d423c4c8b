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
