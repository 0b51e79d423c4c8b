//! Integration tests of `kvforge-quant`: the conformance suite on every
//! format, layout and rotation; per-element error bounds against an f64
//! reference (proptest); byte counts against `kvforge_pool::KvLayout`; the
//! Hadamard rotation; the tier plan; bad input.
#![allow(clippy::unwrap_used)]

use kvforge_pool::{KvLayout, StorageFormat};
use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantError, Quantizer, Rotated, TierPlan,
    hadamard_in_place, testing,
};
use proptest::prelude::*;

fn q(bits: u32, g: usize, axis: Axis) -> GroupQuantizer {
    GroupQuantizer::new(QuantConfig::new(bits, g, axis).unwrap())
}

#[test]
fn every_format_layout_and_rotation_passes_the_conformance_suite() {
    for bits in [8, 4, 2] {
        for g in [32, 64, 128] {
            for axis in [Axis::PerToken, Axis::PerChannel] {
                testing::check_quantizer(&q(bits, g, axis));
                testing::check_quantizer(&Rotated::new(q(bits, g, axis)));
            }
        }
    }
}

#[test]
fn bytes_match_the_pool_layout() {
    let shape = BlockShape {
        tokens: 64,
        heads: 3,
        head_dim: 64,
    };
    let x = testing::sample(shape, 1);
    for (bits, fmt) in [
        (8, StorageFormat::Int8 { group_size: 64 }),
        (4, StorageFormat::Int4 { group_size: 64 }),
        (2, StorageFormat::Int2 { group_size: 64 }),
    ] {
        for axis in [Axis::PerToken, Axis::PerChannel] {
            let b = q(bits, 64, axis).quantize(shape, &x).unwrap();
            let layout = KvLayout::new(1, 3, 64, 64, fmt).unwrap();
            assert_eq!(
                layout.block_bytes(),
                2 * b.bytes() as u64,
                "K and V slabs, int{bits} {axis:?}"
            );
        }
    }
}

