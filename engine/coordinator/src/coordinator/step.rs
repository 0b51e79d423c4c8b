//! One step of one sequence: [`Coordinator::plan`] decides and checks
//! everything, then takes what it needs in one place that gives it all back
//! on failure; [`Coordinator::commit`] and [`Coordinator::abort`] end it.

use kvforge_pool::Slot;

use crate::error::{CoordError, Result};
use crate::plan::{Plan, Planned, Shortfall};

use super::demote::follow_moves;
use super::draft::{Draft, IdleCuts, Rewrite};
use super::{COLD, Coordinator, HOT, SeqId};
use crate::plan::Phase;

impl Coordinator {
    /// Plans one step of `n` new tokens for `seq`: drops (eviction),
    /// demotions (tier policy) and the hot blocks for the new tokens. Blocks
    /// are allocated now; nothing is released before [`commit`](Self::commit).
    ///
    /// Everything is decided and checked (the policies' answers, the byte
    /// budget, room in every tier) before anything is taken, so on error
    /// nothing changed: tables, counts, pools, index and the other
    /// sequences are as they were (the policies were asked, as for a step
    /// that is aborted). When the step only fits by taking entries from
    /// idle sequences, those are dropped first; an abort does not bring
    /// them back.
    pub fn plan(&mut self, seq: SeqId, n: usize) -> Result<Planned> {
        let r = self.plan_call(seq, n);
        self.fail_at = None;
        self.checked(r)
    }

    /// The pipeline: phases that only decide, then phases that take
    /// references, with one point that gives back whatever was taken.
    fn plan_call(&mut self, seq: SeqId, n: usize) -> Result<Planned> {
        let mut d = self.draft(seq, n)?;
        self.phase(Phase::Evict)?;
        self.evict_own(&mut d)?;
        self.phase(Phase::Pack)?;
        self.pack(&mut d)?;
        self.phase(Phase::Demote)?;
        self.choose_demotions(&mut d)?;
        self.phase(Phase::Fit)?;
        self.size(&mut d);
        if let Some(lack) = self.fit(&mut d)? {
            return Ok(Planned::Full(Shortfall {
                seq,
                tokens: n,
                lack,
            }));
        }
        match self.take(&mut d).and_then(|()| self.build(&mut d)) {
            Ok(pending) => {
                self.step_peak = self.step_peak.max(self.tiers.in_use_bytes());
                let plan = std::mem::take(&mut d.plan);
                self.seq_mut(seq)?.pending = Some(pending);
                Ok(Planned::Step(plan))
            }
            Err(e) => {
                let _ = self.release_all(&d.taken);
                Err(e)
            }
        }
    }

    /// A draft of the next step of `seq`: its table, nothing decided.
    fn draft(&self, seq: SeqId, n: usize) -> Result<Draft> {
        let s = self.seq(seq)?;
        if s.pending.is_some() {
            return Err(CoordError::Order {
                seq,
                what: "a step is already planned (commit or abort it first)",
            });
        }
        if n == 0 {
            return Err(CoordError::Order {
                seq,
                what: "a step of zero tokens",
            });
        }
        Ok(Draft {
            seq,
            n,
            plan: Plan {
                start: s.table.positions(),
                wants: self.wants(),
                ..Plan::default()
            },
            next: s.table.clone(),
            release: Vec::new(),
            lane_drops: Vec::new(),
            punched: 0,
            packing: None,
            row_packing: None,
            reuse: Vec::new(),
            fresh: Vec::new(),
            copy_src: None,
            in_open: 0,
            need_hot: 0,
            idle: IdleCuts::default(),
            taken: Vec::new(),
            cold_new: Vec::new(),
            hot_new: Vec::new(),
        })
    }

