//! Prefix reuse through the cache manager: identical greedy outputs with and
//! without reuse, stateless and in sessions; bad requests change nothing;
//! many threads with shared prefixes and aborts leak nothing.

use std::sync::atomic::{AtomicU64, Ordering};

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, IndexKind, ReuseConfig, SamplingParams, Tokenizer, TurnTail,
};
use kvforge_pool::BlockAllocator;

use super::{model_path, tiny};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(&model_path()).unwrap()).unwrap()
}

fn tiny_manager(block_size: usize, kv_tokens: usize, reuse: ReuseConfig) -> CacheManager {
    let cfg = EngineConfig {
        block_size,
        kv_tokens,
        ..Default::default()
    };
    let engine = Engine::new(tiny(), tokenizer(), &cfg).unwrap();
    CacheManager::new(engine, reuse).unwrap()
}

/// xorshift, seeded.
pub(super) fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

fn user_turns(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut r = rng(seed);
    (0..n)
        .map(|_| {
            let len = 3 + (r() % 10) as usize;
            (0..len).map(|_| 3 + (r() % 94) as u32).collect()
        })
        .collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Stateless replay: every turn re-sends the whole history. Returns the
/// answers and the reused token count of each turn.
fn stateless(
    m: &CacheManager,
    users: &[Vec<u32>],
    p: &SamplingParams,
) -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut prompt: Vec<u32> = Vec::new();
    let (mut answers, mut reused) = (Vec::new(), Vec::new());
    for u in users {
        prompt.extend(u);
        let r = m.complete(&prompt, "tenant", p, &mut |_, _| true).unwrap();
        prompt.extend(&r.generation.tokens);
        reused.push(r.reused_tokens);
        answers.push(r.generation.tokens);
    }
    (answers, reused)
}

fn session(m: &CacheManager, users: &[Vec<u32>], p: &SamplingParams) -> Vec<Vec<u32>> {
    let id = m.open_session("tenant");
    let answers = users
        .iter()
        .map(|u| {
            m.turn(id, u, p, &mut |_, _| true)
                .unwrap()
                .generation
                .tokens
        })
        .collect();
    m.close_session(id).unwrap();
    answers
}

#[test]
fn reuse_gives_identical_greedy_outputs_over_16_turns() {
    let users = user_turns(16, 42);
    let p = params(6);
    let off = ReuseConfig {
        enabled: false,
        ..Default::default()
    };
    let (want, none) = stateless(&tiny_manager(4, 512, off), &users, &p);
    assert!(none.iter().all(|&r| r == 0));
    for bs in [1usize, 4, 16] {
        for tail in [TurnTail::Skip, TurnTail::Seal, TurnTail::Copy] {
            let seal = tail != TurnTail::Skip;
            for index in [IndexKind::HashChain, IndexKind::Radix] {
                let cfg = ReuseConfig {
                    enabled: true,
                    index,
                    tail,
                    seed: Some(1),
                };
                let m = tiny_manager(bs, 512, cfg.clone());
                let (got, reused) = stateless(&m, &users, &p);
                let label = format!("block {bs}, {tail:?}, {index:?}");
                assert_eq!(got, want, "{label}: answers differ with reuse");
                // Reusable: everything computed before (history minus the
                // last sampled token, which was never run through the model).
                let mut history = 0usize;
                for (t, u) in users.iter().enumerate() {
                    if t > 0 {
                        let reusable = history - 1;
                        if seal {
                            assert_eq!(reused[t], reusable, "{label}, turn {t}");
                        } else {
                            assert!(
                                reused[t] + bs > reusable && reused[t] <= reusable,
                                "{label}, turn {t}: {} of {reusable}",
                                reused[t]
                            );
                        }
                    }
                    history += u.len() + p.max_tokens;
                }
                assert_eq!(
                    session(&m, &users, &p),
                    want,
                    "{label}: session answers differ"
                );
                let metrics = m.metrics();
                assert_eq!(metrics["pool"]["blocks_in_use"], 0, "{label}: {metrics}");
                assert!(metrics["reused_tokens"].as_u64().unwrap() > 0);
            }
        }
    }
}

