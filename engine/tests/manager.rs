//! Prefix reuse through the cache manager: identical greedy outputs with and
//! without reuse, stateless and in sessions; bad requests change nothing;
//! many threads with shared prefixes and aborts leak nothing.

use std::sync::atomic::{AtomicU64, Ordering};

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::mechanisms::{Mechanisms, Registry};
use kvforge_engine::numerics::within;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, IndexKind, ReuseConfig, SamplingParams, Sequence,
    Tokenizer, TurnTail,
};
use kvforge_pool::BlockAllocator;

use super::{model_path, tiny};

pub(super) fn tokenizer() -> Tokenizer {
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

/// Prefix reuse on the tiny model, every block size × turn tail × index,
/// against recomputing every prompt (reuse off), over 16 turns: teacher
/// forced on the reference conversation the logits agree within
/// `TINY_TOL` (the argmax too wherever the top-2 gap exceeds it) and
/// everything computed before is reused; free-running stateless requests
/// and sessions follow the reference answers up to its first near-tie; a
/// prefix with a position lost is caught.
#[test]
fn reuse_matches_recomputing_every_prompt_over_16_turns() {
    use super::forced::{TINY_TOL, agree, follows, forced, forced_complete};
    let users = user_turns(16, 42);
    let p = params(6);
    let off = ReuseConfig {
        enabled: false,
        ..Default::default()
    };
    let off = tiny_manager(4, 512, off);
    let (want, none) = stateless(&off, &users, &p);
    assert!(none.iter().all(|&r| r == 0));
    // The reference conversation, and the logits each answer token was
    // picked from (the forced run is the stateless run's schedule).
    let mut prompts = Vec::new();
    let mut prompt: Vec<u32> = Vec::new();
    for (u, a) in users.iter().zip(&want) {
        prompt.extend(u);
        prompts.push(prompt.clone());
        prompt.extend(a);
    }
    let want_rows: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .zip(&want)
        .map(|(pr, a)| forced_complete(&off, "tenant", pr, a).1)
        .collect();
    let flat_want: Vec<u32> = want.concat();
    let flat_rows: Vec<Vec<f32>> = want_rows.concat();
    let mut worst = 0f32;
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
                let label = format!("block {bs}, {tail:?}, {index:?}");
                let m = tiny_manager(bs, 512, cfg.clone());
                let mut history = 0usize;
                for t in 0..users.len() {
                    let (reused, rows) = forced_complete(&m, "tenant", &prompts[t], &want[t]);
                    let a = agree(Some("reuse logits"), &rows, &want_rows[t], TINY_TOL)
                        .unwrap_or_else(|e| panic!("{label}, turn {t}: {e}"));
                    worst = worst.max(a.max_diff);
                    // Reusable: everything computed before (history minus
                    // the last sampled token, never run through the model).
                    if t > 0 {
                        let reusable = history - 1;
                        if seal {
                            assert_eq!(reused, reusable, "{label}, turn {t}");
                        } else {
                            assert!(
                                reused + bs > reusable && reused <= reusable,
                                "{label}, turn {t}: {reused} of {reusable}"
                            );
                        }
                    }
                    history += users[t].len() + p.max_tokens;
                }
                let m = tiny_manager(bs, 512, cfg);
                let (got, reused) = stateless(&m, &users, &p);
                follows(&got.concat(), &flat_want, &flat_rows, TINY_TOL)
                    .unwrap_or_else(|e| panic!("{label}: stateless answers: {e}"));
                assert!(reused.iter().sum::<usize>() > 0, "{label}: {reused:?}");
                let got = session(&m, &users, &p);
                follows(&got.concat(), &flat_want, &flat_rows, TINY_TOL)
                    .unwrap_or_else(|e| panic!("{label}: session answers: {e}"));
                let metrics = m.metrics();
                assert_eq!(metrics["pool"]["blocks_in_use"], 0, "{label}: {metrics}");
                assert!(metrics["reused_tokens"].as_u64().unwrap() > 0);
            }
        }
    }
    eprintln!(
        "tiny model, reuse against recomputing: max |Δlogit| {worst:.2e} (tolerance {TINY_TOL})"
    );
    // The margin: the last answer over a prefix that lost one position.
    let last = users.len() - 1;
    let before = &prompts[last];
    let mut broken = before.clone();
    broken.remove(before.len() / 2);
    let e = off.engine();
    let mut seq = kvforge_engine::Sequence::default();
    let (head, tail) = broken.split_at(broken.len() - 1);
    let _ = e
        .model()
        .forward(head, &mut e.cache().view(&mut seq), false)
        .unwrap();
    let rows = forced(e, &mut seq, tail, &want[last]);
    e.cache().free(&mut seq).unwrap();
    let err =
        agree(None, &rows, &want_rows[last], TINY_TOL).expect_err("a lost position is caught");
    eprintln!("tiny model, a position off by one: caught ({err})");
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

