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
        let vals: Vec<f64> = idx.iter().map(|&i| f64::from(x[i])).collect();
        let (mn, mx) = vals
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, c), &v| {
                (a.min(v), c.max(v))
            });
        let bound = if cfg.symmetric() {
            let amax = mn.abs().max(mx.abs());
            s / 2.0 + (amax - 127.0 * s).abs()
        } else {
            let m = f64::from(b.mins[k].to_f32());
            let levels = f64::from((1u32 << cfg.bits()) - 1);
            s / 2.0 + (m - mn).abs() + (mx - (m + levels * s)).max(0.0)
        };
        for &i in idx {
            let err = (f64::from(x[i]) - f64::from(y[i])).abs();
            assert!(
                err <= bound * (1.0 + 1e-5) + 1e-6,
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
            window: 100,
            block_size: 16
        })
    );
    assert!(TierPlan::new(0, 0).is_err());
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
