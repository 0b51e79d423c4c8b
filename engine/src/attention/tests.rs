//! Unit tests of the module's private parts.
#![allow(clippy::unwrap_used)]

use kvforge_pool::{BlockId, BlockTable, Slot};
use tch::{Device, Kind, Tensor};

use super::*;

/// Softmax attention of one query row over explicit keys and values
/// (`[keys, d]` each), in f64 on plain vectors.
fn dense(q: &[f64], k: &[Vec<f64>], v: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>) {
    let d = q.len() as f64;
    let s: Vec<f64> = k
        .iter()
        .map(|kk| kk.iter().zip(q).map(|(a, b)| a * b).sum::<f64>() / d.sqrt())
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let w: Vec<f64> = e.iter().map(|x| x / z).collect();
    let out = (0..v[0].len())
        .map(|c| w.iter().zip(v).map(|(wi, vv)| wi * vv[c]).sum())
        .collect();
    (out, w)
}

/// The largest |difference| between `got` and `want`, checked against
/// `bound` and recorded ([`crate::numerics::within`]).
fn close<'a>(
    what: &str,
    got: impl IntoIterator<Item = f64>,
    want: impl IntoIterator<Item = &'a f64>,
    bound: f64,
) -> bool {
    let d = got
        .into_iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    crate::numerics::within(what, d, bound)
}

fn row(t: &Tensor, i: i64) -> Vec<f64> {
    Vec::<f64>::try_from(t.get(i).to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

/// Entries [hot 0..4 | dropped 4..8 | hot 8..12 | hot 12..14 (new)]:
/// two queries at positions 12 and 13 see the live keys at or before
/// their position — the dropped ones never, the keys after the drop at
/// their own positions — and the mass per entry is the softmax weight
/// each entry's keys received, summed over queries (0 when dropped).
#[test]
fn dropped_entries_are_skipped_positions_kept_and_mass_is_per_entry() {
    let (bs, d) = (4i64, 8i64);
    let k = Tensor::randn([16, 1, d], (Kind::Float, Device::Cpu));
    let v = Tensor::randn([16, 1, d], (Kind::Float, Device::Cpu));
    let mut table = BlockTable::new(bs as u32).unwrap();
    // Hot blocks at slots 2, 0, 3 (positions are not slots).
    table.push(Slot::Hot(BlockId::new(2, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(0, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(3, 1)), 2, true).unwrap();
    table.set_slot(1, Slot::Dropped).unwrap();
    let view = StepView::new(&table, 2, bs as usize, None, Device::Cpu).unwrap();
    assert_eq!((view.keys(), view.start()), (10, 12));
    let q = Tensor::randn([2, 1, d], (Kind::Float, Device::Cpu));
    let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
    let kv = KvTensors {
        k: &ks,
        v: &vs,
        cold: None,
    };
    let observe = Observe {
        mass: true,
        ..Observe::default()
    };
    let a = ReferenceBackend.attend(0, &q, &view, &kv, observe).unwrap();
    assert!(a.key_novelty.is_none(), "not asked for");
    // Live slots in position order: block 2, block 0, block 3.
    let slots: Vec<i64> = (8..12).chain(0..4).chain(12..14).collect();
    let mass = a.mass.unwrap();
    let mut want_mass = [0f64; 4];
    for (qi, visible) in [(0i64, 9usize), (1, 10)] {
        let keys: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| row(&k, s)).collect();
        let vals: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| row(&v, s)).collect();
        let (out, w) = dense(&row(&q, qi), &keys, &vals);
        let got = row(&a.out, qi);
        assert!(
            close("output", got.iter().copied(), &out, 1e-4),
            "query {qi}: {got:?} vs {out:?}"
        );
        for (j, wj) in w.iter().enumerate() {
            want_mass[[0, 2, 3][j / 4]] += wj;
        }
    }
    assert_eq!(mass.len(), 4);
    assert_eq!(mass[1], 0.0, "dropped");
    let mass64 = || mass.iter().map(|m| f64::from(*m));
    assert!(
        close("mass", mass64(), &want_mass, 1e-4),
        "{mass:?} vs {want_mass:?}"
    );
    assert!(
        close("mass sum", [mass64().sum::<f64>()], &[2.0], 1e-4),
        "one per query"
    );
}

/// SnapKV's observation: with a window of 2 of the step's 3 queries and
/// per KV head, each entry's mass is the softmax weight the last two
/// queries of each KV head's query heads gave its keys.
#[test]
fn windowed_mass_per_head_counts_only_the_last_queries() {
    let (bs, h, hkv, d) = (4i64, 4i64, 2i64, 8i64);
    let k = Tensor::randn([16, hkv, d], (Kind::Float, Device::Cpu));
    let v = Tensor::randn([16, hkv, d], (Kind::Float, Device::Cpu));
    let mut table = BlockTable::new(bs as u32).unwrap();
    table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(0, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(2, 1)), 3, true).unwrap();
    let view = StepView::new(&table, 3, bs as usize, None, Device::Cpu).unwrap();
    let q = Tensor::randn([3, h, d], (Kind::Float, Device::Cpu));
    let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
    let kv = KvTensors {
        k: &ks,
        v: &vs,
        cold: None,
    };
    let observe = Observe {
        mass: true,
        per_head: true,
        window: 2,
        ..Observe::default()
    };
    let mass = ReferenceBackend
        .attend(0, &q, &view, &kv, observe)
        .unwrap()
        .mass
        .unwrap();
    // Keys in position order: slots 4..8, 0..4, 8..11; queries at
    // positions 8, 9, 10 see 9, 10, 11 keys.
    let slots: Vec<i64> = (4..8).chain(0..4).chain(8..11).collect();
    let mut want = [0f64; 3 * 2];
    for qi in 1..3i64 {
        for head in 0..h {
            let kh = head / (h / hkv);
            let visible = 9 + qi as usize;
            let at = |t: &Tensor, s: i64| row(&t.get(s), kh);
            let keys: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| at(&k, s)).collect();
            let vals: Vec<Vec<f64>> = slots[..visible].iter().map(|&s| at(&v, s)).collect();
            let (_, w) = dense(&row(&q.get(qi), head), &keys, &vals);
            for (j, wj) in w.iter().enumerate() {
                want[(j / 4) * 2 + kh as usize] += wj;
            }
        }
    }
    assert_eq!(mass.len(), 6);
    let mass64 = || mass.iter().map(|m| f64::from(*m));
    assert!(close("mass", mass64(), &want, 1e-4), "{mass:?} vs {want:?}");
    // Two queries × four heads of weight one each.
    assert!(close("mass sum", [mass64().sum::<f64>()], &[8.0], 1e-4));
}

