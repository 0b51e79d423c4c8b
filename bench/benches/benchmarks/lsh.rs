//! What sharing a cold block costs per demotion, on SmolLM2-135M's cold
//! block (30 layers × K and V × 16 tokens × 3 KV heads × 64 = 184,320
//! elements): the exact deduplicator's hash, SimHash's signature and lookup
//! (no match, 128 candidates known), and the dequantization SimHash needs
//! first (INT4, per-channel keys and per-token values).

use criterion::{BenchmarkId, Criterion};
use kvforge_lsh::{Content, Deduplicator, ExactDedup, SimHashConfig, SimHashDedup};
use kvforge_pool::BlockId;
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, Quantizer, testing};

const SLAB: BlockShape = BlockShape {
    tokens: 16,
    heads: 3,
    head_dim: 64,
};
const SLABS: usize = 60;

fn vector(seed: u64) -> Vec<f32> {
    (0..SLABS as u64)
        .flat_map(|s| testing::sample(SLAB, seed * 1000 + s))
        .collect()
}

fn lsh(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_lsh");
    let x = vector(1);
    let content = Content {
        bytes: x
            .iter()
            .map(|v| v.to_bits() as u8)
            .take(x.len() / 4)
            .collect(),
        vector: x,
    };
    // Known candidates, none similar: every offer is a miss (the common case
    // on real text, where whole cold blocks never reach cosine 0.9).
    let mut simhash = SimHashDedup::new(SimHashConfig::default()).unwrap();
    let mut exact = ExactDedup::new();
    for i in 0..128u32 {
        let other = Content {
            bytes: vec![i as u8; content.bytes.len()],
            vector: vector(u64::from(i) + 10),
        };
        let _ = simhash.offer(BlockId::new(i, 1), &other, &mut |_| None);
        let _ = exact.offer(BlockId::new(i, 1), &other, &mut |_| None);
    }
    let fresh = BlockId::new(10_000, 1);
    g.bench_function(BenchmarkId::new("offer", simhash.name()), |b| {
        b.iter(|| {
            let r = simhash.offer(fresh, &content, &mut |_| None);
            simhash.forget(fresh);
            r
        })
    });
    g.bench_function(BenchmarkId::new("offer", exact.name()), |b| {
        b.iter(|| {
            let r = exact.offer(fresh, &content, &mut |_| None);
            exact.forget(fresh);
            r
        })
    });
    // The dequantization a vector-comparing deduplicator needs per offer.
    let keys = GroupQuantizer::new(QuantConfig::new(4, 16, Axis::PerChannel).unwrap());
    let values = GroupQuantizer::new(QuantConfig::new(4, 32, Axis::PerToken).unwrap());
    let slab = testing::sample(SLAB, 3);
    let (kq, vq) = (
        keys.quantize(SLAB, &slab).unwrap(),
        values.quantize(SLAB, &slab).unwrap(),
    );
    let mut out = vec![0f32; SLAB.len() * SLABS];
    g.bench_function("dequantize_block/int4", |b| {
        b.iter(|| {
            for (i, o) in out.chunks_mut(SLAB.len()).enumerate() {
                if i < SLABS / 2 {
                    keys.dequantize(&kq, o).unwrap();
                } else {
                    values.dequantize(&vq, o).unwrap();
                }
            }
        })
    });
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = lsh
}
