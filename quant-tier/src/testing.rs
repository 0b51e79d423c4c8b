//! The conformance suite every [`Quantizer`] must pass.
//!
//! ```
//! use kvforge_quant::{testing, Axis, GroupQuantizer, QuantConfig, Rotated};
//! let q = GroupQuantizer::new(QuantConfig::new(4, 32, Axis::PerToken).unwrap());
//! testing::check_quantizer(&q);
//! testing::check_quantizer(&Rotated::new(q));
//! ```

use crate::error::QuantError;
use crate::{BlockShape, Quantizer};

/// A deterministic pseudo-random slab with a few outlier channels.
pub fn sample(shape: BlockShape, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..shape.len())
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
            let outlier = if i % shape.head_dim == 3 { 8.0 } else { 1.0 };
            u * 4.0 * outlier
        })
        .collect()
}

/// Runs the checks: round trip within the format's bound, byte count,
/// NaN/inf rejection, out-of-range values refused or finite, shape errors,
/// `dequantize_uninit`, and f16 input.
pub fn check_quantizer<Q: Quantizer + ?Sized>(q: &Q) {
    let cfg = q.config();
    let g = cfg.group_size();
    let shape = BlockShape {
        tokens: g.max(4),
        heads: 2,
        head_dim: g.max(8).next_power_of_two(),
    };
    let x = sample(shape, 7);
    let b = q.quantize(shape, &x).expect("quantize a valid block");
    let mut y = vec![0f32; x.len()];
    q.dequantize(&b, &mut y).expect("dequantize");
    let range = x.iter().fold(0f32, |m, v| m.max(v.abs())) * 2.0;
    // A loose, format-level bound; the property tests check the exact one.
    let levels = ((1u32 << cfg.bits()) - 1) as f32;
    let bound = range / levels * 1.01 + 1e-3;
    let worst = x
        .iter()
        .zip(&y)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= bound, "{}: max error {worst} > {bound}", q.name());
    let groups = shape.len() / g;
    let params = if cfg.symmetric() {
        2 * groups
    } else {
        4 * groups
    };
    assert_eq!(
        b.bytes(),
        shape.len() * cfg.bits() as usize / 8 + params,
        "{}",
        q.name()
    );
    // Bad input is reported, not quantized.
    let mut bad = x.clone();
    bad[5] = f32::NAN;
    assert!(matches!(
        q.quantize(shape, &bad),
        Err(QuantError::NonFinite { index: 5, .. })
    ));
    bad[5] = f32::INFINITY;
    assert!(matches!(
        q.quantize(shape, &bad),
        Err(QuantError::NonFinite { index: 5, .. })
    ));
    assert!(matches!(
        q.quantize(shape, &x[1..]),
        Err(QuantError::Shape(_))
    ));
    assert!(matches!(
        q.dequantize(&b, &mut y[1..]),
        Err(QuantError::Shape(_))
    ));
    let mut cut = b.clone();
    cut.packed.pop();
    assert!(
        q.dequantize(&cut, &mut y).is_err(),
        "a truncated block is an error"
    );
    // A finite value past what the format can hold is refused, or comes
    // back finite: never inf or NaN.
    let mut big = x.clone();
    big[3] = 1e7;
    match q.quantize(shape, &big) {
        Err(QuantError::OutOfRange { .. }) => {}
        Err(e) => panic!("{}: out-of-range input gave {e}", q.name()),
        Ok(b) => {
            q.dequantize(&b, &mut y).expect("dequantize");
            assert!(y.iter().all(|v| v.is_finite()), "{}: inf/NaN out", q.name());
        }
    }
    // `dequantize_uninit` writes every element and agrees with `dequantize`.
    let b = q.quantize(shape, &x).expect("quantize a valid block");
    q.dequantize(&b, &mut y).expect("dequantize");
    let mut raw = vec![std::mem::MaybeUninit::new(f32::NAN); x.len()];
    let z = q
        .dequantize_uninit(&b, &mut raw)
        .expect("dequantize_uninit");
    assert_eq!(z, &y[..], "{}", q.name());
    // f16 input quantizes like its f32 widening.
    let h: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let w: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
    assert_eq!(
        q.quantize_f16(shape, &h).expect("f16"),
        q.quantize(shape, &w).expect("f32")
    );
}

/// The [`TierPolicy`](crate::plan::TierPolicy) contract on tables of every kind
/// of entry (hot full, holed, sealed partial, open, cold, dropped) and
/// length: demoted indexes ascend, exist, name hot full entries without
/// holes other than the open one; and once they are demoted, asking again
/// names none of them.
/// Panics on the first violation.
pub fn check_tier_policy<P: crate::plan::TierPolicy + ?Sized>(p: &P, block_size: u32) {
    use kvforge_pool::{BlockId, BlockTable, Slot};
    let bs = block_size;
    for n in 0..40u32 {
        let mut t = BlockTable::new(bs).expect("block size");
        for i in 0..n {
            let b = BlockId::new(i, 1);
            let (slot, tokens, open) = match i % 7 {
                3 => (Slot::Hot(b), (bs / 2).max(1), false),
                5 => (Slot::Cold(b), bs, false),
                6 if i > 20 => (Slot::Dropped, bs, false),
                _ => (Slot::Hot(b), bs, false),
            };
            t.push(slot, tokens, open).expect("push");
            // Token-level eviction marked a row of some full hot blocks.
            let full_hot = matches!(slot, Slot::Hot(_)) && tokens == bs;
            if full_hot && i % 3 == 1 && (2..=kvforge_pool::MAX_HOLED_BLOCK).contains(&bs) {
                t.punch(i as usize, 1)
                    .expect("a full hot block takes a hole");
            }
        }
        if n % 2 == 1 && bs > 1 {
            t.push(Slot::Hot(BlockId::new(999, 1)), 1, true)
                .expect("open entry");
        }
        let mut out = Vec::new();
        p.demote(&t, &mut out);
        assert!(out.windows(2).all(|w| w[0] < w[1]), "ascending: {out:?}");
        let last = t.entries().len().wrapping_sub(1);
        for &i in &out {
            let e = t.entries()[i];
            assert!(matches!(e.slot(), Slot::Hot(_)), "entry {i} is not hot");
            assert_eq!(e.tokens(), bs, "entry {i} is not full");
            assert_eq!(e.holes(), 0, "entry {i} has holes");
            assert!(!(t.is_open() && i == last), "the open entry");
        }
        for &i in &out {
            t.set_slot(i, Slot::Cold(BlockId::new(1000 + i as u32, 1)))
                .expect("demotable");
        }
        let mut again = Vec::new();
        p.demote(&t, &mut again);
        assert!(
            again.iter().all(|i| !out.contains(i)),
            "demoted twice: {again:?}"
        );
    }
}
