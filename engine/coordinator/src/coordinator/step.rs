//! One step of one sequence: [`Coordinator::plan`] decides and checks
//! everything, then takes what it needs in one place that gives it all back
//! on failure; [`Coordinator::commit`] and [`Coordinator::abort`] end it.

use kvforge_pool::{BlockAllocator, BlockId, BlockTable, Slot};

use crate::plan::{CopyOp, Demotion, Pack, Plan, RowPack, Write};
use crate::{CoordError, Result};

use super::demote::follow_moves;
use super::evict::IdleCuts;
use super::pack::{Packing, Rewrite, RowPacking, holes_from};
use super::{COLD, Coordinator, HOT, Pending, SeqId};

/// A step's decisions, from the checks of `plan` to `take_and_build`.
pub(super) struct Build {
    /// What idle sequences give up for the step.
    pub(super) idle: IdleCuts,
    pub(super) next: BlockTable,
    pub(super) plan: Plan,
    pub(super) release: Vec<BlockId>,
    /// Demotions reusing another holder's cold copy: (entry, hot, cold).
    pub(super) reuse: Vec<(usize, BlockId, BlockId)>,
    /// Demotions quantized anew: (entry, hot).
    pub(super) fresh: Vec<(usize, BlockId)>,
    pub(super) need_hot: usize,
    pub(super) copy_src: Option<(BlockId, u32)>,
    pub(super) in_open: usize,
    pub(super) n: usize,
    pub(super) packing: Option<Packing>,
    pub(super) row_packing: Option<RowPacking>,
    pub(super) punched: usize,
}

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
    pub fn plan(&mut self, seq: SeqId, n: usize) -> Result<Plan> {
        let r = self.plan_call(seq, n);
        self.checked(r)
    }

    pub(super) fn plan_call(&mut self, seq: SeqId, n: usize) -> Result<Plan> {
        let bs = self.block_size();
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
        let mut next = s.table.clone();
        let copy_tail = s.copy_tail;
        let mut plan = Plan {
            start: next.positions(),
            ..Plan::default()
        };
        // 1. What the step does, decided on the planned table.
        let mut release = Vec::new();
        let (lane_drops, punched) =
            self.evict_own(seq, n, &mut next, &mut release, &mut plan.drops)?;
        let packing = self.lane_packing(&next, &lane_drops)?;
        let row_packing = self.row_packing(&next);
        // At most one of them: a policy is per lane, per token or neither.
        let rewrite = packing
            .as_ref()
            .map(|p| &p.rw)
            .or(row_packing.as_ref().map(|p| &p.rw));
        let demote = self.demotions(&next, rewrite)?;
        // Another holder's cold copy of the same block is reused as is
        // (held copies only: reviving a cached one would cost bytes);
        // the others are quantized anew.
        let mut reuse = Vec::new();
        let mut fresh = Vec::new();
        for (i, hot) in demote {
            match self.demoted.get(&hot) {
                Some(&c) if self.tiers.ref_count(c).is_ok_and(|k| k > 0) => reuse.push((i, hot, c)),
                _ => fresh.push((i, hot)),
            }
        }
        // A shared partial tail is copied into a block of our own, which
        // then takes the new tokens.
        let copy_src = match next.entries().last() {
            Some(e) if copy_tail && !next.is_open() && (e.tokens() as usize) < bs => {
                match e.slot() {
                    Slot::Hot(b) => Some((b, e.tokens())),
                    _ => None,
                }
            }
            _ => None,
        };
        let room = match copy_src {
            Some((_, len)) => bs - len as usize,
            None => next.room() as usize,
        };
        let in_open = n.min(room);
        let need_hot = (n - in_open).div_ceil(bs)
            + usize::from(copy_src.is_some())
            + rewrite.map_or(0, Rewrite::fresh);
        // 2. The budget holds between steps: blocks this step lets go of
        // for good (dropped or demoted, no other holder) make room. Until
        // the commit they are still held, so a step can exceed it by the
        // blocks it demotes or drops.
        let freed: u64 = release
            .iter()
            .chain(rewrite.map_or(&[][..], Rewrite::away))
            .chain(copy_src.iter().map(|(b, _)| b))
            .chain(fresh.iter().map(|(_, h)| h))
            .chain(reuse.iter().map(|(_, h, _)| h))
            .filter(|&&b| self.tiers.ref_count(b).is_ok_and(|c| c == 1))
            .map(|&b| self.bytes_of(b))
            .sum();
        let hot_bytes = self.cfg.layout.block_bytes();
        let cold_bytes = self.cold_layout().map_or(0, |l| l.block_bytes());
        let too_big = || {
            CoordError::CacheFull(format!(
                "a step of {n} tokens needs more KV than any budget holds"
            ))
        };
        let step_bytes = (need_hot as u64)
            .checked_mul(hot_bytes)
            .zip((fresh.len() as u64).checked_mul(cold_bytes))
            .and_then(|(h, c)| h.checked_add(c))
            .ok_or_else(too_big)?;
        let mut want = self
            .tiers
            .in_use_bytes()
            .saturating_add(step_bytes)
            .saturating_sub(freed);
        // Idle sequences give up entries, least recently stepped first,
        // when that makes the step fit; nothing is dropped yet. The cold
        // copies the step reuses stay (it takes them before the cuts).
        let idle = if want > self.budget {
            let keep: Vec<BlockId> = reuse.iter().map(|&(_, _, c)| c).collect();
            self.idle_cuts(seq, want, &keep)?
        } else {
            IdleCuts::default()
        };
        want = want.saturating_sub(idle.bytes);
        if want > self.budget {
            return Err(CoordError::CacheFull(format!(
                "the step needs {want} bytes of KV, over the budget of {} bytes",
                self.budget
            )));
        }
        for (tier, need, freed_here) in [(HOT, need_hot, idle.hot), (COLD, fresh.len(), idle.cold)]
        {
            if need == 0 {
                continue;
            }
            let st = self.tiers.tier_stats(tier)?;
            let free = st.max_blocks.saturating_sub(st.in_use + st.retired) + freed_here;
            if need > free {
                let what = if tier == HOT { "hot" } else { "cold" };
                return Err(CoordError::CacheFull(format!(
                    "{need} more {what} blocks of {bs} tokens needed, {free} of {} free",
                    st.max_blocks
                )));
            }
        }
        // 3. The step happens: references are taken, idle sequences give
        // up what was chosen; a failure from here on (a broken pool
        // contract) gives back everything taken.
        let mut taken = Vec::new();
        let built = self.take_and_build(
            Build {
                idle,
                next,
                plan,
                release,
                reuse,
                fresh,
                need_hot,
                copy_src,
                in_open,
                n,
                packing,
                row_packing,
                punched,
            },
            &mut taken,
        );
        match built {
            Ok((plan, pending)) => {
                self.step_peak = self.step_peak.max(self.tiers.in_use_bytes());
                self.seq_mut(seq)?.pending = Some(Pending { taken, ..pending });
                Ok(plan)
            }
            Err(e) => {
                let _ = self.release_all(&taken);
                Err(e)
            }
        }
    }

    /// Takes the step's references (reused cold copies, fresh cold and hot
    /// blocks; each pushed to `taken` as it is taken) and builds the
    /// planned table and the plan. The checks in [`plan`](Self::plan)
    /// made every allocation fit: an error here is a broken contract, and
    /// the caller gives back `taken`.
    pub(super) fn take_and_build(
        &mut self,
        b: Build,
        taken: &mut Vec<BlockId>,
    ) -> Result<(Plan, Pending)> {
        let Build {
            idle,
            mut next,
            mut plan,
            mut release,
            reuse,
            fresh,
            need_hot,
            copy_src,
            in_open,
            n,
            packing,
            row_packing,
            punched,
        } = b;
        let bs = self.block_size();
        for &(_, _, c) in &reuse {
            self.retain_all(&[c])?;
            taken.push(c);
        }
        self.apply_idle_cuts(idle)?;
        let cold_new = self.allocate(COLD, fresh.len(), taken)?;
        let mut hot_new = &self.allocate(HOT, need_hot, taken)?[..];
        let reused = reuse.iter().map(|&(entry, hot, cold)| Demotion {
            entry,
            hot,
            cold,
            quantize: false,
        });
        let quantized = fresh
            .iter()
            .zip(&cold_new)
            .map(|(&(entry, hot), &cold)| Demotion {
                entry,
                hot,
                cold,
                quantize: true,
            });
        plan.demotions = reused.chain(quantized).collect();
        plan.demotions.sort_by_key(|d| d.entry);
        let mut demoted = Vec::new();
        for d in &plan.demotions {
            next.set_slot(d.entry, Slot::Cold(d.cold))?;
            release.push(d.hot);
            demoted.push((d.hot, d.cold, d.quantize));
        }
        let mut rewritten = Vec::new();
        // Head-wise eviction: the first `keep` entries of the union take
        // the packed blocks, the others are dropped.
        if let Some(p) = packing {
            let rw = &p.rw;
            let dst = rw.apply(
                &mut next,
                &mut hot_new,
                |_| None,
                &mut release,
                &mut plan.drops,
            )?;
            if rw.in_place {
                rewritten.extend_from_slice(&dst);
            }
            if rw.keep > 0 {
                plan.pack = Some(Pack {
                    lanes: self.lanes,
                    dst,
                    src: p.src,
                    in_place: rw.in_place,
                });
            }
        }
        // Token-level eviction: the live rows of the holed entries move
        // into the first `keep` of them (the last one's tail holes), the
        // others are dropped.
        let mut compacted = 0;
        if let Some(p) = row_packing {
            let rw = &p.rw;
            let tail = (p.live - (rw.keep - 1) * bs) as u32;
            let holes = |k: usize| {
                Some(if k + 1 == rw.keep {
                    holes_from(tail, bs as u32)
                } else {
                    0
                })
            };
            let dst = rw.apply(
                &mut next,
                &mut hot_new,
                holes,
                &mut release,
                &mut plan.drops,
            )?;
            if rw.in_place {
                rewritten.extend_from_slice(&dst);
            }
            compacted = rw.entries.len() - rw.keep;
            let mut src = p.order;
            src.truncate(dst.len() * bs);
            plan.rows = Some(RowPack {
                block_size: bs as u32,
                dst,
                src,
                in_place: rw.in_place,
            });
        }
        plan.drops.sort_unstable();
        // The copy, then writes: the rest of the open block, then the new
        // blocks.
        if let Some((src, tokens)) = copy_src {
            let (&dst, rest) = hot_new
                .split_first()
                .ok_or_else(|| CoordError::CacheFull("no block for the copied tail".into()))?;
            hot_new = rest;
            next.reopen_tail(dst)?;
            release.push(src);
            plan.copies.push(CopyOp { src, dst, tokens });
        }
        if in_open > 0 {
            if let Some(Slot::Hot(b)) = next.entries().last().map(|e| e.slot()) {
                let offset = next.entries().last().map_or(0, |e| e.tokens());
                plan.writes.push(Write {
                    block: b,
                    offset,
                    tokens: in_open as u32,
                });
            }
            next.fill(in_open as u32)?;
        }
        let mut left = n - in_open;
        for &b in hot_new {
            let take = left.min(bs);
            next.push(Slot::Hot(b), take as u32, take < bs)?;
            plan.writes.push(Write {
                block: b,
                offset: 0,
                tokens: take as u32,
            });
            left -= take;
        }
        let written = plan
            .writes
            .iter()
            .map(|w| (w.block, w.offset))
            .chain(plan.copies.iter().map(|c| (c.dst, 0)))
            .chain(plan.pack.iter().flat_map(|p| p.dst.iter().map(|&b| (b, 0))))
            .chain(plan.rows.iter().flat_map(|p| p.dst.iter().map(|&b| (b, 0))))
            .chain(
                plan.demotions
                    .iter()
                    .filter(|d| d.quantize)
                    .map(|d| (d.cold, 0)),
            )
            .collect();
        let pending = Pending {
            written,
            next,
            taken: Vec::new(),
            release,
            demoted,
            fresh_cold: cold_new,
            copies_tail: copy_src.is_some(),
            evicted: plan.drops.len(),
            demotions: plan.demotions.len(),
            packed: plan.pack.as_ref().map_or(0, |p| p.dst.len()),
            punched,
            compacted,
            rewritten,
        };
        Ok((plan, pending))
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
