//! The coordinator's invariants, checked on its whole state (run by
//! [`testing::check_invariants`](crate::testing::check_invariants) and by
//! [`Coordinator::check_every_call`]).

use std::collections::HashMap;

use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot, TieredPool};

use super::{COLD, Coordinator, HOT, SeqId};

impl Coordinator {
    /// The first invariant broken, if any (see
    /// [`testing::check_invariants`](crate::testing::check_invariants)).
    pub(crate) fn invariants(&self) -> Result<(), String> {
        check_invariants(self)
    }
}

/// Checks every invariant of `c`, returning the first one broken:
///
/// * every table (committed, planned, turn snapshot) tiles its positions,
///   its slots name blocks of the right tier (hot in the hot tier, cold
///   and alias targets in the cold one);
/// * a block a step in flight writes, from row `r` on, is listed by no
///   other table (another sequence's, a turn snapshot, another step's)
///   with more than `r` tokens, and the index holds no more than `r` of
///   its tokens;
/// * every listed block holds exactly the references its listings account
///   for (committed tables, turn snapshots, the references steps in flight
///   took); each tier's blocks in use are exactly the blocks listed;
/// * every block of a planned table is held by the committed table or
///   taken by the step;
/// * bytes in use stay within the budget while no step is in flight;
/// * no cold block reported freed is held, and its slot holds no block
///   (of any epoch) that is listed or cached; the demotion map maps hot
///   blocks to cold ones.
fn check_invariants(c: &Coordinator) -> Result<(), String> {
    let mut listed: HashMap<BlockId, u32> = HashMap::new();
    let count = |listed: &mut HashMap<BlockId, u32>, t: &BlockTable| {
        for b in t.held() {
            *listed.entry(b).or_default() += 1;
        }
    };
    let mut in_flight = false;
    for (&id, s) in &c.seqs {
        table(id, "committed", &s.table)?;
        count(&mut listed, &s.table);
        if let Some(t) = &s.turn {
            table(id, "turn snapshot", &t.table)?;
            count(&mut listed, &t.table);
        }
        if let Some(p) = &s.pending {
            in_flight = true;
            table(id, "planned", &p.next)?;
            for &b in &p.taken {
                *listed.entry(b).or_default() += 1;
            }
            for b in p.next.held() {
                if !s.table.held().any(|x| x == b) && !p.taken.contains(&b) {
                    return Err(format!(
                        "seq {id}: the planned table lists {b:?}, neither held nor taken"
                    ));
                }
            }
        }
    }
    for (&id, s) in &c.seqs {
        if let Some(p) = &s.pending {
            writes(c, id, &p.written)?;
        }
    }
    for (&b, &n) in &listed {
        let rc = c.tiers.ref_count(b);
        if rc != Ok(n) {
            return Err(format!(
                "{b:?}: {n} references accounted for, the pool says {rc:?}"
            ));
        }
    }
    for t in 0..c.tiers.tiers() {
        let stats = c.tiers.tier_stats(t).map_err(|e| e.to_string())?;
        let held = listed
            .keys()
            .filter(|&&b| TieredPool::tier_of(b) == t)
            .count();
        if stats.in_use != held {
            return Err(format!(
                "tier {t}: {} blocks in use, {held} listed (a leak)",
                stats.in_use
            ));
        }
    }
    if !in_flight && c.tiers.in_use_bytes() > c.budget {
        return Err(format!(
            "{} bytes in use between steps, over the budget of {}",
            c.tiers.in_use_bytes(),
            c.budget
        ));
    }
    // The engine frees a reported block's content by slot: a report must
    // name no slot that is listed or cached since (at any epoch), or the
    // content of a live block goes.
    let slot = TieredPool::slot_of;
    for &b in &c.freed_cold {
        if c.tiers.ref_count(b).is_ok_and(|n| n > 0) {
            return Err(format!("{b:?} was reported freed and is held"));
        }
        let live = listed
            .keys()
            .chain(c.cached.keys())
            .find(|l| TieredPool::tier_of(**l) == TieredPool::tier_of(b) && slot(**l) == slot(b));
        if let Some(l) = live {
            return Err(format!(
                "{b:?} was reported freed, and its slot holds {l:?}, which is listed or cached"
            ));
        }
    }
    for (&h, &k) in &c.demoted {
        if TieredPool::tier_of(h) != HOT || TieredPool::tier_of(k) != COLD {
            return Err(format!("the demotion map maps {h:?} to {k:?}"));
        }
    }
    Ok(())
}

/// One table: its own invariants and the tiers of its slots.
fn table(id: SeqId, what: &str, t: &BlockTable) -> Result<(), String> {
    t.check()
        .map_err(|e| format!("seq {id}, {what} table: {e}"))?;
    for (i, e) in t.entries().iter().enumerate() {
        let tier_ok = match e.slot() {
            Slot::Hot(b) => TieredPool::tier_of(b) == HOT,
            Slot::Cold(b) | Slot::Alias { canonical: b } => TieredPool::tier_of(b) == COLD,
            Slot::Dropped => true,
        };
        if !tier_ok {
            return Err(format!(
                "seq {id}, {what} table: entry {i} {:?} is in another tier",
                e.slot()
            ));
        }
    }
    Ok(())
}

/// No one but the writer reads the rows a step of `writer` writes.
fn writes(c: &Coordinator, writer: SeqId, written: &[(BlockId, u32)]) -> Result<(), String> {
    let reads = |t: &BlockTable, b: BlockId| {
        t.entries()
            .iter()
            .filter(|e| e.slot().block() == Some(b))
            .map(|e| {
                if e.is_packed() {
                    t.block_size()
                } else {
                    e.tokens()
                }
            })
            .max()
    };
    for &(b, from) in written {
        for (&id, s) in &c.seqs {
            let mut tables: Vec<(&str, &BlockTable)> = Vec::new();
            if let Some(t) = &s.turn {
                tables.push(("turn snapshot", &t.table));
            }
            if id != writer {
                tables.push(("table", &s.table));
                if let Some(p) = &s.pending {
                    tables.push(("planned table", &p.next));
                }
            }
            for (what, t) in tables {
                if let Some(n) = reads(t, b).filter(|&n| n > from) {
                    return Err(format!(
                        "seq {writer} writes {b:?} from row {from}; seq {id}'s {what} reads {n} rows of it"
                    ));
                }
            }
        }
        if let Some(&n) = c.cached.get(&b).filter(|&&n| n > from) {
            return Err(format!(
                "seq {writer} writes {b:?} from row {from}; the index may hand out {n} rows of it"
            ));
        }
    }
    Ok(())
}