/// Eviction named in a mechanisms table (a policy the engine installs,
/// not one of the coordinator's own configuration) keeps a request longer
/// than the hot pool within it, so the request is admitted and runs; with
/// no eviction the same request is refused before it starts (it once was
/// refused with eviction too: the check saw only the configured policy).
#[test]
fn a_named_eviction_policy_admits_a_request_longer_than_the_hot_pool() {
    let manager = |toml: &str| {
        let registry = Registry::builtin();
        let m = Mechanisms::from_toml(toml, std::path::Path::new("m.toml"), 4, &registry).unwrap();
        let mut cfg = EngineConfig {
            block_size: 4,
            kv_tokens: 64,
            ..Default::default()
        };
        let reuse = m.apply(&mut cfg, &registry, Some(5)).unwrap();
        CacheManager::new(Engine::new(tiny(), tokenizer(), &cfg).unwrap(), reuse).unwrap()
    };
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i % 90).collect();
    let p = params(40);
    let plain = manager("");
    let e = plain
        .complete(&prompt, "t", &p, &mut |_, _| true)
        .unwrap_err();
    assert!(e.to_string().contains("KV blocks"), "{e}");
    let evicting = manager("[eviction]\npolicy = \"sink-window\"\nsink = 4\nwindow = 24\n");
    let r = evicting
        .complete(&prompt, "t", &p, &mut |_, _| true)
        .unwrap();
    assert_eq!(r.generation.tokens.len(), 40);
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
        e.cache().with_coordinator(|c| {
            let pool = c.pools().tier(0).unwrap();
            let cap = pool.stats().capacity;
            let all = pool.allocate(cap).expect("all blocks free");
            pool.release_sequence(&all.blocks).unwrap();
            assert_eq!(c.sequences(), 0);
        });
    });
}

