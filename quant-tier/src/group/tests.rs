//! Unit tests of GroupQuantizer's decoders and f16 rounding.

use super::decode::decode_any;
use super::encode::{f16_ceil, f16_floor, f16_step, round_even};
use super::*;

/// xorshift64*, seeded.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn decode_with(
    f: impl Fn(QuantConfig, &QuantizedBlock, &mut [MaybeUninit<f32>]),
    cfg: QuantConfig,
    b: &QuantizedBlock,
) -> Vec<u32> {
    let mut out = vec![MaybeUninit::new(f32::NAN); b.shape.len()];
    f(cfg, b, &mut out);
    // SAFETY: initialized above (and overwritten by the decoder).
    unsafe { assume_init(&mut out) }
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The run-time-dispatched (AVX2 where present) and the plain scalar
/// decoders agree bit for bit, over random shapes and extreme values.
#[test]
fn simd_and_scalar_decoders_agree_bit_for_bit() {
    let mut r = rng(42);
    let specials = [
        0.0, -0.0, 1e-30, -1e-30, 6e-8, 8.3e6, -8.3e6, 65504.0, -65504.0, 1.0,
    ];
    for case in 0..400 {
        let bits = [8, 4, 2][case % 3];
        let axis = if case % 2 == 0 {
            Axis::PerToken
        } else {
            Axis::PerChannel
        };
        let g = [16usize, 32, 64][(r() % 3) as usize];
        let shape = BlockShape {
            tokens: g * (1 + (r() % 2) as usize),
            heads: 1 + (r() % 3) as usize,
            head_dim: [32usize, 64, 128][(r() % 3) as usize],
        };
        let cfg = match QuantConfig::new(bits, g, axis) {
            Ok(c) => c,
            Err(_) => continue,
        };
        let quant = GroupQuantizer::new(cfg);
        let scale = [1e-6f32, 1.0, 1e3, 1e5][(r() % 4) as usize];
        let x: Vec<f32> = (0..shape.len())
            .map(|_| {
                let u = r();
                if u % 17 == 0 {
                    specials[(u >> 8) as usize % specials.len()]
                } else {
                    ((u >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * scale
                }
            })
            .collect();
        let Ok(b) = quant.quantize(shape, &x) else {
            continue;
        };
        assert_eq!(
            decode_with(decode_dispatch, cfg, &b),
            decode_with(decode_any, cfg, &b),
            "case {case}: {cfg:?} {shape:?}"
        );
    }
}

#[test]
fn f16_rounding_helpers_round_the_right_way() {
    for x in [
        300.1f32, -300.1, 1e-7, -1e-7, 0.0, 65504.0, -65503.0, 3.3e-9,
    ] {
        let lo = f16_floor(x).unwrap().to_f32();
        let hi = f16_ceil(x).unwrap().to_f32();
        assert!(lo <= x && x <= hi, "{x}: [{lo}, {hi}]");
        assert!(f16_step(f16::from_f32(lo), true).to_f32() > x || lo == x);
    }
    assert_eq!(f16_floor(-65520.0), None, "below the f16 range");
    assert_eq!(f16_ceil(65505.0), None);
    assert_eq!(
        f16_ceil(1e-9).unwrap().to_bits(),
        1,
        "smallest subnormal, not 0"
    );
    assert_eq!(round_even(0.499_999_97), 0.0);
    assert_eq!(
        (round_even(0.5), round_even(1.5), round_even(-2.5)),
        (0.0, 2.0, -2.0)
    );
}
