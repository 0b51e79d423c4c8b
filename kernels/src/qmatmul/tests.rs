//! Every weight format × instruction set against the f64 product of the
//! dequantized weights with the int16 activations the kernel reads (only
//! float rounding apart: a tight bound), against the f32 activations (the
//! activations' rounding bound, derived), and against the scalar twin;
//! and mutants (nibbles swapped, scales off) that must fail the bounds.

#![allow(clippy::unwrap_used)]

use half::f16;

use super::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random blocks of `format` for a `[rows, cols]` matrix: random codes,
/// f16 scales in a model's range (±1/16).
fn random_blocks(format: WeightFormat, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let (per, size) = format.block();
    let mut bytes: Vec<u8> = (0..rows * cols / per * size)
        .map(|_| rng.next() as u8)
        .collect();
    let scale = |b: &mut [u8], at: usize, rng: &mut Rng| {
        let v = f16::from_f32(rng.f() / 16.0).to_bits().to_le_bytes();
        b[at..at + 2].copy_from_slice(&v);
    };
    for blk in bytes.chunks_exact_mut(size) {
        match format {
            WeightFormat::Q4_0 | WeightFormat::Q8_0 => scale(blk, 0, rng),
            WeightFormat::Q4_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
                scale(blk, 0, rng);
                scale(blk, 2, rng);
            }
            WeightFormat::Q6_K => scale(blk, 208, rng),
        }
    }
    bytes
}

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.supported()).collect()
}

/// The products row by row in f64: `x[i] · w[j]`, and `|x[i]| · |w[j]|`.
fn reference(w: &[f32], x: &[f32], m: usize, n: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; m * n];
    let mut a = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                let (p, q) = (f64::from(x[i * k + l]), f64::from(w[j * k + l]));
                y[i * n + j] += p * q;
                a[i * n + j] += (p * q).abs();
            }
        }
    }
    (y, a)
}

/// The activations as the kernel reads them: codes times block scale.
fn read_back(x: &Activations) -> Vec<f32> {
    x.q.iter()
        .enumerate()
        .map(|(i, &q)| f32::from(q) * x.d[i / BLOCK])
        .collect()
}

/// `Σ_b d_b / 2 · Σ_{j ∈ b} |w_j|` per output: how far rounding the
/// activations to int16 can move each product.
fn rounding_bound(w: &[f32], x: &Activations, n: usize) -> Vec<f64> {
    let (m, k) = (x.rows(), x.cols());
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                let d = f64::from(x.d[(i * k + l) / BLOCK]);
                out[i * n + j] += d / 2.0 * f64::from(w[j * k + l]).abs();
            }
        }
    }
    out
}

/// Shapes: one row (decode), a tile and a half, a batch; columns not a
/// multiple of a part's share.
const SHAPES: [(usize, usize, usize); 3] = [(1, 37, 256), (6, 20, 512), (17, 9, 768)];

/// Float rounding allowed between the kernel and an f64 sum of the same
/// terms, relative to `Σ |terms|`: the kernel scales each block's exact
/// integer sum in f32 and adds `k / 32` such terms (and the reference
/// rounds each dequantized weight once), so the worst case is about
/// `(k / 32 + 4) · 2⁻²⁴` ≈ 1.7e-6 at k = 768: a margin of 50 or more
/// (measured worst here: 8.4e-8).
const ROUNDING: f64 = 1e-4;

/// Checks the kernel on every shape; returns the worst `error / Σ|terms|`
/// against the int16 activations it read.
fn check(format: WeightFormat, isa: Isa, pool: &Pool, seed: u64) -> f64 {
    let mut rng = Rng(seed);
    let mut worst = 0f64;
    for (m, n, k) in SHAPES {
        let bytes = random_blocks(format, n, k, &mut rng);
        let w = QMatrix::from_ggml(format, n, k, &bytes).unwrap();
        let wf = w.dequantize();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f() * 4.0).collect();
        let mut a = Activations::default();
        a.quantize(&x, m, k).unwrap();
        let mut y = vec![f32::NAN; m * n];
        w.matmul(&a, &mut y, isa, pool).unwrap();
        // The int16 activations the kernel read: only rounding apart.
        let (exact, size) = reference(&wf, &read_back(&a), m, n, k);
        for i in 0..m * n {
            let err = (f64::from(y[i]) - exact[i]).abs();
            worst = worst.max(err / size[i].max(1e-30));
            assert!(
                err <= ROUNDING * size[i] + 1e-6,
                "{format:?} {isa:?} {m}x{n}x{k} out {i}: {} vs {} (error {err:e}, bound {:e})",
                y[i],
                exact[i],
                ROUNDING * size[i]
            );
        }
        // The f32 activations: the rounding to int16 on top.
        let (full, size) = reference(&wf, &x, m, n, k);
        let bound = rounding_bound(&wf, &a, n);
        for i in 0..m * n {
            let err = (f64::from(y[i]) - full[i]).abs();
            assert!(
                err <= bound[i] + ROUNDING * size[i] + 1e-6,
                "{format:?} {isa:?} out {i}: error {err:e} over the int16 bound {:e}",
                bound[i]
            );
        }
    }
    worst
}

