//! Every mechanism at once, end to end: prefix reuse with a quantized cold
//! tier, eviction, sharing and lifecycle; a failed turn rolls back exactly;
//! quantized prefixes are matched and shared, their bytes counted once.

use std::panic::{AssertUnwindSafe, catch_unwind};

use kvforge_engine::mechanisms::Registry;
use kvforge_engine::{
    Axis, CacheManager, Engine, EngineConfig, KvQuant, ReuseConfig, SamplingParams, Sequence,
};
use kvforge_pool::{BlockAllocator, Slot};
use kvforge_prefix::ExtraKeys;
use serde_json::json;

use super::model_path;
use super::tiny;

const BS: usize = 4;

fn int4(window: usize, sink: usize) -> KvQuant {
    KvQuant {
        bits: 4,
        group_size: 8,
        window,
        rotate: false,
        key_axis: Axis::PerChannel,
        sink,
    }
}

fn manager(cfg: EngineConfig) -> CacheManager {
    let file = kvforge_engine::gguf::GgufFile::open(&model_path()).unwrap();
    let tokenizer = kvforge_engine::Tokenizer::from_gguf(&file).unwrap();
    let engine = Engine::new(tiny(), tokenizer, &cfg).unwrap();
    let reuse = ReuseConfig {
        seed: Some(3),
        ..Default::default()
    };
    checked(CacheManager::new(engine, reuse).unwrap())
}

/// The manager with every coordinator invariant checked after each of its
/// coordinator's calls (every plan, commit, abort, open, register, turn):
/// a broken one fails the request.
fn checked(m: CacheManager) -> CacheManager {
    m.engine().cache().check_every_call(true);
    m
}

fn cold_cfg() -> EngineConfig {
    EngineConfig {
        block_size: BS,
        kv_tokens: 1024,
        kv_quant: Some(int4(16, 4)),
        ..Default::default()
    }
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn users(n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|t| {
            (0..5 + t % 4)
                .map(|i| 3 + ((t * 31 + i * 7) % 90) as u32)
                .collect()
        })
        .collect()
}

fn cold_in_use(m: &CacheManager) -> u64 {
    m.metrics()["tiers"][1]["blocks_in_use"].as_u64().unwrap()
}

/// The same conversation two ways with the INT4 cold tier: one session in
/// a fresh manager (its KV never comes from the prefix index: it is the
/// session's own, demoted on the same schedule), and stateless requests
/// that re-send the history and take everything computed before from the
/// index, hot and cold blocks alike. The greedy answers are identical.
fn reuse_matches_the_same_schedule(
    make: impl Fn() -> CacheManager,
    turns: &[Vec<u32>],
    p: &SamplingParams,
) {
    let base = make();
    let id = base.open_session("t");
    let want: Vec<Vec<u32>> = turns
        .iter()
        .map(|u| {
            base.turn(id, u, p, &mut |_, _| true)
                .unwrap()
                .generation
                .tokens
        })
        .collect();
    assert_eq!(
        base.metrics()["index"]["hit_tokens"],
        0,
        "nothing from the index"
    );
    assert!(cold_in_use(&base) > 0, "the cold tier engaged");
    base.close_session(id).unwrap();

    let m = make();
    let mut prompt = Vec::new();
    let mut history = 0;
    for (t, u) in turns.iter().enumerate() {
        prompt.extend(u);
        let r = m.complete(&prompt, "t", p, &mut |_, _| true).unwrap();
        assert_eq!(r.generation.tokens, want[t], "turn {t}");
        if t > 0 {
            assert_eq!(
                r.reused_tokens,
                history - 1,
                "turn {t}: everything computed before"
            );
        }
        prompt.extend(&r.generation.tokens);
        history = prompt.len();
    }
    let metrics = m.metrics();
    assert!(
        metrics["tiers"][1]["cached_free_blocks"].as_u64().unwrap() > 0,
        "{metrics}"
    );
    assert_eq!(metrics["kv_bytes_in_use"], 0, "{metrics}");
}