/// Token-level eviction's holes: attention reads only a holed entry's
/// live rows, and the mass per row lands on those rows (0 on holes).
#[test]
fn holes_are_skipped_and_mass_per_token_is_per_row() {
    let (bs, d) = (4i64, 8i64);
    let k = Tensor::randn([12, 1, d], (Kind::Float, Device::Cpu));
    let v = Tensor::randn([12, 1, d], (Kind::Float, Device::Cpu));
    let mut table = BlockTable::new(bs as u32).unwrap();
    table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
    table.punch(0, 0b0110).unwrap();
    table.push(Slot::Hot(BlockId::new(2, 1)), 2, true).unwrap();
    let view = StepView::new(&table, 1, bs as usize, None, Device::Cpu).unwrap();
    assert_eq!((view.keys(), view.start()), (4, 5));
    let q = Tensor::randn([1, 1, d], (Kind::Float, Device::Cpu));
    let (ks, vs) = ([k.shallow_clone()], [v.shallow_clone()]);
    let kv = KvTensors {
        k: &ks,
        v: &vs,
        cold: None,
    };
    let per_token = Observe {
        mass: true,
        per_token: true,
        ..Observe::default()
    };
    // Fused without a signal reads the holed page as two spans; with a
    // per-token signal it falls back to the reference.
    let fused = crate::fused::FusedBackend::default();
    for (backend, observe) in [
        (&ReferenceBackend as &dyn AttentionBackend, per_token),
        (&fused, per_token),
        (&fused, Observe::default()),
    ] {
        let a = backend.attend(0, &q, &view, &kv, observe).unwrap();
        let slots = [4i64, 7, 8, 9];
        let keys: Vec<Vec<f64>> = slots.iter().map(|&s| row(&k, s)).collect();
        let vals: Vec<Vec<f64>> = slots.iter().map(|&s| row(&v, s)).collect();
        let (out, w) = dense(&row(&q, 0), &keys, &vals);
        let got = row(&a.out, 0);
        assert!(
            close(backend.name(), got.iter().copied(), &out, 1e-4),
            "{}: {got:?} vs {out:?}",
            backend.name()
        );
        let Some(mass) = a.mass else {
            continue;
        };
        let want = [w[0], 0.0, 0.0, w[1], w[2], w[3], 0.0, 0.0];
        assert_eq!(mass.len(), 8);
        let got = mass.iter().map(|m| f64::from(*m));
        assert!(close("mass", got, &want, 1e-5), "{mass:?} vs {want:?}");
    }
}