/// The exact per-element bound of the module docs, from the stored params.
fn check_bound(quant: &GroupQuantizer, shape: BlockShape, x: &[f32]) {
    let b = quant.quantize(shape, x).unwrap();
    let mut y = vec![0f32; x.len()];
    quant.dequantize(&b, &mut y).unwrap();
    let cfg = quant.config();
    let g = cfg.group_size();
    // Group of each element, in the quantizer's storage order.
    let group_of = |i: usize| -> usize {
        match cfg.axis() {
            Axis::PerToken => i / g,
            Axis::PerChannel => {
                let c = shape.heads * shape.head_dim;
                let (t, ch) = (i / c, i % c);
                (ch * shape.tokens + t) / g
            }
        }
    };
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); x.len() / g];
    for i in 0..x.len() {
        members[group_of(i)].push(i);
    }
    for (k, idx) in members.iter().enumerate() {
        let s = f64::from(b.scales[k].to_f32());
        // Parameters are rounded outward (see the crate docs), so half a
        // step bounds every format; f32 arithmetic adds a few ulps.
        let bound = s / 2.0;
        for &i in idx {
            let err = (f64::from(x[i]) - f64::from(y[i])).abs();
            assert!(
                y[i].is_finite(),
                "{}: element {i} is {}",
                quant.name(),
                y[i]
            );
            assert!(
                err <= bound * (1.0 + 1e-5) + f64::from(x[i].abs()) * 1e-6 + 1e-12,
                "{}: element {i} error {err} > {bound}",
                quant.name()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn errors_stay_within_the_stated_bounds(
        bits in prop::sample::select(vec![8u32, 4, 2]),
        g in prop::sample::select(vec![32usize, 64]),
        per_channel in any::<bool>(),
        scale in 1e-3f32..1e3,
        seed in any::<u64>(),
        constant_group in any::<bool>(),
    ) {
        let axis = if per_channel { Axis::PerChannel } else { Axis::PerToken };
        let shape = BlockShape { tokens: 64, heads: 2, head_dim: 64 };
        let mut x: Vec<f32> = testing::sample(shape, seed).iter().map(|v| v * scale).collect();
        if constant_group {
            for v in &mut x[..g] { *v = 0.5 * scale; }
        }
        check_bound(&q(bits, g, axis), shape, &x);
    }

    /// Every finite input inside the documented range (here: magnitudes
    /// from 1e-6 to 3e4 around offsets up to ±2e4, the KIVI case of offset
    /// channels included) dequantizes to finite values within half a step.
    #[test]
    fn finite_input_in_range_comes_back_finite_and_within_bound(
        bits in prop::sample::select(vec![8u32, 4, 2]),
        g in prop::sample::select(vec![16usize, 32, 64]),
        per_channel in any::<bool>(),
        log_scale in -6f32..3.3,
        offset in -2e4f32..2e4,
        offset_channels in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let axis = if per_channel { Axis::PerChannel } else { Axis::PerToken };
        let shape = BlockShape { tokens: 64, heads: 2, head_dim: 64 };
        let scale = 10f32.powf(log_scale);
        let x: Vec<f32> = testing::sample(shape, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let shift = if offset_channels { offset * ((i % 7) as f32 / 7.0) } else { offset };
                v * scale + shift
            })
            .collect();
        check_bound(&q(bits, g, axis), shape, &x);
        if bits != 8 {
            // Rotation can grow an element by sqrt(64) = 8, past the range:
            // then it is refused, never returned as inf.
            let r = Rotated::new(q(bits, g, axis));
            match r.quantize(shape, &x) {
                Ok(b) => {
                    let mut y = vec![0f32; x.len()];
                    r.dequantize(&b, &mut y).unwrap();
                    prop_assert!(y.iter().all(|v| v.is_finite()));
                }
                Err(e) => prop_assert!(matches!(e, QuantError::OutOfRange { .. }), "{}", e),
            }
        }
    }
}

fn shape1(head_dim: usize) -> BlockShape {
    BlockShape {
        tokens: 1,
        heads: 1,
        head_dim,
    }
}

#[test]
fn values_f16_parameters_cannot_hold_are_refused_not_poisoned() {
    // INT8: one value of 1e7 in a group (its scale would be inf in f16).
    let mut x = vec![0.5f32; 32];
    x[7] = 1e7;
    let e = q(8, 32, Axis::PerToken)
        .quantize(shape1(32), &x)
        .unwrap_err();
    assert!(matches!(e, QuantError::OutOfRange { index: 7, .. }), "{e}");
    assert!(e.to_string().contains("element 7") && !e.to_string().contains('\n'));
    // Just inside the INT8 range: finite and within half a step.
    x[7] = 8.3e6;
    check_bound(&q(8, 32, Axis::PerToken), shape1(32), &x);
    // Affine: a minimum below -65504 (bf16 input near -70,000).
    let mut v = [1.0f32; 32];
    v[3] = -70_000.0;
    let h: Vec<kvforge_quant::bf16> = v
        .iter()
        .map(|&a| kvforge_quant::bf16::from_f32(a))
        .collect();
    for bits in [4, 2] {
        let e = q(bits, 32, Axis::PerToken)
            .quantize_bf16(shape1(32), &h)
            .unwrap_err();
        assert!(matches!(e, QuantError::OutOfRange { index: 3, .. }), "{e}");
    }
    // Affine: a range too wide for the scale (INT2: 65504 * 3).
    let mut w = [0.0f32; 32];
    w[9] = 200_000.0;
    let e = q(2, 32, Axis::PerToken)
        .quantize(shape1(32), &w)
        .unwrap_err();
    assert!(matches!(e, QuantError::OutOfRange { index: 9, .. }), "{e}");
    check_bound(&q(4, 32, Axis::PerToken), shape1(32), &w);
    // Per channel, the element named is the flat index in the input.
    let shape = BlockShape {
        tokens: 32,
        heads: 1,
        head_dim: 2,
    };
    let mut z = [0.0f32; 64];
    z[2 * 5 + 1] = -1e5;
    let e = q(4, 32, Axis::PerChannel).quantize(shape, &z).unwrap_err();
    assert!(matches!(e, QuantError::OutOfRange { index: 11, .. }), "{e}");
}

#[test]
fn the_hadamard_rotation_never_turns_finite_input_into_inf() {
    // Normalized at every stage: 64 values of 1e37 stay finite.
    let mut v = vec![1e37f32; 64];
    hadamard_in_place(&mut v).unwrap();
    assert!(v.iter().all(|x| x.is_finite()));
    assert!((v[0] - 8e37).abs() < 1e32);
    // An f16-range block of -6000 at head dim 128: rotated, one element is
    // -6000 * sqrt(128), past f16: refused, never -inf.
    let shape = BlockShape {
        tokens: 128,
        heads: 1,
        head_dim: 128,
    };
    let x = vec![-6000.0f32; shape.len()];
    for (bits, axis) in [
        (4, Axis::PerToken),
        (4, Axis::PerChannel),
        (2, Axis::PerToken),
    ] {
        let r = Rotated::new(q(bits, 32, axis));
        match r.quantize(shape, &x) {
            Err(QuantError::OutOfRange { .. }) => {}
            Ok(b) => {
                let mut y = vec![0f32; x.len()];
                r.dequantize(&b, &mut y).unwrap();
                assert!(y.iter().all(|v| v.is_finite()), "int{bits} {axis:?}");
            }
            Err(e) => panic!("int{bits} {axis:?}: {e}"),
        }
    }
    // Huge finite input is out of range, not "non-finite".
    let e = Rotated::new(q(4, 32, Axis::PerToken))
        .quantize(shape1(64), &[1e37; 64])
        .unwrap_err();
    assert!(matches!(e, QuantError::OutOfRange { .. }), "{e}");
}

#[test]
fn parameters_are_rounded_so_the_error_stays_within_half_a_step() {
    // An offset channel, 300.1..301.1 (KIVI keys): the f16 minimum is 300.0,
    // so the scale must cover 1.1, not 1.0. Before: max error 0.100.
    let shape = BlockShape {
        tokens: 32,
        heads: 1,
        head_dim: 2,
    };
    let x: Vec<f32> = (0..32)
        .flat_map(|t| {
            let v = 300.1 + t as f32 / 31.0;
            [v, v]
        })
        .collect();
    let quant = q(4, 32, Axis::PerChannel);
    let b = quant.quantize(shape, &x).unwrap();
    let mut y = vec![0f32; x.len()];
    quant.dequantize(&b, &mut y).unwrap();
    let worst = x
        .iter()
        .zip(&y)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let half = b.scales[0].to_f32() / 2.0;
    assert!(
        worst <= half * 1.0001,
        "max error {worst} > half a step {half}"
    );
    assert!(worst < 0.04, "max error {worst}");
    // Tiny groups: amax 1e-4 stays near the nominal 1/254 relative error,
    // and amax 3e-6 no longer rounds its scale to 0 (all codes 0).
    for amax in [1e-4f32, 3e-6] {
        let x: Vec<f32> = (0..32)
            .map(|i| amax * (i as f32 / 31.0 * 2.0 - 1.0))
            .collect();
        let quant = q(8, 32, Axis::PerToken);
        let b = quant.quantize(shape1(32), &x).unwrap();
        assert!(b.scales[0].to_f32() > 0.0);
        let mut y = vec![0f32; 32];
        quant.dequantize(&b, &mut y).unwrap();
        let worst = x
            .iter()
            .zip(&y)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst / amax < 0.011,
            "amax {amax}: relative error {}",
            worst / amax
        );
        check_bound(&quant, shape1(32), &x);
    }
    // Round to nearest: 0.49999997 of a step is code 0, not 1.
    let mut x = [0.0f32; 32];
    x[0] = 127.0; // scale exactly 1
    x[1] = 0.499_999_97;
    let quant = q(8, 32, Axis::PerToken);
    let b = quant.quantize(shape1(32), &x).unwrap();
    assert_eq!(b.scales[0].to_f32(), 1.0);
    let mut y = vec![0f32; 32];
    quant.dequantize(&b, &mut y).unwrap();
    assert_eq!(y[1], 0.0);
}

