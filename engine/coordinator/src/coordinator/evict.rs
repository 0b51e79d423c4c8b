//! Eviction: the policy's victims among the stepping sequence's entries,
//! and among idle sequences when a step does not fit the budget.

use std::collections::HashMap;

use kvforge_evict::{EvictionPolicy, Pressure};
use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot, TieredPool};

use crate::error::{CoordError, Result};

use super::draft::{Draft, IdleCuts};
use super::{Coordinator, HOT, SeqId};

/// Marks the policy's `victims` of `table` dropped and adds their blocks
/// to `release`; an entry the table cannot drop is the policy's error.
pub(super) fn drop_victims(
    table: &mut BlockTable,
    victims: &[usize],
    release: &mut Vec<BlockId>,
) -> Result<()> {
    for &i in victims {
        let old = table
            .set_slot(i, Slot::Dropped)
            .map_err(|e| CoordError::Policy(format!("the eviction policy named entry {i}: {e}")))?;
        release.extend(old.block());
    }
    Ok(())
}

/// A policy that could not answer ([`EvictionPolicy::take_error`]) fails
/// the step with its words, before anything it named is applied.
fn answered(ev: &mut dyn EvictionPolicy) -> Result<()> {
    match ev.take_error() {
        Some(why) => Err(policy_failed(ev, &why)),
        None => Ok(()),
    }
}

fn policy_failed(ev: &dyn EvictionPolicy, why: &str) -> CoordError {
    CoordError::Policy(format!("the eviction policy {} failed: {why}", ev.name()))
}

/// Marks the token-level policy's `victims` (`(entry, row)`, ascending)
/// invalid in `table`: an entry left with no live row is dropped (its
/// block added to `release`, its index to `drops`). Anything the table
/// refuses is the policy's error. Returns the rows evicted.
pub(super) fn punch_victims(
    table: &mut BlockTable,
    victims: &[(usize, u32)],
    release: &mut Vec<BlockId>,
    drops: &mut Vec<usize>,
) -> Result<usize> {
    let bad = |m: String| CoordError::Policy(format!("the eviction policy {m}"));
    if !victims.windows(2).all(|w| w[0] < w[1]) {
        return Err(bad(format!("named rows out of order: {victims:?}")));
    }
    let bs = table.block_size();
    for run in victims.chunk_by(|a, b| a.0 == b.0) {
        let i = run[0].0;
        if let Some(&(_, r)) = run.iter().find(|v| v.1 >= bs.min(64)) {
            return Err(bad(format!("named row {r} of entry {i}, blocks of {bs}")));
        }
        let rows = run.iter().fold(0u64, |m, v| m | 1 << v.1);
        let dropped = table
            .punch_or_drop(i, rows)
            .map_err(|e| bad(format!("named rows of entry {i}: {e}")))?;
        if let Some(old) = dropped {
            release.extend(old.block());
            drops.push(i);
        }
    }
    Ok(victims.len())
}

impl Coordinator {
    /// The eviction policy's victims among the stepping sequence's own
    /// entries, applied to the planned table (their blocks to release,
    /// the dropped entries to the plan). A per-lane policy's answer waits
    /// for `pack`.
    pub(super) fn evict_own(&mut self, d: &mut Draft) -> Result<()> {
        let pressure = self.pressure(self.tiers.in_use_bytes(), d.n);
        let Some(ev) = self.evict.as_mut() else {
            return Ok(());
        };
        // What the policy could not answer about this sequence while it
        // was idle fails this step (once), as its own answer would.
        if let Some(why) = self
            .seqs
            .get_mut(&d.seq)
            .and_then(|s| s.policy_error.take())
        {
            return Err(policy_failed(ev.as_ref(), &why));
        }
        if ev.per_lane() {
            ev.lane_victims(d.seq, &d.next, pressure, self.lanes, &mut d.lane_drops);
            return answered(ev.as_mut());
        }
        if ev.token_level() {
            let mut rows = Vec::new();
            ev.token_victims(d.seq, &d.next, pressure, &mut rows);
            answered(ev.as_mut())?;
            d.punched = punch_victims(&mut d.next, &rows, &mut d.release, &mut d.plan.drops)?;
            return Ok(());
        }
        let mut victims = Vec::new();
        ev.victims(d.seq, &d.next, pressure, &mut victims);
        answered(ev.as_mut())?;
        drop_victims(&mut d.next, &victims, &mut d.release)?;
        d.plan.drops.extend_from_slice(&victims);
        Ok(())
    }

