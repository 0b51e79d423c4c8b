//! Chained block hashing with verification, tokens per second.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use kvforge_bench::synthetic_tokens;
use kvforge_prefix::{BlockHash, Xxh3Hasher, block_key};

/// Hashes every block of a 32k-token sequence in a chain and compares each
/// block's tokens with a stored copy, exactly the work of a full-hit lookup
/// minus the map probe.
fn chained_hashing(c: &mut Criterion) {
    let tokens = synthetic_tokens(32 * 1024, 1);
    let stored = tokens.clone();
    let hasher = Xxh3Hasher::with_seed(0);
    let mut g = c.benchmark_group("cpu_hash_chain_verify");
    g.throughput(Throughput::Elements(tokens.len() as u64));
    for bs in [16usize, 32, 64, 128, 256, 512] {
        g.bench_with_input(BenchmarkId::from_parameter(bs), &bs, |b, &bs| {
            let mut scratch = Vec::with_capacity(16 + 4 * bs);
            b.iter(|| {
                let mut key = BlockHash(0);
                let mut verified = 0usize;
                for (q, s) in tokens.chunks_exact(bs).zip(stored.chunks_exact(bs)) {
                    key = block_key(&hasher, key, q, &mut scratch);
                    verified += usize::from(q == s);
                }
                black_box((key, verified))
            })
        });
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = chained_hashing
}