#[test]
fn inconsistent_blocks_are_errors_not_panics() {
    let shape = BlockShape {
        tokens: 32,
        heads: 1,
        head_dim: 32,
    };
    let x = testing::sample(shape, 5);
    for bits in [8, 4, 2] {
        for axis in [Axis::PerToken, Axis::PerChannel] {
            let quant = q(bits, 32, axis);
            let good = quant.quantize(shape, &x).unwrap();
            let bad_shapes = [
                // 33 tokens with groups of 32 along them (per channel).
                BlockShape {
                    tokens: 33,
                    ..shape
                },
                // One channel: a per-channel INT4 / INT2 row is not a byte.
                BlockShape {
                    heads: 1,
                    head_dim: 1,
                    tokens: 32,
                },
                BlockShape {
                    head_dim: 48,
                    ..shape
                },
            ];
            for bad in bad_shapes {
                let mut b = good.clone();
                b.shape = bad;
                let mut out = vec![0f32; bad.len()];
                let r = quant.dequantize(&b, &mut out);
                assert!(r.is_err(), "int{bits} {axis:?} {bad:?}");
            }
            let mut b = good.clone();
            b.scales[0] = kvforge_quant::f16::NAN;
            let e = quant.dequantize(&b, &mut vec![0f32; x.len()]).unwrap_err();
            assert!(matches!(e, QuantError::Corrupt(_)), "{e}");
            let mut b = good.clone();
            b.packed.push(0);
            assert!(quant.dequantize(&b, &mut vec![0f32; x.len()]).is_err());
        }
    }
    // Size arithmetic is checked: 2^63 + 4 tokens x 2 no longer wraps to 8.
    let huge = BlockShape {
        tokens: (1usize << 63) + 4,
        heads: 2,
        head_dim: 1,
    };
    let e = q(8, 32, Axis::PerToken)
        .quantize(huge, &[0.0; 8])
        .unwrap_err();
    assert!(matches!(e, QuantError::Shape(_)), "{e}");
    assert_eq!(huge.checked_len(), None);
}

