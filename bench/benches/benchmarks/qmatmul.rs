//! The quantized matmul (`kvforge-kernels::qmatmul`) at SmolLM2's shapes:
//! a Q4_1 FFN projection (1536 × 576) and the Q8_0 output head (49152 ×
//! 576), for 1, 8, 64 and 512 activation rows (decode, a batch, a prompt
//! chunk), on the scalar twin (one row only: it is slow) and the fastest
//! instruction set, over the process' matmul pool. Throughput is weights
//! × rows, the multiply-adds of the call.

use criterion::{BenchmarkId, Criterion, Throughput};
use kvforge_kernels::{Activations, Isa, Pool, QMatrix, WeightFormat};

/// Valid blocks: random codes, f16 scales of 1/64.
fn blocks(format: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    let (per, size) = format.block();
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut bytes: Vec<u8> = (0..rows * cols / per * size)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let scale = kvforge_quant::f16::from_f32(1.0 / 64.0)
        .to_bits()
        .to_le_bytes();
    for blk in bytes.chunks_exact_mut(size) {
        blk[..2].copy_from_slice(&scale);
        if format == WeightFormat::Q4_1 {
            blk[2..4].copy_from_slice(&scale);
        }
    }
    bytes
}

fn qmatmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_qmatmul");
    let pool = Pool::global();
    for (name, format, n, k) in [
        ("q4_1_1536x576", WeightFormat::Q4_1, 1536, 576),
        ("q8_0_49152x576", WeightFormat::Q8_0, 49152, 576),
    ] {
        let w = QMatrix::from_ggml(format, n, k, &blocks(format, n, k)).unwrap();
        for rows in [1usize, 8, 64, 512] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                .collect();
            let mut a = Activations::default();
            a.quantize(&x, rows, k).unwrap();
            let mut out = vec![0f32; rows * n];
            g.throughput(Throughput::Elements((rows * n * k) as u64));
            // Every set this CPU runs, side by side (the scalar twin at one
            // row only).
            for isa in Isa::ALL
                .into_iter()
                .filter(|i| i.supported() && (rows == 1 || *i != Isa::Scalar))
            {
                let id = BenchmarkId::new(format!("{name}_{}", isa.name()), rows);
                g.bench_function(id, |b| {
                    b.iter(|| w.matmul(&a, &mut out, isa, pool).unwrap());
                });
            }
        }
    }
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = qmatmul
}