    /// How many hot blocks the step needs: the new tokens past the room in
    /// the open block, the copy of a shared partial tail (which then takes
    /// the new tokens), a pack's or compaction's fresh blocks.
    fn size(&self, d: &mut Draft) {
        let bs = self.block_size();
        let copy_tail = self.seqs.get(&d.seq).is_some_and(|s| s.copy_tail);
        d.copy_src = match d.next.entries().last() {
            Some(e) if copy_tail && !d.next.is_open() && (e.tokens() as usize) < bs => {
                match e.slot() {
                    Slot::Hot(b) => Some((b, e.tokens())),
                    _ => None,
                }
            }
            _ => None,
        };
        let room = match d.copy_src {
            Some((_, len)) => bs - len as usize,
            None => d.next.room() as usize,
        };
        d.in_open = d.n.min(room);
        d.need_hot = (d.n - d.in_open).div_ceil(bs)
            + usize::from(d.copy_src.is_some())
            + d.rewrite().map_or(0, Rewrite::fresh);
    }

    /// Takes the step's references, each pushed to `d.taken` as it is
    /// taken: the cold copies it reuses, then (idle sequences' cuts
    /// applied) its fresh cold and hot blocks. The checks of `fit` made
    /// every allocation fit: an error here is a broken contract.
    fn take(&mut self, d: &mut Draft) -> Result<()> {
        self.phase(Phase::Retain)?;
        for &(_, _, c) in &d.reuse {
            self.retain_all(&[c])?;
            d.taken.push(c);
        }
        self.phase(Phase::CutIdle)?;
        self.apply_idle_cuts(std::mem::take(&mut d.idle))?;
        self.phase(Phase::Allocate)?;
        d.cold_new = self.allocate(COLD, d.fresh.len(), &mut d.taken)?;
        d.hot_new = self.allocate(HOT, d.need_hot, &mut d.taken)?;
        Ok(())
    }

    /// The step succeeded: the planned table becomes the sequence's,
    /// demoted, dropped and aliased blocks are released, demoted blocks
    /// that the index held now point at their cold copies.
    pub fn commit(&mut self, seq: SeqId) -> Result<()> {
        let r = self.commit_call(seq);
        self.checked(r)
    }

    pub(super) fn commit_call(&mut self, seq: SeqId) -> Result<()> {
        let p = self.take_pending(seq, "commit without a planned step")?;
        self.counters.steps += 1;
        self.counters.evicted_entries += p.evicted as u64;
        self.counters.demoted_blocks += p.demotions as u64;
        self.counters.packed_blocks += p.packed as u64;
        self.counters.evicted_tokens += p.punched as u64;
        self.counters.compacted_blocks += p.compacted as u64;
        let steps = self.counters.steps;
        let mut moves = Vec::new();
        for &(hot, cold, quantized) in &p.demoted {
            if quantized {
                moves.push((hot, cold));
            }
            self.demoted.insert(hot, cold);
        }
        // A block rewritten in place holds other content now: a cold copy
        // of what it held is not its copy any more.
        for b in &p.rewritten {
            self.demoted.remove(b);
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        s.table = p.next;
        s.table.compact();
        s.last_step = steps;
        if p.copies_tail {
            s.copy_tail = false;
        }
        match s.turn.as_mut() {
            Some(t) => t.relocations.extend(moves),
            None => {
                follow_moves(&mut s.partial, &moves);
                self.relocate(&moves)?;
            }
        }
        let r = self.release_all(&p.release);
        self.prune_demoted();
        r
    }

    /// The step failed: give back what the plan took; table, counts and
    /// index are as they were before [`plan`](Self::plan). An in-place
    /// [`Pack`] the engine carried out is the engine's to undo first.
    pub fn abort(&mut self, seq: SeqId) -> Result<()> {
        let r = self.abort_call(seq);
        self.checked(r)
    }

    pub(super) fn abort_call(&mut self, seq: SeqId) -> Result<()> {
        let p = self.take_pending(seq, "abort without a planned step")?;
        if let Some(d) = self.dedup.as_mut() {
            for &b in &p.fresh_cold {
                d.forget(b);
            }
        }
        self.release_all(&p.taken)
    }
}