#[test]
fn per_channel_groups_contain_outlier_channels() {
    // Keys with one huge channel (KIVI's observation): grouping along tokens
    // keeps it out of the other channels' groups.
    let shape = BlockShape {
        tokens: 64,
        heads: 1,
        head_dim: 64,
    };
    let mut x = testing::sample(shape, 3);
    for t in 0..64 {
        x[t * 64 + 5] *= 100.0;
    }
    let err = |quant: &GroupQuantizer| {
        let b = quant.quantize(shape, &x).unwrap();
        let mut y = vec![0f32; x.len()];
        quant.dequantize(&b, &mut y).unwrap();
        x.iter()
            .zip(&y)
            .enumerate()
            .filter(|(i, _)| i % 64 != 5)
            .map(|(_, (a, b))| (a - b).abs())
            .sum::<f32>()
    };
    let (tok, chan) = (
        err(&q(4, 64, Axis::PerToken)),
        err(&q(4, 64, Axis::PerChannel)),
    );
    assert!(chan * 4.0 < tok, "per-channel {chan} vs per-token {tok}");
}

#[test]
fn hadamard_is_orthogonal_and_self_inverse() {
    let a: Vec<f32> = (0..64)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
        .collect();
    let b: Vec<f32> = (0..64).map(|i| ((i * 13 % 7) as f32 - 3.0) / 2.0).collect();
    let dot = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(x, y)| x * y).sum::<f32>();
    let (mut ha, mut hb) = (a.clone(), b.clone());
    hadamard_in_place(&mut ha).unwrap();
    hadamard_in_place(&mut hb).unwrap();
    assert!(
        (dot(&ha, &hb) - dot(&a, &b)).abs() < 1e-3,
        "scores are unchanged"
    );
    hadamard_in_place(&mut ha).unwrap();
    assert!(ha.iter().zip(&a).all(|(x, y)| (x - y).abs() < 1e-5));
    assert_eq!(
        hadamard_in_place(&mut [0.0; 48]),
        Err(QuantError::Hadamard { head_dim: 48 })
    );
    let r = Rotated::new(q(4, 32, Axis::PerToken));
    let shape = BlockShape {
        tokens: 4,
        heads: 1,
        head_dim: 48,
    };
    assert!(matches!(
        r.quantize(shape, &vec![0.0; 192]),
        Err(QuantError::Hadamard { .. })
    ));
}

#[test]
fn tier_plan_keeps_the_window_hot_in_whole_blocks() {
    let p = TierPlan::new(16, 128).unwrap();
    assert_eq!(p.cold_blocks(100), 0);
    assert_eq!(p.cold_blocks(128 + 15), 0);
    assert_eq!(p.cold_blocks(128 + 16), 1);
    assert_eq!(p.cold_blocks(1000), (1000 - 128) / 16);
    assert_eq!(TierPlan::new(16, 0).unwrap().cold_blocks(33), 2);
    assert_eq!(
        TierPlan::new(16, 100),
        Err(QuantError::Window {
            what: "hot window",
            tokens: 100,
            block_size: 16
        })
    );
    assert_eq!(TierPlan::new(0, 0), Err(QuantError::BlockSize));
    let s = TierPlan::new(16, 32).unwrap().with_sink(32).unwrap();
    assert_eq!(s.cold_blocks(32 + 32 + 15), 0);
    assert_eq!(s.cold_blocks(32 + 32 + 16), 1);
    assert!(!s.is_cold(16, 1000), "in the sink");
    assert!(s.is_cold(32, 80) && !s.is_cold(32, 79));
    let sink = TierPlan::new(16, 32).unwrap().with_sink(8).unwrap_err();
    assert_eq!(
        sink.to_string(),
        "quant: sink of 8 tokens is not a multiple of the block size 16"
    );
}

