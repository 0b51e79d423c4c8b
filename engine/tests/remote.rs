//! A remote tier shared by two engines (an in-memory store standing in
//! for Redis): the second one imports the first one's blocks, hot or cold,
//! and answers as a local prefix hit would; another model or seed gets no
//! hit; a failing store is a recompute.

use std::sync::Arc;
use std::time::Duration;

use kvforge_engine::cache::RemoteSetup;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, KvQuant, Llama, LlamaConfig, ReuseConfig, SamplingParams,
};
use kvforge_pool::Slot;
use kvforge_remote::{ErrorKind, ExtraKeys, MemoryTier, RemoteOptions, RemoteStats, Secret};

/// The cluster's secret in these tests.
fn secret() -> Secret {
    Secret::new(b"engine remote tests: the secret").unwrap()
}
use tch::{Device, Kind};

use super::manager::tokenizer;

fn engine(weights: i64, cold: bool) -> Engine {
    engine_bs(4, weights, cold)
}

fn engine_bs(block_size: usize, weights: i64, cold: bool) -> Engine {
    let cfg = EngineConfig {
        block_size,
        kv_tokens: 512,
        kv_quant: cold.then(|| KvQuant {
            window: 8,
            sink: 8,
            group_size: 8,
            ..KvQuant::parse("int4").unwrap()
        }),
        ..Default::default()
    };
    let model = Llama::random(LlamaConfig::tiny(), weights, Device::Cpu, Kind::Float).unwrap();
    Engine::new(model, tokenizer(), &cfg).unwrap()
}

/// An engine of random weights `weights` sharing through `store` under
/// hash seed `seed`, blocks as cold bytes when `cold`.
fn manager(store: &Arc<MemoryTier>, weights: i64, seed: u64, cold: bool) -> CacheManager {
    let mut e = engine(weights, cold);
    link(&mut e, store, seed, cold);
    let m = CacheManager::new(e, ReuseConfig::default()).unwrap();
    m.engine().cache().check_every_call(true);
    m
}

/// A store holding what a first engine (weights 7, seed 1) wrote for
/// [`prompt`], that engine, and its tokens.
fn written(cold: bool) -> (Arc<MemoryTier>, CacheManager, Vec<u32>) {
    let store = Arc::new(MemoryTier::new());
    let a = manager(&store, 7, 1, cold);
    let (first, reused) = greedy(&a, &prompt());
    assert_eq!(reused, 0);
    assert!(a.engine().cache().remote_flush(Duration::from_secs(10)));
    (store, a, first)
}

/// Links `e` to `store` under hash seed `seed`.
fn link(e: &mut Engine, store: &Arc<MemoryTier>, seed: u64, cold: bool) {
    let model = e.fingerprint().unwrap();
    e.cache_mut()
        .set_remote(Some(RemoteSetup {
            store: store.clone(),
            secret: secret(),
            seed,
            model,
            cold,
            options: RemoteOptions::default(),
        }))
        .unwrap();
}

