//! Unit tests of the module's private parts.
#![allow(clippy::unwrap_used)]

use kvforge_coordinator::{Pack, TieredPool};
use kvforge_pool::BlockId;
use tch::{Device, Kind, Tensor};

use super::PagedKvCache;
use crate::model::LlamaConfig;

/// Lane `layer × kv_heads + head` of each packed block holds that
/// lane's rows of its source block, and nothing else moves.
#[test]
fn packing_copies_each_lane_from_its_own_source() {
    let cfg = LlamaConfig::tiny();
    let bs = 4;
    let c = PagedKvCache::new(&cfg, bs, 8 * bs, Device::Cpu, Kind::Float).unwrap();
    let (layers, h) = (cfg.n_layers, cfg.n_kv_heads);
    for (i, t) in c.k.iter().chain(&c.v).enumerate() {
        let n = t.numel() as i64;
        let fill = Tensor::arange(n, (Kind::Float, Device::Cpu)) + (i as f64) * 1e6;
        t.shallow_clone().copy_(&fill.view(t.size().as_slice()));
    }
    let before: Vec<Tensor> = c.k.iter().chain(&c.v).map(|t| t.copy()).collect();
    // The hot tier is tier 0: a hot slot's global handle is the slot.
    let b = |slot: u32| BlockId::new(slot, 1);
    let lanes = layers * h;
    // Two packed blocks (slots 6, 7) from sources 1, 2, 3 by lane.
    let src: Vec<BlockId> = (0..2 * lanes).map(|x| b(1 + (x % 3) as u32)).collect();
    let pack = Pack {
        lanes,
        dst: vec![b(6), b(7)],
        src: src.clone(),
        in_place: false,
    };
    c.pack(&pack, false).unwrap();
    for (i, t) in c.k.iter().chain(&c.v).enumerate() {
        let layer = i % layers;
        let old = &before[i];
        for slot in 0..8i64 {
            for head in 0..h as i64 {
                let rows =
                    |x: &Tensor, s: i64| x.narrow(0, s * bs as i64, bs as i64).select(1, head);
                let want = if slot >= 6 {
                    let k = (slot - 6) as usize;
                    let from = src[k * lanes + layer * h + head as usize];
                    rows(old, i64::from(TieredPool::slot_of(from)))
                } else {
                    rows(old, slot)
                };
                assert!(
                    rows(t, slot).equal(&want),
                    "tensor {i} slot {slot} head {head}"
                );
            }
        }
    }
    // A pack for another shape is refused.
    let bad = Pack {
        lanes: lanes + 1,
        dst: vec![b(6)],
        src: vec![b(1); lanes + 1],
        in_place: false,
    };
    assert!(c.pack(&bad, false).is_err());
}

/// A step whose in-place pack is prepared and then dropped (the forward
/// failed) leaves every K/V element and the table as they were.
#[test]
fn an_aborted_step_undoes_its_in_place_pack() {
    // Head-wise pages, then token-level rows.
    aborted_step_undoes(true, false);
    aborted_step_undoes(false, true);
}

fn aborted_step_undoes(per_head: bool, per_token: bool) {
    use kvforge_coordinator::{EvictionConfig, Score, Trigger};

    use crate::kv::KvStore;
    let cfg = LlamaConfig::tiny();
    let mut c = PagedKvCache::new(&cfg, 4, 256, Device::Cpu, Kind::Float).unwrap();
    let mut coord = c.base_config();
    coord.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(24),
        sink: 4,
        window: 8,
        per_head,
        per_token,
    });
    c.configure(coord, None).unwrap();
    let mut seq = super::Sequence::default();
    let rand = |n: i64, h: usize| {
        Tensor::randn(
            [n, h as i64, cfg.head_dim as i64],
            (Kind::Float, Device::Cpu),
        )
    };
    let snapshot =
        |c: &PagedKvCache| -> Vec<Tensor> { c.k.iter().chain(&c.v).map(|t| t.copy()).collect() };
    let mut found = false;
    for step in 0..120 {
        let n = if step == 0 { 12 } else { 1 };
        let before = snapshot(&c);
        let table = c.table(&seq).ok();
        let mut view = c.view(&mut seq);
        view.prepare(n).unwrap();
        let moved =
            c.k.iter()
                .chain(&c.v)
                .zip(&before)
                .any(|(t, b)| !t.equal(b));
        if moved {
            drop(view);
            assert!(
                c.k.iter().chain(&c.v).zip(&before).all(|(t, b)| t.equal(b)),
                "step {step}: the pack is undone"
            );
            assert_eq!(
                c.table(&seq).ok(),
                table,
                "step {step}: the table is unchanged"
            );
            found = true;
            // The same step again, carried through this time.
            view = c.view(&mut seq);
            view.prepare(n).unwrap();
        }
        for layer in 0..cfg.n_layers {
            let q = rand(n as i64, cfg.n_heads);
            let (k, v) = (
                rand(n as i64, cfg.n_kv_heads),
                rand(n as i64, cfg.n_kv_heads),
            );
            let _ = view.attend(layer, &q, &k, &v).unwrap();
        }
        view.commit(n).unwrap();
        if found {
            break;
        }
    }
    assert!(found, "no step packed in place");
    let n = c.coordinator().counters();
    assert!(n.packed_blocks > 0 || n.compacted_blocks > 0);
    c.free(&mut seq).unwrap();
}

