//! `kvforge-lsh`: the conformance suite on every deduplicator, exact and
//! near-duplicate sharing, and bad input.
#![allow(clippy::unwrap_used)]

use kvforge_lsh::{
    Content, Deduplicator, ExactDedup, ShareError, SimHashConfig, SimHashDedup, cosine, testing,
};
use kvforge_pool::BlockId;

fn bytes(b: &[u8]) -> Content {
    Content {
        bytes: b.to_vec(),
        vector: Vec::new(),
    }
}

fn vector(v: Vec<f32>) -> Content {
    Content {
        bytes: Vec::new(),
        vector: v,
    }
}

/// A deterministic pseudo-random vector.
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn block(i: u32) -> BlockId {
    BlockId::new(i, 1)
}

#[test]
fn every_deduplicator_passes_the_conformance_suite() {
    testing::check_deduplicator(&mut ExactDedup::new());
    for threshold in [0.9, 0.95, 0.99, 1.0] {
        for (bits, tables) in [(1, 1), (16, 4), (64, 2)] {
            let cfg = SimHashConfig {
                threshold,
                bits,
                tables,
                seed: 3,
            };
            testing::check_deduplicator(&mut SimHashDedup::new(cfg).unwrap());
        }
    }
}

#[test]
fn exact_dedup_shares_identical_bytes_only() {
    let mut d = ExactDedup::new();
    let stored = |b: &[u8]| {
        let c = bytes(b);
        move |_| Some(c.clone())
    };
    assert_eq!(
        d.offer(block(1), &bytes(&[1, 2, 3]), &mut |_| None),
        Ok(None)
    );
    assert_eq!(
        d.offer(block(2), &bytes(&[1, 2, 4]), &mut stored(&[1, 2, 3])),
        Ok(None),
        "other bytes"
    );
    assert_eq!(
        d.offer(block(3), &bytes(&[1, 2, 3]), &mut stored(&[1, 2, 3])),
        Ok(Some(block(1)))
    );
    d.forget(block(1));
    assert_eq!(
        d.offer(block(3), &bytes(&[1, 2, 3]), &mut stored(&[1, 2, 3])),
        Ok(None),
        "block 1 is gone"
    );
    let s = d.stats();
    assert_eq!((s.offered, s.shared, s.canonical), (4, 1, 2));
}

#[test]
fn simhash_shares_near_duplicates_and_verifies_every_candidate() {
    let mut d = SimHashDedup::new(SimHashConfig {
        threshold: 0.95,
        ..SimHashConfig::default()
    })
    .unwrap();
    let base = noise(1, 4096);
    let near: Vec<f32> = base
        .iter()
        .zip(noise(2, 4096))
        .map(|(a, n)| a + 0.1 * n)
        .collect();
    let far = noise(3, 4096);
    assert!(cosine(&base, &near) > 0.99);
    assert!(cosine(&base, &far).abs() < 0.1);
    let mut store = std::collections::BTreeMap::new();
    store.insert(block(1), vector(base.clone()));
    let mut fetch = |b: BlockId| store.get(&b).cloned();
    assert_eq!(
        d.offer(block(1), &vector(base.clone()), &mut fetch),
        Ok(None)
    );
    assert_eq!(
        d.offer(block(2), &vector(near), &mut fetch),
        Ok(Some(block(1)))
    );
    assert_eq!(d.offer(block(3), &vector(far), &mut fetch), Ok(None));
    // A scaled copy has cosine 1: shared even at threshold 1.
    let mut exact = SimHashDedup::new(SimHashConfig {
        threshold: 1.0,
        ..SimHashConfig::default()
    })
    .unwrap();
    let scaled: Vec<f32> = base.iter().map(|x| x * 0.5).collect();
    assert_eq!(
        exact.offer(block(1), &vector(base.clone()), &mut fetch),
        Ok(None)
    );
    assert_eq!(
        exact.offer(block(4), &vector(scaled), &mut fetch),
        Ok(Some(block(1)))
    );
}

#[test]
fn a_hash_collision_alone_never_shares() {
    // One hyperplane: about half of all vectors collide; none is within
    // cosine 0.99 of another.
    let mut d = SimHashDedup::new(SimHashConfig {
        threshold: 0.99,
        bits: 1,
        tables: 1,
        seed: 9,
    })
    .unwrap();
    let mut store = std::collections::BTreeMap::new();
    for i in 0..64u32 {
        let c = vector(noise(u64::from(i) + 100, 256));
        let got = d
            .offer(block(i), &c, &mut |b| store.get(&b).cloned())
            .unwrap();
        assert_eq!(got, None, "offer {i} shared on a collision");
        store.insert(block(i), c);
    }
    let s = d.stats();
    assert!(s.rejected > 500, "collisions were checked: {s:?}");
    assert_eq!(s.shared, 0);
}

#[test]
fn bad_configurations_and_vectors_are_clear_errors_that_change_nothing() {
    let cfg = SimHashConfig::default();
    for (bad, needle) in [
        (
            SimHashConfig {
                threshold: 0.0,
                ..cfg
            },
            "outside (0, 1]",
        ),
        (
            SimHashConfig {
                threshold: 1.5,
                ..cfg
            },
            "outside (0, 1]",
        ),
        (
            SimHashConfig {
                threshold: f32::NAN,
                ..cfg
            },
            "outside (0, 1]",
        ),
        (SimHashConfig { bits: 0, ..cfg }, "zero hyperplanes"),
        (SimHashConfig { tables: 0, ..cfg }, "zero hyperplanes"),
        (SimHashConfig { bits: 65, ..cfg }, "at most 64"),
    ] {
        let e = SimHashDedup::new(bad).err().unwrap();
        assert!(matches!(e, ShareError::Config(_)));
        let msg = e.to_string();
        assert!(msg.contains(needle), "{msg}");
        assert!(!msg.contains('\n'));
    }
    let mut d = SimHashDedup::new(cfg).unwrap();
    let mut none = |_| None;
    let mut v = noise(5, 128);
    v[17] = f32::NAN;
    let e = d.offer(block(1), &vector(v), &mut none).unwrap_err();
    assert!(e.to_string().contains("element 17"), "{e}");
    assert_eq!(d.stats().offered, 0, "nothing counted");
    assert_eq!(
        d.offer(block(1), &vector(noise(5, 128)), &mut none),
        Ok(None)
    );
    let e = d
        .offer(block(2), &vector(noise(5, 64)), &mut none)
        .unwrap_err();
    assert!(e.to_string().contains("64 elements"), "{e}");
    assert_eq!(d.stats().canonical, 1);
}
