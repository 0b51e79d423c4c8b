//! What KV events add to the prefix index: registering a 2048-token
//! sequence (128 blocks of 16) and forgetting it, plain and watched (the
//! events serialized to JSON, as `kvforge serve --kv-events` writes them).

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use kvforge_bench::synthetic_tokens;
use kvforge_prefix::{
    BlockId, BlockRef, EventSink, ExtraKeys, HashChainIndex, KvEvent, PrefixMatcher, Watched,
};

/// Serializes each batch, as the server's log does, and keeps its size.
struct Json(usize);

impl EventSink for Json {
    fn publish(&mut self, _namespace: &str, events: Vec<KvEvent>) {
        self.0 += serde_json::to_string(&events).map_or(0, |s| s.len());
    }
}

fn register_and_forget(m: &mut dyn PrefixMatcher, tokens: &[u32], blocks: &[BlockRef]) {
    let e = ExtraKeys::namespace("tenant");
    let out = m.insert(tokens, &e, blocks).unwrap();
    assert_eq!(out.new, blocks.len());
    assert!(m.forget(blocks[0].block));
}

fn register(c: &mut Criterion) {
    let bs = 16;
    let tokens = synthetic_tokens(2048, 3);
    let blocks: Vec<BlockRef> = (0..128)
        .map(|i| BlockRef::new(BlockId::new(i, 1), bs as u32))
        .collect();
    let mut g = c.benchmark_group("cpu_index_events");
    g.throughput(Throughput::Elements(blocks.len() as u64));
    g.bench_function(BenchmarkId::new("plain", "128 blocks"), |b| {
        b.iter_batched(
            || HashChainIndex::with_seed(bs, 0).unwrap(),
            |mut m| register_and_forget(&mut m, &tokens, &blocks),
            BatchSize::SmallInput,
        )
    });
    g.bench_function(BenchmarkId::new("watched-json", "128 blocks"), |b| {
        b.iter_batched(
            || {
                Watched::new(
                    HashChainIndex::with_seed(bs, 0).unwrap(),
                    Box::new(Json(0)),
                    0,
                )
            },
            |mut m| register_and_forget(&mut m, &tokens, &blocks),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = register
}