    /// What a policy is told when `in_use` bytes are (or would be) in use
    /// and `new_tokens` are coming.
    pub(super) fn pressure(&self, in_use: u64, new_tokens: usize) -> Pressure {
        Pressure {
            used: in_use as f64 / self.budget as f64,
            new_tokens,
            budget_bytes: self.budget,
            hot_block_bytes: self.cfg.layout.block_bytes(),
            cold_block_bytes: self.cold_layout().map_or(0, |l| l.block_bytes()),
        }
    }

    /// The step of `stepping` would bring the bytes in use to `want`, over
    /// the budget: the eviction policy names victims in the other idle
    /// sequences (no step planned, no turn in flight), least recently
    /// stepped first, as if the bytes in use were `want`, until the step
    /// fits. Nothing is dropped here ([`apply_idle_cuts`](Self::apply_idle_cuts)
    /// does). Per-lane and token-level policies (whose victims need the
    /// engine's packing) and policies that name nothing free nothing here.
    pub(super) fn idle_cuts(
        &mut self,
        stepping: SeqId,
        want: u64,
        keep: &[BlockId],
    ) -> Result<IdleCuts> {
        let mut order: Vec<(u64, SeqId)> = self
            .seqs
            .iter()
            .filter(|(id, s)| **id != stepping && s.pending.is_none() && s.turn.is_none())
            .map(|(id, s)| (s.last_step, *id))
            .collect();
        order.sort_unstable();
        let mut out = IdleCuts::default();
        // Blocks let go of so far, with multiplicity: one held by two idle
        // sequences is freed only when both give it up.
        let mut let_go: HashMap<BlockId, u32> = HashMap::new();
        for (_, id) in order {
            let left = want.saturating_sub(out.bytes);
            if left <= self.budget {
                break;
            }
            let pressure = self.pressure(left, 0);
            let (Some(ev), Some(s)) = (self.evict.as_mut(), self.seqs.get(&id)) else {
                break;
            };
            if ev.per_lane() || ev.token_level() {
                break;
            }
            let mut victims = Vec::new();
            ev.victims(id, &s.table, pressure, &mut victims);
            // A policy that could not answer about an idle sequence cuts
            // nothing from it and fails that sequence's own next step, not
            // this one (kept until then, or until it closes).
            if let Some(why) = ev.take_error() {
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.policy_error.get_or_insert(why);
                }
                continue;
            }
            if victims.is_empty() {
                continue;
            }
            let mut table = s.table.clone();
            let mut release = Vec::new();
            drop_victims(&mut table, &victims, &mut release)?;
            table.compact();
            for &b in &release {
                let n = let_go.entry(b).or_default();
                *n += 1;
                if !keep.contains(&b) && self.tiers.ref_count(b).is_ok_and(|c| c == *n) {
                    out.bytes += self.bytes_of(b);
                    if TieredPool::tier_of(b) == HOT {
                        out.hot += 1;
                    } else {
                        out.cold += 1;
                    }
                }
            }
            out.cuts.push((id, table, release, victims.len()));
        }
        Ok(out)
    }

    /// Drops what [`idle_cuts`](Self::idle_cuts) chose and releases it.
    pub(super) fn apply_idle_cuts(&mut self, idle: IdleCuts) -> Result<()> {
        for (id, table, release, victims) in idle.cuts {
            if let Some(s) = self.seqs.get_mut(&id) {
                s.table = table;
            }
            self.counters.evicted_entries += victims as u64;
            self.counters.evicted_idle_entries += victims as u64;
            self.release_all(&release)?;
        }
        Ok(())
    }
}