fn greedy(m: &CacheManager, prompt: &[u32]) -> (Vec<u32>, usize) {
    let p = SamplingParams {
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    let r = m.complete(prompt, "", &p, &mut |_, _| true).unwrap();
    (r.generation.tokens, r.reused_tokens)
}

fn stats(m: &CacheManager) -> RemoteStats {
    m.engine().cache().remote_stats().unwrap()
}

fn prompt() -> Vec<u32> {
    (0..37).map(|i| 3 + (i * 11 % 90)).collect()
}

#[test]
fn a_second_engine_answers_from_the_first_ones_blocks_as_a_local_hit_would() {
    for cold in [false, true] {
        let (store, a, first) = written(cold);
        // 37 prompt tokens + 5 generated held: 10 full blocks written (in
        // cold mode 2 hot sink blocks and 8 INT4 ones).
        assert_eq!(stats(&a).put_blocks, 10, "cold {cold}");
        let b = manager(&store, 7, 1, cold);
        let (remote, reused) = greedy(&b, &prompt());
        assert_eq!(reused, 36, "cold {cold}: every full block of the prompt");
        let s = stats(&b);
        // Cold mode: the sink's 2 blocks travel hot, the rest as INT4.
        let rounds = if cold { 2 } else { 1 };
        assert_eq!((s.lookups, s.hit_blocks, s.invalid_blocks), (rounds, 9, 0));
        // What an import lays out: the sink hot (full precision) in cold
        // mode, like a local hit's; every block hot in hot mode.
        let c = manager(&store, 7, 1, cold);
        let cache = &c.engine().cache();
        let mut seq = cache.open(&prompt(), &ExtraKeys::default()).unwrap();
        assert_eq!(seq.len(), 36);
        let slots: String = cache
            .table(&seq)
            .unwrap()
            .entries()
            .iter()
            .map(|e| match e.slot() {
                Slot::Hot(_) => 'H',
                _ => 'C',
            })
            .collect();
        assert_eq!(slots, if cold { "HHCCCCCCC" } else { "HHHHHHHHH" });
        cache.free(&mut seq).unwrap();
        assert_eq!(cache.bytes_in_use(), 0);
        if !cold {
            // Bit for bit the first engine's KV: the same tokens as its own
            // local prefix hit (the same computation).
            let (local, reused) = greedy(&a, &prompt());
            assert_eq!(reused, 36);
            assert_eq!(remote, local);
        }
        assert_eq!(first.len(), remote.len());
        // Imported blocks are indexed: a third request is a local hit.
        let (again, reused) = greedy(&b, &prompt());
        assert_eq!((again, reused), (remote, 36));
        assert_eq!(stats(&b).lookups, rounds, "no second remote round");
    }
}

#[test]
fn another_model_or_seed_gets_no_hit() {
    let (store, _a, _) = written(false);
    for (weights, seed) in [(8, 1), (7, 2)] {
        let b = manager(&store, weights, seed, false);
        assert_eq!(greedy(&b, &prompt()).1, 0);
        assert_eq!(stats(&b).hit_blocks, 0);
        assert_eq!(stats(&b).miss_blocks, 9);
    }
}

#[test]
fn a_failing_store_is_a_recompute_with_the_same_tokens() {
    let (store, _a, first) = written(false);
    store.fail_with(Some(ErrorKind::Timeout));
    let b = manager(&store, 7, 1, false);
    let (tokens, reused) = greedy(&b, &prompt());
    assert_eq!(reused, 0);
    assert_eq!(
        tokens, first,
        "a fresh engine computing everything, like the first"
    );
    assert!(b.engine().cache().remote_flush(Duration::from_secs(10)));
    let s = stats(&b);
    // The lookup, and each write-behind batch, timed out (the writes may
    // have landed: unconfirmed, not failed).
    assert_eq!((s.lookups, s.put_unconfirmed, s.put_failed), (1, 10, 0));
    assert!(s.errors_timeout >= 2, "{s:?}");
    assert_eq!(b.engine().cache().bytes_in_use(), 0);
}

/// In cold mode the sink's blocks travel hot, the rest cold
/// (`PagedKvCache::import_fetched`). When the hot tier has room for fewer
/// sink blocks than the remote tier holds, the hot run is cut to that room
/// before it is fetched; the cold run after it must then not be imported
/// (block 2's KV would sit at positions 4..8, block 3's at 8..12, …).
#[test]
fn an_import_cut_short_in_the_sink_does_not_shift_the_cold_blocks() {
    let (store, _a, _) = written(true);
    // Three hot blocks, bytes to spare.
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 12,
        kv_budget: 1 << 22,
        kv_quant: Some(KvQuant {
            window: 8,
            sink: 8,
            group_size: 8,
            ..KvQuant::parse("int4").unwrap()
        }),
        ..Default::default()
    };
    let model = Llama::random(LlamaConfig::tiny(), 7, Device::Cpu, Kind::Float).unwrap();
    let mut e = Engine::new(model, tokenizer(), &cfg).unwrap();
    link(&mut e, &store, 1, true);
    e.cache().check_every_call(true);
    let cache = e.cache();
    let layout = |seq: &kvforge_engine::Sequence| -> String {
        cache
            .table(seq)
            .unwrap()
            .entries()
            .iter()
            .map(|e| match e.slot() {
                Slot::Hot(_) => 'H',
                _ => 'C',
            })
            .collect()
    };
    // One request takes two of the three hot blocks (its sink).
    let mut x = cache.open(&prompt(), &ExtraKeys::default()).unwrap();
    assert_eq!((x.len(), layout(&x).as_str()), (36, "HHCCCCCCC"));
    // The next one finds room for one hot block only: it imports that
    // block and stops (the cold run would not follow on).
    let mut y = cache.open(&prompt(), &ExtraKeys::default()).unwrap();
    let got = layout(&y);
    assert!(
        y.len() <= 4 && got.chars().all(|c| c == 'H'),
        "the hot run was cut to one block, yet {} positions were imported: {got} (x: HHCCCCCCC) — block k+1's KV at block k's positions",
        y.len()
    );
    cache.free(&mut y).unwrap();
    // With room again, the whole chain comes in order.
    cache.free(&mut x).unwrap();
    let mut z = cache.open(&prompt(), &ExtraKeys::default()).unwrap();
    assert_eq!((z.len(), layout(&z).as_str()), (36, "HHCCCCCCC"));
    cache.free(&mut z).unwrap();
}

