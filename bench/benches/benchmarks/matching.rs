//! Longest-prefix match latency against 1k..128k cached tokens, and the cost
//! of forgetting many first blocks (siblings under one root).

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use kvforge_bench::{cached_index, synthetic_tokens};
use kvforge_prefix::{BlockId, BlockRef, ExtraKeys, HashChainIndex, PrefixMatcher, RadixIndex};

fn longest_prefix_match(c: &mut Criterion) {
    let e = ExtraKeys::default();
    for bs in [16usize, 128] {
        let mut g = c.benchmark_group(format!("cpu_match_prefix/bs{bs}"));
        for cached in [1usize << 10, 8 << 10, 32 << 10, 128 << 10] {
            // The query is the cached sequence plus a new suffix: a full hit
            // on every cached block, then one miss.
            let mut query = synthetic_tokens(cached, 7);
            let mut chain = HashChainIndex::with_seed(bs, 0).unwrap();
            let mut radix = RadixIndex::new(bs).unwrap();
            cached_index(&mut chain, &query, &e);
            cached_index(&mut radix, &query, &e);
            query.extend(synthetic_tokens(bs, 99));
            g.throughput(Throughput::Elements(cached as u64));
            let label = format!("{}k", cached >> 10);
            g.bench_with_input(BenchmarkId::new("hash_chain", &label), &query, |b, q| {
                b.iter(|| assert_eq!(chain.match_prefix(q, &e).tokens, cached))
            });
            g.bench_with_input(BenchmarkId::new("radix", &label), &query, |b, q| {
                b.iter(|| assert_eq!(radix.match_prefix(q, &e).tokens, cached))
            });
        }
        g.finish();
    }
}

/// `n` one-block sequences with distinct first blocks in one namespace.
fn siblings(m: &mut dyn PrefixMatcher, n: u32) {
    let e = ExtraKeys::default();
    for i in 0..n {
        let t = [i, i + 1, i + 2, i + 3];
        if let Err(err) = m.insert(&t, &e, &[BlockRef::new(BlockId::new(i, 1), 4)]) {
            panic!("indexing siblings: {err}");
        }
    }
}

/// Forgets all `n` first blocks: O(n) in total when each forget is O(1).
fn forget_first_blocks(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_forget_first_blocks");
    g.sample_size(10);
    for n in [5_000u32, 10_000, 20_000] {
        g.throughput(Throughput::Elements(u64::from(n)));
        let label = format!("{}k", n / 1000);
        g.bench_function(BenchmarkId::new("hash_chain", &label), |b| {
            b.iter_batched(
                || {
                    let mut m = HashChainIndex::with_seed(4, 0).unwrap();
                    siblings(&mut m, n);
                    m
                },
                |mut m| (0..n).filter(|&i| m.forget(BlockId::new(i, 1))).count(),
                BatchSize::LargeInput,
            )
        });
        g.bench_function(BenchmarkId::new("radix", &label), |b| {
            b.iter_batched(
                || {
                    let mut m = RadixIndex::new(4).unwrap();
                    siblings(&mut m, n);
                    m
                },
                |mut m| (0..n).filter(|&i| m.forget(BlockId::new(i, 1))).count(),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = longest_prefix_match, forget_first_blocks
}