/// KeyDiff's signal: per entry, `1 − cos(key, mean of the live keys)`
/// averaged over its keys and heads; 0 for a dropped entry.
#[test]
fn key_novelty_is_the_distance_from_the_mean_live_key_per_entry() {
    let (bs, h, d) = (4i64, 2i64, 8i64);
    let k = Tensor::randn([16, h, d], (Kind::Float, Device::Cpu));
    let v = Tensor::zeros([16, h, d], (Kind::Float, Device::Cpu));
    let mut table = BlockTable::new(bs as u32).unwrap();
    table.push(Slot::Hot(BlockId::new(2, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(1, 1)), 4, false).unwrap();
    table.push(Slot::Hot(BlockId::new(0, 1)), 3, true).unwrap();
    table.set_slot(1, Slot::Dropped).unwrap();
    let view = StepView::new(&table, 1, bs as usize, None, Device::Cpu).unwrap();
    let (ks, vs) = ([k.shallow_clone()], [v]);
    let kv = KvTensors {
        k: &ks,
        v: &vs,
        cold: None,
    };
    let q = Tensor::randn([1, h, d], (Kind::Float, Device::Cpu));
    let observe = Observe {
        key_novelty: true,
        ..Observe::default()
    };
    let a = ReferenceBackend.attend(0, &q, &view, &kv, observe).unwrap();
    assert!(a.mass.is_none(), "not asked for");
    let got = a.key_novelty.unwrap();
    let per_head = Observe {
        per_head: true,
        ..observe
    };
    let heads = ReferenceBackend
        .attend(0, &q, &view, &kv, per_head)
        .unwrap();
    let got_heads = heads.key_novelty.unwrap();
    let slots: Vec<i64> = (8..12).chain(0..3).collect();
    let key = |s: i64, head: i64| -> Vec<f64> {
        Vec::<f64>::try_from(k.get(s).get(head).to_kind(Kind::Double)).unwrap()
    };
    let cos = |a: &[f64], b: &[f64]| {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let n = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
        dot / (n(a) * n(b))
    };
    let mut want = [0f64; 3];
    let mut want_heads = [0f64; 6];
    for head in 0..h {
        let mean: Vec<f64> = (0..d as usize)
            .map(|c| slots.iter().map(|&s| key(s, head)[c]).sum::<f64>() / slots.len() as f64)
            .collect();
        for (j, &s) in slots.iter().enumerate() {
            let entry = if j < 4 { 0 } else { 2 };
            let len = if j < 4 { 4.0 } else { 3.0 };
            let x = (1.0 - cos(&key(s, head), &mean)) / len;
            want[entry] += x / h as f64;
            want_heads[entry * h as usize + head as usize] += x;
        }
    }
    assert_eq!(got_heads.len(), 6, "per entry and head");
    let heads = got_heads.iter().map(|g| f64::from(*g));
    assert!(
        close("novelty per head", heads, &want_heads, 1e-4),
        "{got_heads:?} vs {want_heads:?}"
    );
    assert_eq!(got.len(), 3);
    assert_eq!(got[1], 0.0, "dropped");
    let entries = got.iter().map(|g| f64::from(*g));
    assert!(
        close("novelty", entries, &want, 1e-4),
        "{got:?} vs {want:?}"
    );
}