#[test]
fn a_session_reuses_what_other_requests_cached_across_namespaces_only_within() {
    let m = tiny_manager(
        4,
        512,
        ReuseConfig {
            seed: Some(3),
            ..Default::default()
        },
    );
    let system: Vec<u32> = (10..50).collect();
    let p = params(4);
    let r = m.complete(&system, "a", &p, &mut |_, _| true).unwrap();
    assert_eq!(r.reused_tokens, 0);
    let id = m.open_session("a");
    let r = m.turn(id, &system, &p, &mut |_, _| true).unwrap();
    // All whole blocks of the shared prompt, keeping its last token to compute.
    assert_eq!(
        r.reused_tokens,
        (system.len() - 1) / 4 * 4,
        "the shared prompt is computed once"
    );
    let other = m.open_session("b");
    let r = m.turn(other, &system, &p, &mut |_, _| true).unwrap();
    assert_eq!(r.reused_tokens, 0, "namespaces never share blocks");
    m.close_session(id).unwrap();
    m.close_session(other).unwrap();
}

#[test]
fn bad_requests_are_errors_and_leave_the_cache_unchanged() {
    let m = tiny_manager(
        4,
        64,
        ReuseConfig {
            seed: Some(5),
            ..Default::default()
        },
    );
    let p = params(4);
    m.complete(&[5, 6, 7, 8, 9, 10, 11, 12, 13], "t", &p, &mut |_, _| true)
        .unwrap();
    let id = m.open_session("t");
    m.turn(id, &[5, 6, 7, 8, 9], &p, &mut |_, _| true).unwrap();
    let snapshot = |m: &CacheManager| {
        let mut j = m.metrics();
        j["last_turn"] = serde_json::Value::Null;
        (
            j["pool"].clone(),
            j["index"]["cached_blocks"].clone(),
            j["requests"].clone(),
        )
    };
    let before = snapshot(&m);
    type BadCall<'a> = Box<dyn Fn() -> kvforge_engine::EngineError + 'a>;
    let cases: Vec<(&str, BadCall)> = vec![
        (
            "empty prompt",
            Box::new(|| m.complete(&[], "t", &p, &mut |_, _| true).unwrap_err()),
        ),
        (
            "outside the vocabulary",
            Box::new(|| m.complete(&[5, 97], "t", &p, &mut |_, _| true).unwrap_err()),
        ),
        (
            "whole pool",
            Box::new(|| {
                m.complete(&[5, 6], "t", &params(100), &mut |_, _| true)
                    .unwrap_err()
            }),
        ),
        (
            "does not exist",
            Box::new(|| m.turn(999, &[5], &p, &mut |_, _| true).unwrap_err()),
        ),
        (
            "does not exist",
            Box::new(|| m.close_session(999).unwrap_err()),
        ),
        (
            "empty prompt",
            Box::new(|| m.turn(id, &[], &p, &mut |_, _| true).unwrap_err()),
        ),
        (
            "outside the vocabulary",
            Box::new(|| m.turn(id, &[500], &p, &mut |_, _| true).unwrap_err()),
        ),
        (
            "top_p",
            Box::new(|| {
                m.complete(
                    &[5],
                    "t",
                    &SamplingParams {
                        top_p: 2.0,
                        ..p.clone()
                    },
                    &mut |_, _| true,
                )
                .unwrap_err()
            }),
        ),
    ];
    for (needle, call) in cases {
        let e = call().to_string();
        assert!(e.contains(needle), "{e}");
        assert!(!e.contains('\n'));
        assert_eq!(snapshot(&m), before, "state changed after: {e}");
    }
    // The session still works after its failed turns.
    m.turn(id, &[20, 21], &p, &mut |_, _| true).unwrap();
    m.close_session(id).unwrap();
    assert_eq!(m.metrics()["pool"]["blocks_in_use"], 0);
}

