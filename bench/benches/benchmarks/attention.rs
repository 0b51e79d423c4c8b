//! One layer of paged decode attention (`kvforge-kernels`) at SmolLM2's
//! shape (9 query heads, 3 KV heads, head dim 64), blocks of 32 tokens:
//! f32 and f16 hot pages and INT4 cold pages (KIVI keys, values in groups
//! of 32), on the scalar twin and the fastest instruction set, at 1k and
//! 8k keys; alone, with the attention mass, or with the key novelty
//! (KeyDiff) per entry from the same pass. Bytes per call are the pages'
//! K and V (codes and group parameters for INT4).

use criterion::{BenchmarkId, Criterion, Throughput};
use kvforge_kernels::{ColdFormat, Dims, Isa, Page, PagedDecode, Span};
use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Quantizer, f16,
};

const BLOCK: usize = 32;

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                / (1 << 24) as f32
                - 0.5
        })
        .collect()
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_attention");
    let dims = Dims {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    let row = dims.kv_heads * dims.head_dim;
    let shape = BlockShape {
        tokens: BLOCK,
        heads: dims.kv_heads,
        head_dim: dims.head_dim,
    };
    let kc = QuantConfig::new(4, BLOCK, Axis::PerChannel).unwrap();
    let vc = QuantConfig::new(4, 32, Axis::PerToken).unwrap();
    let (kq, vq) = (GroupQuantizer::new(kc), GroupQuantizer::new(vc));
    let q = data(dims.heads * dims.head_dim, 7);
    let mut out = vec![0f32; q.len()];
    for keys in [1024usize, 8192] {
        let pages = keys / BLOCK;
        let k32: Vec<Vec<f32>> = (0..pages)
            .map(|p| data(BLOCK * row, 2 * p as u32))
            .collect();
        let v32: Vec<Vec<f32>> = (0..pages)
            .map(|p| data(BLOCK * row, 2 * p as u32 + 1))
            .collect();
        let half = |x: &Vec<f32>| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
        let (k16, v16): (Vec<_>, Vec<_>) = (
            k32.iter().map(half).collect(),
            v32.iter().map(half).collect(),
        );
        let cold: Vec<(QuantizedBlock, QuantizedBlock)> = k32
            .iter()
            .zip(&v32)
            .map(|(k, v)| {
                (
                    kq.quantize(shape, k).unwrap(),
                    vq.quantize(shape, v).unwrap(),
                )
            })
            .collect();
        let span = |page, i| Span {
            page,
            tokens: BLOCK,
            entry: i,
        };
        let tiers: [(&str, Vec<Span<'_>>, u64); 3] = [
            (
                "f32",
                (0..pages)
                    .map(|i| {
                        span(
                            Page::F32 {
                                k: &k32[i],
                                v: &v32[i],
                            },
                            i,
                        )
                    })
                    .collect(),
                (keys * row * 2 * 4) as u64,
            ),
            (
                "f16",
                (0..pages)
                    .map(|i| {
                        span(
                            Page::F16 {
                                k: &k16[i],
                                v: &v16[i],
                            },
                            i,
                        )
                    })
                    .collect(),
                (keys * row * 2 * 2) as u64,
            ),
            (
                "int4",
                (0..pages)
                    .map(|i| {
                        span(
                            Page::Quant {
                                k: &cold[i].0,
                                v: &cold[i].1,
                            },
                            i,
                        )
                    })
                    .collect(),
                cold.iter()
                    .map(|(k, v)| (k.bytes() + v.bytes()) as u64)
                    .sum(),
            ),
        ];
        for (tier, spans, bytes) in &tiers {
            g.throughput(Throughput::Bytes(*bytes));
            for isa in [Isa::Scalar, Isa::detect()] {
                let kern = PagedDecode::new(dims)
                    .unwrap()
                    .with_cold(ColdFormat::new(kc, vc, false))
                    .unwrap()
                    .with_isa(isa)
                    .unwrap();
                for observe in ["", "+mass", "+novelty"] {
                    if isa == Isa::Scalar && (!observe.is_empty() || keys > 1024) {
                        continue;
                    }
                    let name = format!("{tier}-{}{observe}", isa.name());
                    let (mut mass, mut novelty) = (vec![0f32; pages], vec![0f32; pages]);
                    g.bench_function(BenchmarkId::new(name, keys), |b| {
                        b.iter(|| {
                            kern.run_observed(
                                &q,
                                spans,
                                &mut out,
                                (observe == "+mass").then_some(&mut mass[..]),
                                (observe == "+novelty").then_some(&mut novelty[..]),
                            )
                            .unwrap();
                            out[0]
                        })
                    });
                }
            }
        }
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = attention
}