/// The 16-turn chat of the real-model reuse test.
const CHAT: [&str; 16] = [
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

/// The text turn `t` of [`CHAT`] adds after the previous answer.
fn chat_text(t: usize) -> String {
    if t == 0 {
        Tokenizer::chat_prompt(&[kvforge_engine::Message::new("user", CHAT[0])])
    } else {
        format!(
            "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
            CHAT[t]
        )
    }
}

/// Prefix reuse on SmolLM2 (f16 weights and KV) over a
/// 16-turn chat, stateless requests re-sending the history:
/// 1. on the same schedule (a session prefills exactly the suffixes the
///    stateless requests prefill after their reused prefix) the greedy
///    answers are identical;
/// 2. against a full recompute of the conversation (another computation
///    order) the logits reuse computed for every answer token, teacher
///    forced, agree within `REAL_TOL`, with the same argmax wherever the
///    top-2 gap exceeds it;
/// 3. that tolerance catches KV of another position or another token: a
///    prefix missing one token, or with one block's tokens replaced.
#[test]
fn real_model_reuse_matches_a_full_recompute_within_rounding_over_16_turns() {
    use super::forced::{REAL_TOL, agree, answer_rows, forced, forced_complete, full_rows};
    let cfg = EngineConfig {
        weight_kind: Some(kvforge_engine::Kind::Half),
        ..Default::default()
    };
    let load = || Engine::load(&model_path(), &cfg).unwrap();
    let reuse = || {
        CacheManager::new(
            load(),
            ReuseConfig {
                seed: Some(11),
                ..Default::default()
            },
        )
        .unwrap()
    };
    let p = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    // The conversation, generated by stateless requests with reuse.
    let with = reuse();
    let texts: Vec<Vec<u32>> = (0..CHAT.len())
        .map(|t| {
            with.with_engine(|e| e.tokenizer().encode(&chat_text(t)))
                .unwrap()
        })
        .collect();
    let mut prompt: Vec<u32> = Vec::new();
    let (mut prompts, mut answers) = (Vec::new(), Vec::new());
    let mut reused_last = 0;
    for text in &texts {
        prompt.extend(text);
        let r = with
            .complete(&prompt, "chat", &p, &mut |_, _| true)
            .unwrap();
        reused_last = r.reused_tokens;
        prompts.push(prompt.clone());
        answers.push(r.generation.tokens.clone());
        prompt.extend(&r.generation.tokens);
    }
    assert!(
        reused_last * 10 > prompt.len() * 9,
        "turn 16 reused {reused_last} of {}",
        prompt.len()
    );
    // 1. The same schedule: a session gives the same answers, bit for bit.
    let s = reuse();
    let id = s.open_session("chat");
    for (t, text) in texts.iter().enumerate() {
        let r = s.turn(id, text, &p, &mut |_, _| true).unwrap();
        assert_eq!(
            r.generation.tokens, answers[t],
            "turn {t}: the same schedule"
        );
    }
    s.close_session(id).unwrap();
    // 2. Teacher forced against one prefill of the whole conversation.
    let forced_m = reuse();
    let full = full_rows(forced_m.engine(), &prompt);
    let mut worst = super::forced::Agreement::default();
    for t in 0..CHAT.len() {
        let (reused, got) = forced_complete(&forced_m, "chat", &prompts[t], &answers[t]);
        assert!(t == 0 || reused > 0, "turn {t} reused nothing");
        // The forced run is the stateless run's schedule: its argmax is
        // what that run sampled.
        let picked: Vec<u32> = got
            .iter()
            .map(|r| super::forced::top2(r).0 as u32)
            .collect();
        assert_eq!(
            picked, answers[t],
            "turn {t}: teacher forcing replays the run"
        );
        let want = answer_rows(&full, prompts[t].len(), answers[t].len());
        let a = agree(Some("reuse logits"), &got, want, REAL_TOL)
            .unwrap_or_else(|e| panic!("turn {t}: {e}"));
        worst = worst.merge(a);
    }
    eprintln!(
        "reuse against a full recompute, 16 turns teacher-forced: max |Δlogit| {:.4} (tolerance {REAL_TOL}), {} argmax compared, {} near-ties",
        worst.max_diff, worst.decided, worst.near_ties
    );
    // 3. The margin: the last turn's answer over a broken prefix.
    let e = forced_m.engine();
    let last = CHAT.len() - 1;
    let (before, answer) = (&prompts[last], &answers[last]);
    let want = answer_rows(&full, before.len(), answer.len());
    let cut = before.len() / 2;
    let mut shifted = before[..cut].to_vec(); // one token lost: later positions off by one
    shifted.extend(&before[cut + 1..]);
    let mut swapped = before.clone(); // one block of 16 positions holds other tokens' KV
    for t in &mut swapped[cut..cut + 16] {
        *t = 1 + (*t * 7 + 13) % 40_000;
    }
    for (what, broken) in [
        ("a position off by one", shifted),
        ("a block of other tokens", swapped),
    ] {
        let mut seq = Sequence::default();
        let (head, tail) = broken.split_at(broken.len() - 1);
        let _ = e
            .model()
            .forward(head, &mut e.cache().view(&mut seq), false)
            .unwrap();
        let got = forced(e, &mut seq, tail, answer);
        e.cache().free(&mut seq).unwrap();
        let err = agree(None, &got, want, REAL_TOL).expect_err(what);
        eprintln!("{what}: caught ({err})");
    }
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
    // Chunks of 1, 7 and 32 tokens are different computation orders
    // (libtorch picks kernels by shape and CPU): the perplexities agree
    // within rounding, not bit for bit. Measured: at most 3.7e-7 relative
    // apart with AVX-512 kernels, 1.1e-6 with ATEN_CPU_CAPABILITY=default;
    // the two kernel sets 5e-6 apart. Tolerance 1e-4.
    let mut first = None;
    for chunk in [1, 7, 32] {
        let s = engine.streaming_ppl(&toks, 32, chunk, 0).unwrap();
        assert_eq!(s.scored, 32);
        // One (tokens, NLL) per streamed chunk, summing to the totals.
        assert_eq!(s.chunks.len(), 32usize.div_ceil(chunk));
        assert_eq!(s.chunks.iter().map(|c| c.0).sum::<usize>(), 32);
        let chunk_nll: f64 = s.chunks.iter().map(|c| c.1).sum();
        assert!((chunk_nll - s.nll_sum).abs() < 1e-9 * s.nll_sum.abs().max(1.0));
        let rel_window = (s.nll_sum - w.nll_sum).abs() / w.nll_sum.abs().max(1.0);
        assert!(
            within("streaming NLL against the window", rel_window, 1e-3),
            "chunk {chunk}: {} vs {}",
            s.nll_sum,
            w.nll_sum
        );
        let p1 = *first.get_or_insert(s.ppl);
        let rel = (s.ppl - p1).abs() / p1;
        eprintln!(
            "chunk {chunk}: perplexity {} ({rel:.1e} relative to chunk 1)",
            s.ppl
        );
        assert!(
            within("perplexity across chunk sizes", rel, 1e-4),
            "chunk {chunk} changed perplexity: {} vs {p1}",
            s.ppl
        );
        assert_eq!(
            engine.cache().bytes_in_use(),
            0,
            "streaming frees its sequence"
        );
    }
    assert!(w.ppl.is_finite() && w.ppl > 1.0);
    // The full-cache reference (one pass into a dense cache) scores the
    // same tokens, its KV in the model's f32 where the paged cache holds
    // f16: measured 9.0e-5 to 9.5e-5 relative under every MKL_CBWR and
    // ATEN_CPU_CAPABILITY setting here; tolerance 1e-3.
    let f = engine.full_cache_ppl(&toks, 32).unwrap();
    assert_eq!(f.scored, 32);
    let p1 = first.unwrap();
    let rel = (f.ppl - p1).abs() / p1;
    eprintln!(
        "full cache: perplexity {} ({rel:.1e} relative to chunk 1)",
        f.ppl
    );
    assert!(
        within("full-cache perplexity against streaming", rel, 1e-3),
        "{} vs {p1}",
        f.ppl
    );
    assert_eq!(
        engine.cache().bytes_in_use(),
        0,
        "the paged cache untouched"
    );
    for bad in [
        engine.streaming_ppl(&toks, 0, 4, 0),
        engine.streaming_ppl(&toks, 64, 4, 0),
        engine.streaming_ppl(&toks, 8, 0, 0),
        engine.window_ppl(&toks, 65),
        engine.full_cache_ppl(&toks, 0),
        engine.full_cache_ppl(&toks, 64),
    ] {
        let e = bad.unwrap_err().to_string();
        assert!(e.contains("perplexity needs") && !e.contains('\n'), "{e}");
    }
}

/// Every counter the cache keeps reaches both outputs — the metrics JSON
/// and its Prometheus text — because both are derived from the same
/// statistics: a counter added to `Counters`, `MatchStats`, `ShareStats`
/// or `PoolStats` shows up without anyone touching the manager.
#[test]
fn every_counter_reaches_the_json_and_the_prometheus_text() {
    use kvforge_coordinator::{Counters, MatchStats, PoolStats, ShareStats};
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 256,
        kv_quant: Some(kvforge_engine::KvQuant {
            bits: 4,
            group_size: 8,
            window: 8,
            rotate: false,
            key_axis: kvforge_engine::Axis::PerChannel,
            sink: 0,
        }),
        dedup: Some(kvforge_engine::DedupConfig::Exact),
        ..Default::default()
    };
    let engine = Engine::new(tiny(), tokenizer(), &cfg).unwrap();
    let m = CacheManager::new(engine, ReuseConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i % 90).collect();
    m.complete(&prompt, "t", &params(4), &mut |_, _| true)
        .unwrap();
    let json = m.metrics();
    let text = kvforge_engine::metrics::prometheus(&json);
    // Every field, by name: a destructuring without `..` stops compiling
    // when a counter is added, until it is listed here too.
    macro_rules! fields {
        ($t:ident { $($f:ident),* $(,)? }) => {{
            #[allow(unused_variables)]
            let $t { $($f),* } = $t::default();
            vec![$(stringify!($f).to_string()),*]
        }};
    }
    let sections = [
        (
            "policies",
            fields!(Counters {
                evicted_entries,
                demoted_blocks,
                lifecycle_dropped_entries,
                lifecycle_queued,
                lifecycle_revived,
                lifecycle_reclaimed,
                lifecycle_compressed,
                lifecycle_fallbacks,
                packed_blocks,
                evicted_tokens,
                compacted_blocks,
                evicted_idle_entries,
                steps,
                reused_hot_blocks,
                reused_cold_blocks,
            }),
        ),
        (
            "index",
            fields!(MatchStats {
                queries,
                query_tokens,
                hit_tokens,
                hit_blocks,
                inserted_blocks,
                duplicate_blocks,
                collisions,
                forgotten_blocks,
                insert_tokens,
                cached_blocks,
                namespaces,
            }),
        ),
        (
            "sharing",
            fields!(ShareStats {
                offered,
                shared,
                rejected,
                canonical
            }),
        ),
        (
            "pool",
            // Serialized under their unit-bearing names.
            fields!(PoolStats {
                capacity,
                max_blocks,
                in_use,
                cached_free,
                retired,
                block_bytes,
                in_use_bytes,
                capacity_bytes,
            })
            .into_iter()
            .map(|f| match f.as_str() {
                "capacity" => "capacity_blocks".to_string(),
                "in_use" => "blocks_in_use".to_string(),
                "cached_free" => "cached_free_blocks".to_string(),
                "in_use_bytes" => "bytes_in_use".to_string(),
                _ => f,
            })
            .collect(),
        ),
    ];
    let mut checked = 0;
    for (section, fields) in &sections {
        assert!(fields.len() >= 4, "{section}: {fields:?}");
        for f in fields {
            assert!(
                json[section].get(f).is_some(),
                "{section}.{f} missing from the JSON: {json}"
            );
            let name = format!("kvforge_{section}_{f} ");
            assert!(
                text.contains(&name),
                "{name} missing from the Prometheus text:\n{text}"
            );
            checked += 1;
        }
    }
    for f in &sections[3].1 {
        for tier in ["hot", "cold"] {
            let name = format!("kvforge_tiers_{f}{{tier=\"{tier}\"}} ");
            assert!(text.contains(&name), "{name} missing:\n{text}");
        }
    }
    assert!(checked > 30, "{checked}");
}