/// A request whose `on_token` panics (or a model that panics) gives back
/// its blocks before the panic goes on: nothing stays held, the lock is
/// usable, and a session is rolled back to before the turn.
#[test]
fn a_panic_inside_a_request_leaks_nothing_and_keeps_sessions() {
    let m = tiny_manager(
        4,
        256,
        ReuseConfig {
            seed: Some(9),
            ..Default::default()
        },
    );
    let p = params(6);
    let prompt: Vec<u32> = (5..40).collect();
    m.complete(&prompt, "t", &p, &mut |_, _| true).unwrap();
    let cached = m.metrics()["index"]["cached_blocks"].clone();
    let boom = || {
        let mut n = 0;
        move |_: u32, _: &str| -> bool {
            n += 1;
            assert!(n < 3, "the client's callback panics");
            true
        }
    };
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut cb = boom();
        m.complete(&prompt, "t", &p, &mut cb)
    }));
    assert!(caught.is_err(), "the panic reaches the caller");
    let j = m.metrics();
    assert_eq!(j["pool"]["blocks_in_use"], 0, "{j}");
    assert_eq!(j["index"]["cached_blocks"], cached, "{j}");

    // A session: one good turn, one that panics, then the same turn again
    // must answer as if the panicking one never happened.
    let users = user_turns(3, 17);
    let fresh = session(&m, &users, &p);
    let id = m.open_session("t");
    m.turn(id, &users[0], &p, &mut |_, _| true).unwrap();
    let held = m.metrics()["pool"]["blocks_in_use"].clone();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut cb = boom();
        m.turn(id, &users[1], &p, &mut cb)
    }));
    assert!(caught.is_err());
    assert_eq!(m.metrics()["pool"]["blocks_in_use"], held, "rolled back");
    let second = m.turn(id, &users[1], &p, &mut |_, _| true).unwrap();
    let third = m.turn(id, &users[2], &p, &mut |_, _| true).unwrap();
    assert_eq!(
        vec![second.generation.tokens, third.generation.tokens],
        fresh[1..].to_vec()
    );
    m.close_session(id).unwrap();
    // A first turn that panics gives back the prefix it acquired.
    let id = m.open_session("t");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut cb = boom();
        m.turn(id, &prompt, &p, &mut cb)
    }));
    assert!(caught.is_err());
    m.close_session(id).unwrap();
    assert_eq!(m.metrics()["pool"]["blocks_in_use"], 0);
}

