//! The context lifecycle in sessions: constrained decoding always yields a
//! valid label block; labels, delayed reclamation and compression change
//! the session's table and give its blocks back; the labelling pass leaves
//! nothing behind.

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{
    CacheManager, Constraint, Device, Engine, EngineConfig, Kind, LabelSource, LifecycleConfig,
    Llama, LlamaConfig, ReuseConfig, SamplingParams, Sequence, Tokenizer,
};
use kvforge_lifecycle::{LabelGrammar, Viability, parse_labels};
use kvforge_pool::BlockAllocator;

use super::model_path;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(&model_path()).unwrap()).unwrap()
}

/// A random-weight model of the real tokenizer's vocabulary, so that text
/// is cut into real sentences.
fn tiny_engine(lifecycle: Option<LifecycleConfig>) -> Engine {
    let tok = tokenizer();
    let mc = LlamaConfig {
        vocab: tok.vocab,
        max_ctx: 4096,
        ..LlamaConfig::tiny()
    };
    let model = Llama::random(mc, 7, Device::Cpu, Kind::Float).unwrap();
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 4096,
        lifecycle,
        ..Default::default()
    };
    Engine::new(model, tok, &cfg).unwrap()
}

#[test]
fn constrained_decoding_gives_a_valid_block_even_from_random_weights() {
    let e = tiny_engine(None);
    let prompt = e.tokenizer().encode("Label the segments:").unwrap();
    for n in [1usize, 3, 6] {
        let mut seq = Sequence::default();
        let out = e
            .generate_constrained(&mut seq, &prompt, &LabelGrammar::new(n), 200)
            .unwrap();
        assert!(out.complete, "{n}: {:?}", out.text);
        assert_eq!(LabelGrammar::new(n).check(&out.text), Viability::Complete);
        let p = parse_labels(&out.text, n);
        assert!(p.valid(), "{:?}", out.text);
        assert!(out.overridden > 0, "random weights need the grammar");
        e.cache().free(&mut seq).unwrap();
    }
    // A grammar nothing satisfies is an error, not a panic or a loop.
    struct Nothing;
    impl Constraint for Nothing {
        fn check(&self, _: &str) -> Viability {
            Viability::Dead
        }
    }
    let mut seq = Sequence::default();
    let err = e
        .generate_constrained(&mut seq, &prompt, &Nothing, 8)
        .unwrap_err();
    assert!(err.to_string().contains("no token continues"), "{err}");
    e.cache().free(&mut seq).unwrap();
    let err = e
        .generate_constrained(&mut seq, &prompt, &LabelGrammar::new(1), 10_000)
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
}