#[test]
fn reuse_with_a_cold_tier_gives_the_outputs_of_the_same_schedule_without_reuse() {
    reuse_matches_the_same_schedule(|| manager(cold_cfg()), &users(6), &params(7));
}

#[test]
fn real_model_reuse_with_a_cold_tier_gives_the_outputs_of_the_same_schedule() {
    let cfg = EngineConfig {
        weight_kind: Some(kvforge_engine::Kind::Half),
        kv_quant: Some(int4(32, 16)),
        ..Default::default()
    };
    let make = || {
        let engine = Engine::load(&model_path(), &cfg).unwrap();
        let reuse = ReuseConfig {
            seed: Some(5),
            ..Default::default()
        };
        checked(CacheManager::new(engine, reuse).unwrap())
    };
    let tok = make().with_engine(|e| {
        ["Hi! Who are you?", "Name a color.", "And another one?"]
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let ids = e.tokenizer().user_turn_ids(true, m).unwrap();
                if i == 0 {
                    e.tokenizer()
                        .chat_ids(&[kvforge_engine::Message::new("user", *m)])
                        .unwrap()
                } else {
                    ids
                }
            })
            .collect::<Vec<_>>()
    });
    reuse_matches_the_same_schedule(make, &tok, &params(24));
}

#[test]
fn a_failed_turn_rolls_back_exactly_after_demotions_and_drops() {
    let mut cfg = cold_cfg();
    cfg.evict_with(
        &Registry::builtin(),
        "sink-window",
        json!({ "sink": 4, "window": 24 }),
    )
    .unwrap();
    let turns = users(3);
    let p = params(20);
    // Reference: the three turns, none failing.
    let clean = manager(cfg.clone());
    let id = clean.open_session("t");
    let want: Vec<Vec<u32>> = turns
        .iter()
        .map(|u| {
            clean
                .turn(id, u, &p, &mut |_, _| true)
                .unwrap()
                .generation
                .tokens
        })
        .collect();

    let m = manager(cfg);
    let id = m.open_session("t");
    let first = m.turn(id, &turns[0], &p, &mut |_, _| true).unwrap();
    assert_eq!(first.generation.tokens, want[0]);
    let before_fail = m.metrics();
    // Turn 2 fails after 15 tokens: positions are past 40 by then, so
    // blocks went cold and were dropped during the turn.
    let mut n = 0;
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        m.turn(id, &turns[1], &p, &mut |_, _| {
            n += 1;
            assert!(n < 15, "the caller fails mid-turn");
            true
        })
    }));
    assert!(panicked.is_err());
    let after = m.metrics();
    assert_eq!(
        after["tiers"], before_fail["tiers"],
        "pools as before the turn"
    );
    assert_eq!(
        after["index"], before_fail["index"],
        "index as before the turn"
    );
    // The session goes on as if the failed turn never happened.
    for (t, u) in turns.iter().enumerate().skip(1) {
        let r = m.turn(id, u, &p, &mut |_, _| true).unwrap();
        assert_eq!(r.generation.tokens, want[t], "turn {t}");
    }
    m.close_session(id).unwrap();
    assert_eq!(m.metrics()["kv_bytes_in_use"], 0);
}