#[test]
fn many_threads_with_shared_prefixes_and_aborts_leak_nothing() {
    let m = tiny_manager(
        4,
        256,
        ReuseConfig {
            seed: Some(9),
            ..Default::default()
        },
    );
    let system: Vec<u32> = (10..30).collect();
    let aborted = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (m, system, aborted) = (&m, &system, &aborted);
            s.spawn(move || {
                let mut r = rng(t + 77);
                for _ in 0..12 {
                    let mut prompt = system.clone();
                    prompt.extend((0..(r() % 8)).map(|_| 3 + (r() % 90) as u32));
                    let cut = (r() % 5) as usize;
                    let mut n = 0;
                    // Random aborts: the client stops reading after `cut` tokens.
                    let mut on = |_: u32, _: &str| {
                        n += 1;
                        cut == 0 || n < cut
                    };
                    match r() % 4 {
                        0 | 1 => {
                            let _ = m.complete(
                                &prompt,
                                "shared",
                                &params(1 + (r() % 6) as usize),
                                &mut on,
                            );
                        }
                        2 => {
                            let id = m.open_session("shared");
                            for _ in 0..(1 + r() % 3) {
                                let turn: Vec<u32> =
                                    (0..3).map(|_| 3 + (r() % 90) as u32).collect();
                                if m.turn(id, &turn, &params(3), &mut |_, _| true).is_err() {
                                    break;
                                }
                            }
                            if r() % 3 == 0 {
                                aborted.fetch_add(1, Ordering::Relaxed);
                            }
                            m.close_session(id).unwrap();
                        }
                        _ => {
                            // A bad request in the middle of it all.
                            assert!(m.complete(&[1000], "shared", &params(2), &mut on).is_err());
                        }
                    }
                    if cut > 0 {
                        aborted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert!(aborted.load(Ordering::Relaxed) > 0);
    let metrics = m.metrics();
    assert_eq!(metrics["pool"]["blocks_in_use"], 0, "{metrics}");
    assert!(
        metrics["reused_tokens"].as_u64().unwrap() > 0,
        "the shared prefix was reused: {metrics}"
    );
    // Every block can be handed out again: nothing leaked, nothing double-freed.
    m.with_engine(|e| {
        let c = e.cache.coordinator();
        let pool = c.pools().tier(0).unwrap();
        let cap = pool.stats().capacity;
        let all = pool.allocate(cap).expect("all blocks free");
        pool.release_sequence(&all.blocks).unwrap();
        assert_eq!(c.sequences(), 0);
    });
}

#[test]
fn real_model_reuse_gives_identical_greedy_outputs_over_16_turns() {
    // f32 KV: a prompt prefilled whole and its suffix prefilled after a
    // reused prefix differ in the last bits of f32 (other matmul shapes),
    // and an f16 cache rounds such a difference up to an f16 step now and
    // then; here that flips a near-tie at turn 1 (with and without the
    // fused kernel). Identity holds where the storage keeps f32.
    let cfg = EngineConfig {
        weight_kind: Some(kvforge_engine::Kind::Half),
        kv_kind: Some(kvforge_engine::Kind::Float),
        ..Default::default()
    };
    let load = || Engine::load(&model_path(), &cfg).unwrap();
    let with = CacheManager::new(
        load(),
        ReuseConfig {
            seed: Some(11),
            ..Default::default()
        },
    )
    .unwrap();
    let without = CacheManager::new(
        load(),
        ReuseConfig {
            enabled: false,
            ..Default::default()
        },
    )
    .unwrap();
    let eos = with.with_engine(|e| e.tokenizer.eos);
    let messages = [
        "Hi! Who are you?",
        "What is 2 + 2?",
        "Name a color.",
        "And another one?",
        "What is the capital of Italy?",
        "Say something about cats.",
        "Count to three.",
        "What day comes after Monday?",
        "Give me a fruit.",
        "What is water made of?",
        "Tell me a short joke.",
        "What is the opposite of hot?",
        "Name an ocean.",
        "How many legs does a spider have?",
        "What sound does a dog make?",
        "Thanks, goodbye!",
    ];
    let p = SamplingParams {
        max_tokens: 8,
        ..Default::default()
    };
    let mut prompts: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
    let mut reused_last = 0;
    for (t, msg) in messages.iter().enumerate() {
        let text = if t == 0 {
            Tokenizer::chat_prompt(&[kvforge_engine::Message::new("user", *msg)])
        } else {
            format!("<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n")
        };
        let mut answers = Vec::new();
        for (m, prompt) in [&with, &without].into_iter().zip(prompts.iter_mut()) {
            prompt.extend(m.with_engine(|e| e.tokenizer.encode(&text)).unwrap());
            let r = m.complete(prompt, "chat", &p, &mut |_, _| true).unwrap();
            let mut answer = r.generation.tokens.clone();
            if answer.last() == Some(&eos) {
                answer.pop(); // the template above re-adds <|im_end|>
            }
            prompt.extend(&answer);
            if std::ptr::eq(m, &with) {
                reused_last = r.reused_tokens;
            }
            answers.push(r.generation.tokens);
        }
        assert_eq!(
            answers[0], answers[1],
            "turn {t}: reuse changed the greedy answer"
        );
    }
    assert!(
        reused_last * 10 > prompts[0].len() * 9,
        "turn 16 reused {reused_last} of {}",
        prompts[0].len()
    );
}

#[test]
fn streaming_and_window_perplexity_agree_and_do_not_depend_on_chunking() {
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 256,
        ..Default::default()
    };
    let engine = Engine::new(tiny(), tokenizer(), &cfg).unwrap();
    let toks: Vec<u32> = user_turns(12, 5).concat().into_iter().take(64).collect();
    assert_eq!(toks.len(), 64);
    let w = engine.window_ppl(&toks, 64).unwrap();
    let mut last = None;
    for chunk in [1, 7, 32] {
        let s = engine.streaming_ppl(&toks, 32, chunk, 0).unwrap();
        assert_eq!(s.scored, 32);
        assert!(
            (s.nll_sum - w.nll_sum).abs() < 1e-3 * w.nll_sum.abs().max(1.0),
            "chunk {chunk}: {} vs {}",
            s.nll_sum,
            w.nll_sum
        );
        if let Some(prev) = last {
            assert!(
                (s.ppl - prev as f64).abs() < 1e-6 * s.ppl,
                "chunking changed perplexity"
            );
        }
        last = Some(s.ppl as f32 as f64 as f32);
        assert_eq!(
            engine.cache.bytes_in_use(),
            0,
            "streaming frees its sequence"
        );
    }
    assert!(w.ppl.is_finite() && w.ppl > 1.0);
    for bad in [
        engine.streaming_ppl(&toks, 0, 4, 0),
        engine.streaming_ppl(&toks, 64, 4, 0),
        engine.streaming_ppl(&toks, 8, 0, 0),
        engine.window_ppl(&toks, 65),
    ] {
        let e = bad.unwrap_err().to_string();
        assert!(e.contains("perplexity needs") && !e.contains('\n'), "{e}");
    }
}
