//! Longest-prefix match latency against 1k..128k cached tokens.

use criterion::{BenchmarkId, Criterion, Throughput};
use kvforge_bench::{cached_index, synthetic_tokens};
use kvforge_prefix::{ExtraKeys, HashChainIndex, PrefixMatcher, RadixIndex};

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

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = longest_prefix_match
}