#[test]
fn a_quantized_prefix_is_matched_shared_and_counted_once() {
    let m = manager(cold_cfg());
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 13 % 90) as u32).collect();
    let r = m
        .complete(&prompt, "t", &params(8), &mut |_, _| true)
        .unwrap();
    let mut history = prompt.clone();
    history.extend(&r.generation.tokens);
    m.with_engine(|e| {
        let extra = ExtraKeys::namespace("t");
        let cold_before = e.cache().tier_stats()[1].pool;
        let mut a = e.cache().open(&history, &extra).unwrap();
        let mut b = e.cache().open(&history, &extra).unwrap();
        assert_eq!(a.len(), history.len() - 1, "the whole history is matched");
        let (ta, tb) = (e.cache().table(&a).unwrap(), e.cache().table(&b).unwrap());
        assert_eq!(ta, tb, "the same blocks, hot and cold");
        let cold: Vec<_> = ta
            .entries()
            .iter()
            .filter_map(|x| match x.slot() {
                Slot::Cold(c) => Some(c),
                _ => None,
            })
            .collect();
        assert!(!cold.is_empty(), "the quantized prefix is matched as is");
        e.cache().with_coordinator(|c| {
            for &id in &cold {
                assert_eq!(c.pools().ref_count(id).unwrap(), 2, "shared, not copied");
            }
        });
        let stats = e.cache().stats().tiers[1].pool;
        assert_eq!(stats.in_use, cold.len(), "counted once");
        assert_eq!(stats.in_use_bytes, cold.len() as u64 * stats.block_bytes);
        assert_eq!(stats.capacity, cold_before.capacity, "nothing re-quantized");
        // Both sequences run on from the shared prefix.
        for seq in [&mut a, &mut b] {
            let last = *history.last().unwrap();
            let _ = e
                .model()
                .forward(&[last], &mut e.cache().view(seq), false)
                .unwrap();
        }
        let (mut a, mut b): (Sequence, Sequence) = (a, b);
        e.cache().free(&mut a).unwrap();
        e.cache().free(&mut b).unwrap();
        assert_eq!(e.cache().bytes_in_use(), 0);
    });
    // A stateless request over the same history reuses it all.
    let r2 = m
        .complete(&history, "t", &params(2), &mut |_, _| true)
        .unwrap();
    assert_eq!(r2.reused_tokens, history.len() - 1);
}

/// Two sessions generate at the same time: each one's first token waits
/// for the other's. Under one lock held across a generation, this would
/// time out.
#[test]
fn two_sessions_generate_at_the_same_time() {
    use std::sync::mpsc::channel;
    use std::time::Duration;
    let m = manager(cold_cfg());
    let (to_b, from_a) = channel::<()>();
    let (to_a, from_b) = channel::<()>();
    let turns = users(2);
    std::thread::scope(|s| {
        let (m, turns) = (&m, &turns);
        let a = s.spawn(move || {
            let id = m.open_session("a");
            let mut first = true;
            let r = m.turn(id, &turns[0], &params(4), &mut |_, _| {
                if std::mem::take(&mut first) {
                    to_b.send(()).unwrap();
                    assert!(
                        from_b.recv_timeout(Duration::from_secs(60)).is_ok(),
                        "b never ran"
                    );
                }
                true
            });
            m.close_session(id).unwrap();
            r.map(|r| r.generation.tokens.len())
        });
        let b = s.spawn(move || {
            let id = m.open_session("b");
            assert!(
                from_a.recv_timeout(Duration::from_secs(60)).is_ok(),
                "a never ran"
            );
            let mut first = true;
            let r = m.turn(id, &turns[1], &params(4), &mut |_, _| {
                if std::mem::take(&mut first) {
                    to_a.send(()).unwrap();
                }
                true
            });
            m.close_session(id).unwrap();
            r.map(|r| r.generation.tokens.len())
        });
        assert_eq!(a.join().unwrap().unwrap(), 4);
        assert_eq!(b.join().unwrap().unwrap(), 4);
    });
    // A session's turn while another of its turns runs is refused.
    let id = m.open_session("c");
    let e = m
        .turn(id, &turns[0], &params(2), &mut |_, _| {
            let inner = m.turn(id, &[5], &params(1), &mut |_, _| true);
            assert!(inner.unwrap_err().to_string().contains("busy"));
            true
        })
        .unwrap();
    assert_eq!(e.generation.tokens.len(), 2);
    m.close_session(id).unwrap();
}