/// In place, each lane's pages of blocks 1, 2, 3 are permuted among
/// them (lane-dependent rotations); undoing restores every element.
#[test]
fn an_in_place_pack_permutes_lanes_and_undoes_exactly() {
    let cfg = LlamaConfig::tiny();
    let bs = 4;
    let c = PagedKvCache::new(&cfg, bs, 8 * bs, Device::Cpu, Kind::Float).unwrap();
    for t in c.k.iter().chain(&c.v) {
        t.shallow_clone().copy_(&Tensor::randn(
            t.size().as_slice(),
            (Kind::Float, Device::Cpu),
        ));
    }
    let before: Vec<Tensor> = c.k.iter().chain(&c.v).map(|t| t.copy()).collect();
    let (layers, h) = (cfg.n_layers, cfg.n_kv_heads);
    let lanes = layers * h;
    let b = |slot: u32| BlockId::new(slot, 1);
    let blocks = [b(1), b(2), b(3)];
    let src: Vec<BlockId> = (0..3 * lanes)
        .map(|x| blocks[(x / lanes + x % lanes) % 3])
        .collect();
    let pack = Pack {
        lanes,
        dst: blocks.to_vec(),
        src: src.clone(),
        in_place: true,
    };
    c.pack(&pack, false).unwrap();
    let page =
        |t: &Tensor, slot: i64, head: i64| t.narrow(0, slot * bs as i64, bs as i64).select(1, head);
    for (i, t) in c.k.iter().chain(&c.v).enumerate() {
        let layer = i % layers;
        for k in 0..3usize {
            for head in 0..h {
                let from = src[k * lanes + layer * h + head];
                let want = page(&before[i], i64::from(from.index()), head as i64);
                let got = page(t, k as i64 + 1, head as i64);
                assert!(got.equal(&want), "tensor {i} block {k} head {head}");
            }
        }
    }
    c.pack(&pack, true).unwrap();
    for (t, old) in c.k.iter().chain(&c.v).zip(&before) {
        assert!(t.equal(old), "undone exactly");
    }
}

/// Remote payloads are checked finite on arrival, in every hot dtype.
#[test]
fn non_finite_remote_values_are_recognised_in_every_hot_dtype() {
    use super::import::all_finite;
    use kvforge_pool::StorageFormat;
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
    let fine = [0.0f32, -1.5, 65504.0, 1e-7];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for (format, enc) in [
            (StorageFormat::F16, &f16 as &dyn Fn(f32) -> [u8; 2]),
            (StorageFormat::BF16, &bf16),
        ] {
            let ok: Vec<u8> = fine.iter().flat_map(|&v| enc(v)).collect();
            assert!(all_finite(format, &ok), "{format:?}");
            let mut with = ok.clone();
            with.extend(enc(bad));
            assert!(!all_finite(format, &with), "{format:?} {bad}");
        }
        let ok: Vec<u8> = fine.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(all_finite(StorageFormat::F32, &ok));
        let mut with = ok.clone();
        with.extend(bad.to_le_bytes());
        assert!(!all_finite(StorageFormat::F32, &with), "f32 {bad}");
    }
    let int8 = StorageFormat::Int8 { group_size: 32 };
    assert!(!all_finite(int8, &[0, 0]), "not a hot format");
}
