//! The [`EvictionPolicy`] conformance suite: run it against every
//! implementation.

use kvforge_pool::{BlockId, BlockTable, Slot};

use crate::{EvictionPolicy, Pressure};

/// Tables of every kind of entry (hot, cold, alias, dropped, sealed
/// partial, open) and length, under low and high pressure, with attention
/// mass fed first when the policy wants it. Panics on the first violation
/// of the [`EvictionPolicy`] contract.
pub fn check_policy<P: EvictionPolicy + ?Sized>(p: &mut P, block_size: u32) {
    let bs = block_size;
    for n in 0..48u32 {
        for used in [0.1, 0.95] {
            let seq = u64::from(n);
            let mut t = table(n, bs);
            if p.wants_attention() {
                let mass: Vec<f32> = t
                    .entries()
                    .iter()
                    .enumerate()
                    .map(|(i, e)| {
                        if e.slot().is_live() {
                            1.0 / (1 + i) as f32
                        } else {
                            0.0
                        }
                    })
                    .collect();
                p.observe(seq, &t, &mass);
            }
            let pressure = pressure(used);
            let mut out = Vec::new();
            p.victims(seq, &t, pressure, &mut out);
            check_victims(&t, &out);
            for &i in &out {
                t.set_slot(i, Slot::Dropped)
                    .expect("a victim can be dropped");
            }
            let mut again = Vec::new();
            p.victims(seq, &t, pressure, &mut again);
            check_victims(&t, &again);
            assert!(
                again.iter().all(|i| !out.contains(i)),
                "{}: named twice: {again:?}",
                p.name()
            );
            p.forget(seq);
        }
    }
}

/// The per-lane contract ([`EvictionPolicy::lane_victims`]) on the same
/// tables, with `lanes` lanes and a different key novelty or attention
/// mass (what the policy wants) per lane fed first: every lane names the same number of entries, ascending, each a
/// full, closed, live hot block that does not hold the newest position;
/// after the pack the coordinator would do (the first entries of the
/// union keep packed blocks, the rest are dropped), asking again keeps the
/// contract. Panics on the first violation.
pub fn check_lane_policy<P: EvictionPolicy + ?Sized>(p: &mut P, block_size: u32, lanes: usize) {
    assert!(p.per_lane(), "{}: not a per-lane policy", p.name());
    let bs = block_size;
    for n in 0..48u32 {
        for used in [0.1, 0.95] {
            let seq = u64::from(n);
            let mut t = table(n, bs);
            let pressure = pressure(used);
            for round in 0..2 {
                feed(p, seq, &t, lanes, round);
                let mut out = Vec::new();
                p.lane_victims(seq, &t, pressure, lanes, &mut out);
                assert_eq!(out.len() % lanes, 0, "{}: {out:?}", p.name());
                let d = out.len() / lanes;
                let mut union: Vec<usize> = Vec::new();
                for lane in out.chunks(d.max(1)) {
                    check_victims(&t, lane);
                    for &i in lane {
                        let e = t.entries()[i];
                        assert!(
                            matches!(e.slot(), Slot::Hot(_)) && e.tokens() == bs,
                            "{}: entry {i} is not a full hot block: {e:?}",
                            p.name()
                        );
                    }
                    union.extend_from_slice(lane);
                }
                union.sort_unstable();
                union.dedup();
                let keep = union.len() - d;
                for (k, &i) in union.iter().enumerate() {
                    if k < keep {
                        t.repack(i, BlockId::new(5000 + i as u32, 1))
                            .expect("a lane victim can be packed");
                    } else {
                        t.set_slot(i, Slot::Dropped).expect("and dropped");
                    }
                }
                t.check().expect("the table stays valid");
            }
            p.forget(seq);
        }
    }
}