#[test]
fn tier_plans_pass_the_tier_policy_suite() {
    for (bs, window, sink) in [(4, 8, 0), (4, 0, 4), (1, 3, 2), (16, 32, 16)] {
        let p = TierPlan::new(bs, window).unwrap().with_sink(sink).unwrap();
        kvforge_quant::testing::check_tier_policy(&p, bs as u32);
    }
}

#[test]
fn bad_configurations_are_named_errors() {
    assert_eq!(
        QuantConfig::new(3, 32, Axis::PerToken),
        Err(QuantError::Bits { bits: 3 })
    );
    assert!(matches!(
        QuantConfig::new(8, 0, Axis::PerToken),
        Err(QuantError::GroupSize { .. })
    ));
    assert!(
        matches!(
            QuantConfig::new(2, 2, Axis::PerToken),
            Err(QuantError::GroupSize { .. })
        ),
        "2 x 2 bits is not a byte"
    );
    let shape = BlockShape {
        tokens: 16,
        heads: 1,
        head_dim: 64,
    };
    let e = q(4, 48, Axis::PerToken)
        .quantize(shape, &vec![0.0; 64 * 16])
        .unwrap_err();
    assert_eq!(
        e,
        QuantError::GroupSize {
            group_size: 48,
            axis: "head_dim",
            len: 64
        }
    );
    let e = q(4, 32, Axis::PerChannel)
        .quantize(shape, &vec![0.0; 64 * 16])
        .unwrap_err();
    assert_eq!(
        e,
        QuantError::GroupSize {
            group_size: 32,
            axis: "tokens",
            len: 16
        }
    );
    let empty = BlockShape {
        tokens: 0,
        heads: 1,
        head_dim: 64,
    };
    assert!(matches!(
        q(8, 32, Axis::PerToken).quantize(empty, &[]),
        Err(QuantError::Shape(_))
    ));
    assert_eq!(QuantConfig::parse_bits("INT4"), Ok(4));
    assert_eq!(
        QuantConfig::parse_bits("fp8"),
        Err(QuantError::UnknownFormat("fp8".into()))
    );
    for e in [
        QuantError::Bits { bits: 3 },
        QuantError::UnknownFormat("x".into()),
    ] {
        assert!(!e.to_string().contains('\n'));
    }
    // A block dequantized with another configuration is refused.
    let b = q(4, 32, Axis::PerToken)
        .quantize(shape, &vec![1.0; 64 * 16])
        .unwrap();
    assert!(
        q(8, 32, Axis::PerToken)
            .dequantize(&b, &mut vec![0.0; 64 * 16])
            .is_err()
    );
}

#[test]
fn codes_are_packed_in_bit_planes() {
    // One INT4 group of 16 along head_dim holding 0..15: scale 1, min 0,
    // codes equal the values; byte i holds code i (low) and code i + 8 (high).
    let shape = BlockShape {
        tokens: 1,
        heads: 1,
        head_dim: 16,
    };
    let x: Vec<f32> = (0..16).map(|v| v as f32).collect();
    let b = q(4, 16, Axis::PerToken).quantize(shape, &x).unwrap();
    let want: Vec<u8> = (0..8).map(|i| i | ((i + 8) << 4)).collect();
    assert_eq!(b.packed, want);
    // INT2, 0..3 repeated: byte i holds codes i, i+4, i+8, i+12.
    let shape = BlockShape {
        tokens: 1,
        heads: 1,
        head_dim: 16,
    };
    let x: Vec<f32> = (0..16).map(|v| (v / 4) as f32).collect();
    let b = q(2, 16, Axis::PerToken).quantize(shape, &x).unwrap();
    assert_eq!(b.packed, vec![0b1110_0100; 4]);
    // Per channel: groups run along tokens, but codes are stored token-major,
    // each row packed the same way (channel c low, channel c + C/2 high).
    let shape = BlockShape {
        tokens: 16,
        heads: 1,
        head_dim: 2,
    };
    let x: Vec<f32> = (0..16).flat_map(|t| [t as f32, 15.0 - t as f32]).collect();
    let b = q(4, 16, Axis::PerChannel).quantize(shape, &x).unwrap();
    let want: Vec<u8> = (0..16).map(|t| t | ((15 - t) << 4)).collect();
    assert_eq!(b.packed, want);
    let mut back = vec![0f32; x.len()];
    q(4, 16, Axis::PerChannel)
        .dequantize(&b, &mut back)
        .unwrap();
    assert_eq!(back, x);
}