/// A fork continues what its source holds: the source, continued on the
/// same schedule, gives the fork's tokens bit for bit; against a fresh
/// sequence that prefills everything at once (another computation order)
/// the fork's teacher-forced logits agree within `TINY_VOCAB_TOL` and its
/// greedy tokens follow the fresh ones up to their first near-tie; a fork
/// of a source whose KV is wrong at one position does not.
#[test]
fn a_fork_continues_as_a_fresh_sequence_and_leaves_the_original_alone() {
    use super::forced::{TINY_VOCAB_TOL as TOL, agree, follows, forced};
    let e = tiny_engine(None);
    let p: Vec<u32> = (0..13).map(|i| 100 + i * 7).collect();
    let suffix: Vec<u32> = vec![5, 6, 7, 8, 9];
    let greedy = SamplingParams {
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    let mut all = p.clone();
    all.extend(&suffix);
    let mut fresh = Sequence::default();
    let want = e
        .generate(&mut fresh, &all, &greedy, &mut |_, _| true)
        .unwrap();
    let mut again = Sequence::default();
    let want_rows = forced(&e, &mut again, &all, &want.tokens);
    let mut a = Sequence::default();
    e.generate(
        &mut a,
        &p,
        &SamplingParams {
            max_tokens: 1,
            ..greedy.clone()
        },
        &mut |_, _| true,
    )
    .unwrap();
    let mut f = e.cache().fork(&a).unwrap();
    let mut f2 = e.cache().fork(&a).unwrap();
    let got = e
        .generate(&mut f, &suffix, &greedy, &mut |_, _| true)
        .unwrap();
    follows(&got.tokens, &want.tokens, &want_rows, TOL).unwrap();
    let rows = forced(&e, &mut f2, &suffix, &want.tokens);
    agree(Some("fork logits"), &rows, &want_rows, TOL).unwrap();
    let mut wrong_source = Sequence::default();
    let mut wrong_p = p.clone();
    wrong_p[6] += 1;
    let _ = e
        .model()
        .forward(&wrong_p, &mut e.cache().view(&mut wrong_source), false)
        .unwrap();
    let mut wrong_fork = e.cache().fork(&wrong_source).unwrap();
    let wrong = forced(&e, &mut wrong_fork, &suffix, &want.tokens);
    let err = agree(None, &wrong, &want_rows, TOL).expect_err("wrong KV at one position");
    eprintln!("a fork over wrong KV at one position: caught ({err})");
    e.cache().free(&mut wrong_fork).unwrap();
    e.cache().free(&mut wrong_source).unwrap();
    // The original continues as if there had been no fork.
    let after = e
        .generate(&mut a, &suffix, &greedy, &mut |_, _| true)
        .unwrap();
    assert_eq!(after.tokens, got.tokens);
    for s in [&mut a, &mut f, &mut f2, &mut fresh, &mut again] {
        e.cache().free(s).unwrap();
    }
    assert_eq!(e.cache().with_coordinator(|c| c.pools().stats().in_use), 0);
}

const TURNS: [&str; 6] = [
    "Hello there. My locker code is 4821. Please remember it.",
    "I like rainy days. The garden was wet this morning. Birds were singing.",
    "What a day it has been. My sister lives in Oslo. She is a painter.",
    "The train was late again. I read a book on the way. It was about ships.",
    "Tell me something nice. The weather is cold today. I made some tea.",
    "Thanks for listening. Goodbye for now.",
];

fn params() -> SamplingParams {
    SamplingParams {
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn session_labels_reclaim_after_k_rounds_and_give_blocks_back() {
    for source in [
        LabelSource::Rule,
        LabelSource::Free,
        LabelSource::Constrained,
    ] {
        let lc = LifecycleConfig::Labels {
            source,
            protect: 1,
            delay: 1,
            min_match: 6,
            compress_min: None,
        };
        let m = CacheManager::new(tiny_engine(Some(lc)), ReuseConfig::default()).unwrap();
        let id = m.open_session("t");
        let (mut reclaimed, mut dropped) = (0, 0);
        for (i, text) in TURNS.iter().enumerate() {
            let toks = m.engine().tokenizer().user_turn_ids(i > 0, text).unwrap();
            let r = m.turn(id, &toks, &params(), &mut |_, _| true).unwrap();
            let l = r.lifecycle.expect("a lifecycle report every turn");
            assert!(l.segments >= 2, "{source:?} turn {i}: {l:?}");
            match source {
                LabelSource::Rule => assert_eq!(l.labels_valid, None),
                LabelSource::Constrained => {
                    assert_eq!(l.labels_valid, Some(true), "{l:?}");
                    assert_eq!(l.labels.len(), l.segments as usize);
                    assert!(!l.fallback);
                }
                LabelSource::Free => assert!(l.labels_valid.is_some()),
            }
            reclaimed += l.reclaimed;
            dropped += l.dropped_entries;
            // Blocks in use are exactly the session's live entries: the
            // labelling fork gave everything back.
            let table = m.session_table(id).unwrap();
            let live = table
                .entries()
                .iter()
                .filter(|e| e.slot().is_live())
                .count();
            let in_use =
                m.with_engine(|e| e.cache().with_coordinator(|c| c.pools().stats().in_use));
            assert_eq!(in_use, live, "{source:?} turn {i}");
        }
        let metrics = m.metrics();
        let p = &metrics["policies"];
        assert_eq!(p["lifecycle_reclaimed"], u64::from(reclaimed), "{metrics}");
        assert_eq!(p["lifecycle_dropped_entries"], dropped as u64, "{metrics}");
        if source == LabelSource::Rule {
            // The rule drops every old segment but turn 0's: 4 turns left
            // the protected round and waited one more.
            assert!(reclaimed >= 8 && dropped > 0, "{metrics}");
        }
        let last = &metrics["last_turn"]["lifecycle"];
        assert!(last["segments"].as_u64().unwrap() >= 2, "{metrics}");
        m.close_session(id).unwrap();
        assert_eq!(m.metrics()["pool"]["blocks_in_use"], 0);
    }
}

#[test]
fn a_cut_off_reply_keeps_a_segment_labelled_compress() {
    let lc = LifecycleConfig::Labels {
        source: LabelSource::Rule,
        protect: 1,
        delay: 2,
        min_match: 6,
        compress_min: Some(12),
    };
    let m = CacheManager::new(tiny_engine(Some(lc)), ReuseConfig::default()).unwrap();
    let tok = tokenizer();
    let id = m.open_session("t");
    let long = "This is a long background sentence about the history of the old harbour town and its many ships";
    let mut report = Vec::new();
    for (i, text) in [long, "Ok then.", "Fine.", "Sure."].iter().enumerate() {
        let toks = tok.user_turn_ids(i > 0, text).unwrap();
        let r = m.turn(id, &toks, &params(), &mut |_, _| true).unwrap();
        report.push(r.lifecycle.unwrap());
    }
    // Replies were cut off (ignore_eos): no system message can follow, so
    // the summary is refused and the long segments are kept.
    let refused: u32 = report.iter().map(|l| l.compress_refused).sum();
    let compressed: u32 = report.iter().map(|l| l.compressed).sum();
    assert!(refused >= 1 && compressed == 0, "{report:?}");
    let table = m.session_table(id).unwrap();
    assert!(
        table
            .entries()
            .iter()
            .any(|e| e.first() == 20 && e.slot().is_live())
    );
    m.close_session(id).unwrap();
}

/// The real model summarises a long segment at 3:1 or better; the summary
/// joins the next turn as a system message and the segment's KV is gone.
#[test]
fn a_long_segment_is_summarised_by_the_real_model() {
    let lc = LifecycleConfig::Labels {
        source: LabelSource::Rule,
        protect: 1,
        delay: 1,
        min_match: 6,
        compress_min: Some(48),
    };
    let cfg = EngineConfig {
        lifecycle: Some(lc),
        kv_tokens: 4096,
        ..Default::default()
    };
    let engine = Engine::load(&model_path(), &cfg).unwrap();
    let m = CacheManager::new(engine, ReuseConfig::default()).unwrap();
    let tok = tokenizer();
    // One sentence of more than 48 tokens, in turn 1 (turn 0 always stays).
    let long = "The harbour town of Kerrow was founded in 1642 by fishermen from the north coast, \
        who built the first stone pier and a small chapel, and over two centuries it grew into a \
        busy port for wool and tin, with shipyards along the river and a market every Thursday.";
    let p = SamplingParams {
        max_tokens: 48,
        ..Default::default()
    };
    let id = m.open_session("t");
    let mut reports = Vec::new();
    let mut close = false;
    for text in ["Hello.", long, "Thank you.", "What else?", "Tell me more."] {
        let toks = tok.user_turn_ids(close, text).unwrap();
        let r = m.turn(id, &toks, &p, &mut |_, _| true).unwrap();
        close = !r.generation.stopped_at_eos;
        reports.push((r.prompt_tokens, r.lifecycle.unwrap()));
    }
    let done: Vec<_> = reports.iter().filter(|(_, l)| l.compressed > 0).collect();
    assert!(!done.is_empty(), "{reports:?}");
    let l = &done[0].1;
    assert!(l.summary_tokens > 0 && l.dropped_entries > 0, "{l:?}");
    let metrics = m.metrics();
    assert!(
        metrics["policies"]["lifecycle_compressed"]
            .as_u64()
            .unwrap()
            >= 1
    );
    m.close_session(id).unwrap();
}