/// A server asks the remote tier while the request waits for admission
/// (`remote_lookup`), then opens with the answer (`open_with`): blocks the
/// local prefix gained meanwhile are skipped, the rest imported at their
/// own positions — the KV is the first engine's, as a later local hit
/// shows token for token.
#[test]
fn a_lookup_asked_before_the_open_imports_what_follows_the_local_prefix() {
    let (store, a, _) = written(false);
    let (local, reused) = greedy(&a, &prompt());
    assert_eq!(reused, 36);
    let b = manager(&store, 7, 1, false);
    let cache = &b.engine().cache();
    let e = ExtraKeys::default();
    let fetched = cache.remote_lookup(&prompt(), &e).unwrap().fetch();
    assert_eq!(stats(&b).hit_blocks, 9);
    // Meanwhile another request brings the first 3 blocks in locally.
    greedy(&b, &prompt()[..13]);
    let mut seq = cache.open_with(&prompt(), &e, Some(fetched)).unwrap();
    assert_eq!(seq.len(), 36, "3 local blocks, then 6 of the 9 fetched");
    cache.register(&seq, &prompt()[..36], &e).unwrap();
    cache.free(&mut seq).unwrap();
    assert_eq!(stats(&b).lookups, 2, "the lookup, then the short request's");
    let (again, reused) = greedy(&b, &prompt());
    assert_eq!((again, reused), (local, 36));
    assert_eq!(stats(&b).lookups, 2, "a local hit now");
}

/// An answer imports nothing where it does not follow on: for other
/// tokens, another namespace, or a sequence whose local prefix is shorter
/// than where the lookup began (its blocks were reclaimed meanwhile).
#[test]
fn a_lookup_answer_that_does_not_follow_on_imports_nothing() {
    let (store, _a, _) = written(false);
    let b = manager(&store, 7, 1, false);
    let cache = &b.engine().cache();
    let e = ExtraKeys::default();
    let other: Vec<u32> = prompt().iter().map(|t| t + 1).collect();
    let tenant = ExtraKeys::namespace("tenant");
    for (tokens, extra) in [(&other, &e), (&prompt(), &tenant)] {
        let fetched = cache.remote_lookup(&prompt(), &e).unwrap().fetch();
        let mut seq = cache.open_with(tokens, extra, Some(fetched)).unwrap();
        assert_eq!(seq.len(), 0);
        cache.free(&mut seq).unwrap();
    }
    // An answer for a longer prompt covers every token of a shorter one:
    // the last token must still be computed (the review of issue 43's
    // first steps).
    let short = &prompt()[..36];
    let fetched = cache.remote_lookup(&prompt(), &e).unwrap().fetch();
    let mut seq = cache.open_with(short, &e, Some(fetched)).unwrap();
    assert!(seq.len() < short.len(), "{} of {}", seq.len(), short.len());
    cache.free(&mut seq).unwrap();
    // Through another link: a cache of another block size (its scope
    // differs) would lay 4-token payloads out as 2-token blocks.
    let fetched = cache.remote_lookup(&prompt(), &e).unwrap().fetch();
    let mut small = engine_bs(2, 7, false);
    link(&mut small, &store, 1, false);
    let mut seq = small
        .cache()
        .open_with(&prompt(), &e, Some(fetched))
        .unwrap();
    assert_eq!(seq.len(), 0, "an answer of another link");
    small.cache().free(&mut seq).unwrap();
    // Asked after 3 local blocks; opened where none is held.
    greedy(&b, &prompt()[..13]);
    let fetched = cache.remote_lookup(&prompt(), &e).unwrap().fetch();
    let c = manager(&store, 7, 1, false);
    let mut seq = c
        .engine()
        .cache()
        .open_with(&prompt(), &e, Some(fetched))
        .unwrap();
    assert_eq!(seq.len(), 0, "blocks 3.. do not follow on an empty prefix");
    c.engine().cache().free(&mut seq).unwrap();
    assert_eq!(c.engine().cache().bytes_in_use(), 0);
}
