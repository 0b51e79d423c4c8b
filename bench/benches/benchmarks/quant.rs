//! Quantize / dequantize throughput of the cold-tier formats, GB/s of f32 in.

use criterion::{BenchmarkId, Criterion, Throughput};
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, Quantizer, Rotated, testing};

fn quant(c: &mut Criterion) {
    let shape = BlockShape {
        tokens: 128,
        heads: 8,
        head_dim: 128,
    };
    let x = testing::sample(shape, 1);
    let mut y = vec![0f32; x.len()];
    let q = |bits, axis| GroupQuantizer::new(QuantConfig::new(bits, 64, axis).unwrap());
    let cases: Vec<Box<dyn Quantizer>> = vec![
        Box::new(q(8, Axis::PerToken)),
        Box::new(q(4, Axis::PerToken)),
        Box::new(q(2, Axis::PerToken)),
        Box::new(q(4, Axis::PerChannel)),
        Box::new(Rotated::new(q(4, Axis::PerToken))),
    ];
    let mut g = c.benchmark_group("cpu_quant");
    g.throughput(Throughput::Bytes((x.len() * 4) as u64));
    for quantizer in &cases {
        let name = quantizer.name();
        g.bench_function(BenchmarkId::new("quantize", &name), |b| {
            b.iter(|| quantizer.quantize(shape, &x).unwrap())
        });
        let block = quantizer.quantize(shape, &x).unwrap();
        g.bench_function(BenchmarkId::new("dequantize", &name), |b| {
            b.iter(|| quantizer.dequantize(&block, &mut y).unwrap())
        });
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = quant
}