/// Eight threads over one budget, with prefix reuse, the cold tier,
/// eviction and sharing on: shared prefixes, sessions, client aborts,
/// panics inside turns and bad requests. Nothing leaks: no block in use,
/// no sequence left, and the cold tier stores exactly its cached blocks.
#[test]
fn eight_threads_with_every_mechanism_leak_nothing() {
    let mut cfg = EngineConfig {
        kv_tokens: 2048,
        dedup: Some(kvforge_engine::DedupConfig::Exact),
        ..cold_cfg()
    };
    cfg.evict_with(
        &Registry::builtin(),
        "sink-window",
        json!({ "sink": 4, "window": 32 }),
    )
    .unwrap();
    let m = manager(cfg);
    let system: Vec<u32> = (10..40).collect();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (m, system) = (&m, &system);
            s.spawn(move || {
                let mut next = super::manager::rng(t * 0x9E37_79B9 + 1);
                for _ in 0..6 {
                    let mut prompt = system.clone();
                    prompt.extend((0..next() % 8).map(|i| 3 + (i * 11 % 90) as u32));
                    let cut = (next() % 12) as usize;
                    let mut n = 0;
                    let mut on = |_: u32, _: &str| {
                        n += 1;
                        cut == 0 || n < cut
                    };
                    match next() % 4 {
                        0 => {
                            let _ = m.complete(&prompt, "shared", &params(16), &mut on);
                        }
                        1 | 2 => {
                            let id = m.open_session("shared");
                            let turns = 1 + next() % 3;
                            for k in 0..turns {
                                let boom = next() % 5 == 0;
                                let go = catch_unwind(AssertUnwindSafe(|| {
                                    let mut n = 0;
                                    m.turn(
                                        id,
                                        &prompt[..5 + k as usize],
                                        &params(12),
                                        &mut |_, _| {
                                            n += 1;
                                            assert!(!(boom && n == 6), "a client panics");
                                            true
                                        },
                                    )
                                }));
                                if !matches!(go, Ok(Ok(_))) {
                                    break;
                                }
                            }
                            m.close_session(id).unwrap();
                        }
                        _ => {
                            assert!(m.complete(&[1000], "shared", &params(2), &mut on).is_err());
                            assert!(m.turn(u64::MAX, &[5], &params(2), &mut on).is_err());
                        }
                    }
                }
            });
        }
    });
    let metrics = m.metrics();
    assert_eq!(metrics["kv_bytes_in_use"], 0, "{metrics}");
    assert!(metrics["reused_tokens"].as_u64().unwrap() > 0, "{metrics}");
    m.with_engine(|e| {
        assert_eq!(e.cache().with_coordinator(|c| c.sequences()), 0);
        let cold = e.cache().stats().tiers[1].pool;
        assert_eq!(
            e.cache().cold_stored_bytes(),
            cold.cached_free as u64 * cold.block_bytes,
            "stored cold blocks are exactly the cached ones"
        );
    });
}

/// Near-duplicate sharing through the engine: at cosine 1 it changes no
/// output; at a low threshold it aliases blocks (fewer cold blocks in use)
/// and generation goes on reading the canonical blocks.
#[test]
fn near_duplicate_sharing_aliases_cold_blocks_and_at_cosine_one_changes_nothing() {
    let with = |threshold: Option<f32>| {
        let cfg = EngineConfig {
            dedup: threshold.map(|threshold| {
                kvforge_engine::DedupConfig::SimHash(kvforge_engine::SimHashConfig {
                    threshold,
                    bits: 4,
                    tables: 2,
                    seed: 5,
                })
            }),
            ..cold_cfg()
        };
        let m = manager(cfg);
        let prompt: Vec<u32> = (0..96).map(|i| 3 + (i % 7) as u32).collect();
        let out = m
            .complete(&prompt, "a", &params(24), &mut |_, _| true)
            .unwrap();
        let metrics = m.metrics();
        (out.generation.tokens, metrics)
    };
    let (plain, _) = with(None);
    let (exact, m1) = with(Some(1.0));
    assert_eq!(plain, exact, "cosine 1 shares only identical content");
    assert!(m1["sharing"]["offered"].as_u64().unwrap() > 0, "{m1}");
    let (loose, m2) = with(Some(0.05));
    assert_eq!(loose.len(), 24);
    assert!(m2["sharing"]["shared"].as_u64().unwrap() > 0, "{m2}");
}
