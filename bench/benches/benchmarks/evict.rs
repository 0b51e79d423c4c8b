//! What a scored eviction policy costs per decode step: observing the
//! attention mass of every entry and choosing victims, on a 4096-token
//! sequence in blocks of 16 (256 entries) under a budget of 2048 tokens.
//! The table does not change between calls, so every call ranks all
//! entries and names about 128 victims: an upper bound on a steady decode
//! step, which names one. Compare with a decode step of the engine at that
//! context. Head-wise KeyDiff ranks each of 90 lanes on its own;
//! token-level KeyDiff ranks the 4096 rows.

use criterion::{BenchmarkId, Criterion};
use kvforge_evict::{EvictionPolicy, Pressure, Score, Scored, Trigger};
use kvforge_pool::{BlockId, BlockTable, Slot};

fn evict(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_evict");
    let mut t = BlockTable::new(16).unwrap();
    for i in 0..256u32 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 16, false).unwrap();
    }
    let mass: Vec<f32> = (0..256).map(|i| 1.0 / (1.0 + (i % 17) as f32)).collect();
    for (name, score) in [
        ("h2o", Score::AttentionEma { decay: 0.9 }),
        ("lfu", Score::Lfu),
        (
            "hybrid",
            Score::Hybrid {
                alpha: 1.0,
                beta: 1.0,
                gamma: 1.0,
            },
        ),
    ] {
        let mut p = Scored::new(score, Trigger::Tokens(2048), 32, 256).unwrap();
        let mut out = Vec::new();
        g.bench_function(BenchmarkId::new("observe+victims/4096", name), |b| {
            b.iter(|| {
                p.observe(0, &t, &mass);
                out.clear();
                p.victims(0, &t, Pressure::new(0.5, 1), &mut out);
                out.len()
            })
        });
    }
    // Head-wise KeyDiff at SmolLM2-135M's 90 lanes (30 layers × 3 KV
    // heads): per-lane key novelty in, the same number of pages per lane
    // out — 128 per lane under the 2048-token budget (the upper bound), or
    // one per lane in a steady step (a budget one token short).
    let lanes = 90;
    let novelty: Vec<f32> = (0..256 * lanes)
        .map(|i| ((i * 7919) % 1009) as f32 / 1009.0)
        .collect();
    for (name, budget) in [
        ("keydiff-per-head", 2048),
        ("keydiff-per-head-steady", 4096),
    ] {
        let mut p = Scored::new(Score::KeyDiff, Trigger::Tokens(budget), 32, 256)
            .unwrap()
            .per_head()
            .unwrap();
        let mut out = Vec::new();
        g.bench_function(BenchmarkId::new("observe+victims/4096", name), |b| {
            b.iter(|| {
                p.observe_keys(0, &t, &novelty);
                out.clear();
                p.lane_victims(0, &t, Pressure::new(0.5, 1), lanes, &mut out);
                out.len()
            })
        });
    }
    // Token-level KeyDiff: one novelty per row (4096) in, rows out — 2049
    // under the 2048-token budget (the upper bound), one in a steady step.
    let rows: Vec<f32> = (0..4096)
        .map(|i| ((i * 7919) % 1009) as f32 / 1009.0)
        .collect();
    for (name, budget) in [
        ("keydiff-per-token", 2048),
        ("keydiff-per-token-steady", 4096),
    ] {
        let mut p = Scored::new(Score::KeyDiff, Trigger::Tokens(budget), 32, 256)
            .unwrap()
            .per_token()
            .unwrap();
        let mut out = Vec::new();
        g.bench_function(BenchmarkId::new("observe+victims/4096", name), |b| {
            b.iter(|| {
                p.observe_keys(0, &t, &rows);
                out.clear();
                p.token_victims(0, &t, Pressure::new(0.5, 1), &mut out);
                out.len()
            })
        });
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = evict
}