/// The token-level contract ([`EvictionPolicy::token_victims`]) on the
/// same tables (some with holes already), with a different signal per row
/// fed first (key novelty or attention mass, what the policy wants): the
/// pairs ascend, each names a live row — not a hole — of a full, closed
/// hot block that does not hold the newest position; after the coordinator
/// would mark them (an entry left with no live row dropped), the table
/// stays valid and asking again names none of them. Panics on the first
/// violation.
pub fn check_token_policy<P: EvictionPolicy + ?Sized>(p: &mut P, block_size: u32) {
    assert!(p.token_level(), "{}: not a token-level policy", p.name());
    let bs = block_size;
    for n in 0..48u32 {
        for used in [0.1, 0.95] {
            let seq = u64::from(n);
            let mut t = table(n, bs);
            // A hole already in every third full hot entry.
            for i in (0..t.entries().len()).step_by(3) {
                let _ = t.punch(i, 1);
            }
            let pressure = pressure(used);
            for round in 0..2 {
                feed(p, seq, &t, bs as usize, round);
                let mut out = Vec::new();
                p.token_victims(seq, &t, pressure, &mut out);
                assert!(
                    out.windows(2).all(|w| w[0] < w[1]),
                    "{}: ascending: {out:?}",
                    p.name()
                );
                let entries: Vec<usize> = out.iter().map(|v| v.0).collect();
                let mut named = entries.clone();
                named.dedup();
                check_victims(&t, &named);
                for &(i, r) in &out {
                    let e = t.entries()[i];
                    assert!(
                        matches!(e.slot(), Slot::Hot(_)) && e.tokens() == bs && r < bs,
                        "{}: ({i}, {r}) is not a row of a full hot block: {e:?}",
                        p.name()
                    );
                    assert_eq!(e.holes() >> r & 1, 0, "{}: ({i}, {r}) is a hole", p.name());
                }
                for i in named {
                    let rows = out
                        .iter()
                        .filter(|v| v.0 == i)
                        .fold(0u64, |m, v| m | 1 << v.1);
                    let e = t.entries()[i];
                    if rows.count_ones() == e.live() {
                        t.set_slot(i, Slot::Dropped)
                            .expect("a holed-out entry drops");
                    } else {
                        t.punch(i, rows).expect("named rows can be marked");
                    }
                }
                t.check().expect("the table stays valid");
            }
            p.forget(seq);
        }
    }
}

/// Feeds `per` different values per entry of `t` (per lane or per row),
/// as key novelty and as attention mass, whichever the policy wants.
fn feed<P: EvictionPolicy + ?Sized>(p: &mut P, seq: u64, t: &BlockTable, per: usize, round: usize) {
    let signal: Vec<f32> = (0..t.entries().len() * per)
        .map(|x| ((x * 7919 + round) % 101) as f32 / 101.0)
        .collect();
    if p.wants_keys() {
        p.observe_keys(seq, t, &signal);
    }
    if p.wants_attention() {
        p.observe(seq, t, &signal);
    }
}

/// The suite's pressure: `used` of a 64 KiB budget, one new token.
fn pressure(used: f64) -> Pressure {
    Pressure {
        used,
        new_tokens: 1,
        budget_bytes: 64 * 1024,
        hot_block_bytes: 1024,
        cold_block_bytes: 256,
    }
}

fn check_victims(t: &BlockTable, out: &[usize]) {
    assert!(out.windows(2).all(|w| w[0] < w[1]), "ascending: {out:?}");
    let last = t.entries().len().wrapping_sub(1);
    let newest = t.positions().saturating_sub(1);
    for &i in out {
        let e = t.entries().get(i).copied().expect("victim exists");
        assert!(e.slot().is_live(), "entry {i} is already dropped");
        assert!(!(t.is_open() && i == last), "entry {i} is the open one");
        assert!(
            !(e.first() <= newest && newest < e.end()),
            "entry {i} holds the newest position"
        );
    }
}

fn table(n: u32, bs: u32) -> BlockTable {
    let mut t = BlockTable::new(bs).expect("block size");
    for i in 0..n {
        let b = BlockId::new(i, 1);
        let (slot, tokens) = match i % 9 {
            2 => (Slot::Cold(b), bs),
            4 => (Slot::Alias { canonical: b }, bs),
            5 => (Slot::Hot(b), (bs / 2).max(1)),
            7 => (Slot::Dropped, bs),
            _ => (Slot::Hot(b), bs),
        };
        t.push(slot, tokens, false).expect("push");
    }
    if n % 2 == 1 && bs > 1 {
        t.push(Slot::Hot(BlockId::new(999, 1)), 1, true)
            .expect("open entry");
    }
    t
}