#[test]
fn every_format_and_instruction_set_matches_the_dequantized_product() {
    let pool = Pool::new(2);
    let mut worst = 0f64;
    for format in WeightFormat::ALL {
        for isa in isas() {
            worst = worst.max(check(format, isa, &pool, 7 + format as u64));
        }
    }
    eprintln!("worst error / Σ|terms|: {worst:.2e} (bound {ROUNDING:e})");
}

#[test]
fn every_instruction_set_matches_the_scalar_twin() {
    let pool = Pool::new(3);
    let mut rng = Rng(11);
    for format in WeightFormat::ALL {
        let (m, n, k) = (9, 33, 512);
        let w = QMatrix::from_ggml(format, n, k, &random_blocks(format, n, k, &mut rng)).unwrap();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f()).collect();
        let mut a = Activations::default();
        a.quantize(&x, m, k).unwrap();
        let mut want = vec![0f32; m * n];
        w.matmul(&a, &mut want, Isa::Scalar, &pool).unwrap();
        let (_, size) = reference(&w.dequantize(), &read_back(&a), m, n, k);
        for isa in isas() {
            let mut y = vec![0f32; m * n];
            w.matmul(&a, &mut y, isa, &pool).unwrap();
            for i in 0..m * n {
                let err = f64::from((y[i] - want[i]).abs());
                assert!(err <= ROUNDING * size[i], "{format:?} {isa:?} out {i}");
            }
        }
    }
}

/// A mutant of the bytes (as a broken kernel would read them) must fail
/// the tight bound somewhere.
fn mutant_fails(format: WeightFormat, mutate: impl Fn(&mut [u8])) -> bool {
    let (m, n, k) = (3, 16, 256);
    let mut rng = Rng(3);
    let bytes = random_blocks(format, n, k, &mut rng);
    let good = QMatrix::from_ggml(format, n, k, &bytes).unwrap();
    let mut bad_bytes = bytes.clone();
    for blk in bad_bytes.chunks_exact_mut(format.block().1) {
        mutate(blk);
    }
    let bad = QMatrix::from_ggml(format, n, k, &bad_bytes).unwrap();
    let x: Vec<f32> = (0..m * k).map(|_| rng.f()).collect();
    let mut a = Activations::default();
    a.quantize(&x, m, k).unwrap();
    let (exact, size) = reference(&good.dequantize(), &read_back(&a), m, n, k);
    let pool = Pool::new(1);
    isas().into_iter().all(|isa| {
        let mut y = vec![0f32; m * n];
        bad.matmul(&a, &mut y, isa, &pool).unwrap();
        (0..m * n).any(|i| (f64::from(y[i]) - exact[i]).abs() > ROUNDING * size[i] + 1e-6)
    })
}

#[test]
fn a_swapped_nibble_order_or_a_scale_off_fails_the_bounds() {
    let swap = |lo: usize, hi: usize| {
        move |b: &mut [u8]| {
            for v in &mut b[lo..hi] {
                *v = v.rotate_left(4);
            }
        }
    };
    assert!(mutant_fails(WeightFormat::Q4_0, swap(2, 18)));
    assert!(mutant_fails(WeightFormat::Q4_1, swap(4, 20)));
    assert!(mutant_fails(WeightFormat::Q4_K, swap(16, 144)));
    // A scale 1% off.
    let scale_off = |at: usize| {
        move |b: &mut [u8]| {
            let d = f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]));
            let d = f16::from_f32(d.to_f32() * 1.01);
            b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    };
    for (format, at) in [
        (WeightFormat::Q4_0, 0),
        (WeightFormat::Q4_1, 2),
        (WeightFormat::Q8_0, 0),
        (WeightFormat::Q4_K, 0),
        (WeightFormat::Q5_K, 2),
        (WeightFormat::Q6_K, 208),
    ] {
        assert!(mutant_fails(format, scale_off(at)), "{format:?}");
    }
}

#[test]
fn bad_shapes_are_errors() {
    let pool = Pool::new(1);
    let f = WeightFormat::Q4_1;
    assert!(QMatrix::from_ggml(f, 2, 48, &[0; 60]).is_err());
    assert!(QMatrix::from_ggml(f, 2, 64, &[0; 79]).is_err());
    assert!(QMatrix::from_ggml(WeightFormat::Q4_K, 1, 32, &[0; 20]).is_err());
    assert!(QMatrix::from_ggml(f, 0, 32, &[]).is_err());
    let w = QMatrix::from_ggml(f, 2, 64, &[0; 80]).unwrap();
    let mut a = Activations::default();
    assert!(a.quantize(&[0.0; 65], 1, 65).is_err());
    assert!(a.quantize(&[0.0; 64], 2, 64).is_err());
    a.quantize(&[0.0; 32], 1, 32).unwrap();
    assert!(w.matmul(&a, &mut [0.0; 2], Isa::Scalar, &pool).is_err());
    a.quantize(&[0.0; 64], 1, 64).unwrap();
    assert!(w.matmul(&a, &mut [0.0; 3], Isa::Scalar, &pool).is_err());
    assert!(w.matmul(&a, &mut [0.0; 2], Isa::Scalar, &pool).is_ok());
    assert!(w.dequantize_row(2, &mut [0.0; 64]).is_err());
}
