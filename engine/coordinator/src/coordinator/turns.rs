//! Turns: snapshots and rollback, forks, the lifecycle at a turn's end,
//! compressed segments, closing a sequence.

use std::ops::Range;

use kvforge_lifecycle::{Label, Outcome, Segment, TurnEnd};
use kvforge_pool::{BlockId, BlockTable, Slot};

use crate::error::{CoordError, Result};

use super::demote::follow_moves;
use super::{Coordinator, SeqId, Turn};

/// What a turn end gives the lifecycle besides the positions.
#[derive(Clone, Debug, Default)]
pub struct TurnInput {
    /// Positions where a segment of the turn starts (none: one segment).
    pub cuts: Vec<u64>,
    /// The sequence's token ids by position (for revival; empty: none).
    pub tokens: Vec<u32>,
    /// Ids that never count towards a reference (template tokens).
    pub stop: Vec<u32>,
    /// Positions whose tokens can refer to a pending segment (the user's
    /// message; `None`: the whole turn).
    pub refer: Option<Range<u64>>,
    /// The model's labels for the turn's segments (`None`: missing or
    /// unusable, or not asked).
    pub model: Option<Vec<Label>>,
}

/// What the lifecycle did at a turn end.
#[derive(Clone, Debug, Default)]
pub struct TurnLifecycle {
    /// Entries dropped (blocks released).
    pub dropped_entries: usize,
    /// The lifecycle's decisions.
    pub outcome: Outcome,
}

impl Coordinator {
    /// The segments the turn of `seq` in progress will add when it ends
    /// with `cuts` (what the model is asked to label); empty without a
    /// lifecycle.
    pub fn turn_segments(&self, seq: SeqId, cuts: &[u64]) -> Result<Vec<Segment>> {
        let end = self.seq(seq)?.table.positions();
        Ok(self
            .lifecycle
            .as_ref()
            .map(|l| l.turn_segments(seq, end, cuts))
            .unwrap_or_default())
    }

    /// A new sequence that reads what `seq` holds: the same entries with
    /// a reference of its own on every block (nothing is copied). Its
    /// first step copies a partial last block into a block of its own, so
    /// the two never write into one block. `seq` must be between steps.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let r = self.fork_call(seq);
        self.checked(r)
    }

    pub(super) fn fork_call(&mut self, seq: SeqId) -> Result<SeqId> {
        self.idle(seq, "forked during a step")?;
        let mut table = self.seq(seq)?.table.clone();
        let held: Vec<BlockId> = table.held().collect();
        self.retain_all(&held)?;
        let bs = self.block_size() as u32;
        let partial = table.entries().last().is_some_and(|e| e.tokens() < bs);
        table.seal();
        let id = self.open_empty();
        let s = self.seq_mut(id)?;
        s.table = table;
        s.copy_tail = partial;
        Ok(id)
    }

    /// Starts a turn: the table is kept, with references of its own, so
    /// that [`rollback_turn`](Self::rollback_turn) can restore it after
    /// the turn's steps demoted or dropped entries.
    pub fn begin_turn(&mut self, seq: SeqId) -> Result<()> {
        let r = self.begin_turn_call(seq);
        self.checked(r)
    }

    pub(super) fn begin_turn_call(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?;
        if s.turn.is_some() || s.pending.is_some() {
            return Err(CoordError::Order {
                seq,
                what: "a turn is already in progress",
            });
        }
        let turn = Turn {
            table: s.table.clone(),
            copy_tail: s.copy_tail,
            partial: s.partial,
            indexed: s.indexed,
            relocations: Vec::new(),
        };
        let held: Vec<BlockId> = turn.table.held().collect();
        self.retain_all(&held)?;
        self.seq_mut(seq)?.turn = Some(turn);
        Ok(())
    }

    /// The turn succeeded: its snapshot is let go; the lifecycle (if any)
    /// labels the segments and frees what it reclaims. Returns the entries
    /// dropped. [`end_turn_labelled`](Self::end_turn_labelled) with the
    /// turn as one segment and no labels from the model.
    pub fn end_turn(&mut self, seq: SeqId) -> Result<usize> {
        let t = TurnInput::default();
        self.end_turn_labelled(seq, &t).map(|r| r.dropped_entries)
    }

    /// The turn succeeded: its snapshot is let go; the lifecycle (if any)
    /// cuts the turn into segments at `t.cuts`, labels the live segments
    /// (with the model's labels `t.model`), queues, revives and frees
    /// segments. The entries lying wholly inside freed segments are
    /// dropped and their blocks released; segments to summarise come back
    /// in the report (answer with
    /// [`compressed`](Self::compressed)).
    pub fn end_turn_labelled(&mut self, seq: SeqId, t: &TurnInput) -> Result<TurnLifecycle> {
        let r = self.end_turn_labelled_call(seq, t);
        self.checked(r)
    }

    pub(super) fn end_turn_labelled_call(
        &mut self,
        seq: SeqId,
        t: &TurnInput,
    ) -> Result<TurnLifecycle> {
        self.idle(seq, "turn ended during a step")?;
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let end = s.table.positions();
        if let Some(mut turn) = s.turn.take() {
            follow_moves(&mut s.partial, &turn.relocations);
            self.relocate(&turn.relocations)?;
            self.release_all(&turn.table.clear())?;
        }
        let Some(lc) = self.lifecycle.as_mut() else {
            return Ok(TurnLifecycle::default());
        };
        let outcome = lc.end_turn(
            seq,
            TurnEnd {
                end,
                cuts: &t.cuts,
                tokens: &t.tokens,
                stop: &t.stop,
                refer: t.refer.clone(),
                model: t.model.as_deref(),
            },
        );
        let c = &mut self.counters;
        c.lifecycle_queued += u64::from(outcome.queued);
        c.lifecycle_revived += u64::from(outcome.revived);
        c.lifecycle_reclaimed += u64::from(outcome.reclaimed);
        c.lifecycle_fallbacks += u64::from(outcome.fallback);
        // Everything freed so far: an entry straddling two segments freed at
        // different turns is inside the union, not inside either one.
        let dropped = if outcome.reclaim.is_empty() {
            0
        } else {
            let freed = lc.freed(seq);
            self.drop_ranges(seq, &freed)?
        };
        Ok(TurnLifecycle {
            dropped_entries: dropped,
            outcome,
        })
    }

    /// A segment [`end_turn_labelled`](Self::end_turn_labelled) handed out
    /// for summarising was replaced (`replaced`: its entries are dropped
    /// now, its blocks released) or not (it is kept for good). Returns the
    /// entries dropped. A segment that was not handed out (or was answered
    /// already) is refused, and nothing changes.
    pub fn compressed(&mut self, seq: SeqId, seg: Segment, replaced: bool) -> Result<usize> {
        let r = self.compressed_call(seq, seg, replaced);
        self.checked(r)
    }

    pub(super) fn compressed_call(
        &mut self,
        seq: SeqId,
        seg: Segment,
        replaced: bool,
    ) -> Result<usize> {
        self.idle(seq, "compressed during a step")?;
        let Some(lc) = self.lifecycle.as_mut() else {
            return Err(CoordError::Order {
                seq,
                what: "compressed a segment without a lifecycle (none was handed out)",
            });
        };
        lc.compressed(seq, seg, replaced)?;
        if !replaced {
            return Ok(0);
        }
        let freed = lc.freed(seq);
        self.counters.lifecycle_compressed += 1;
        self.drop_ranges(seq, &freed)
    }

    /// Drops the live entries of `seq` lying wholly inside `ranges` (not
    /// an open last block, not packed ones: those hold pages of other
    /// positions, eviction's to drop) and releases their blocks.
    pub(super) fn drop_ranges(&mut self, seq: SeqId, ranges: &[Range<u64>]) -> Result<usize> {
        if ranges.is_empty() {
            return Ok(0);
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let last = s.table.entries().len().wrapping_sub(1);
        let open = s.table.is_open();
        let mut release = Vec::new();
        for i in 0..s.table.entries().len() {
            let e = s.table.entries()[i];
            let inside = ranges
                .iter()
                .any(|r| r.start <= e.first() && e.end() <= r.end);
            if inside && e.slot().is_live() && !e.is_packed() && !(open && i == last) {
                release.extend(s.table.set_slot(i, Slot::Dropped)?.block());
            }
        }
        s.table.compact();
        let dropped = release.len();
        self.counters.lifecycle_dropped_entries += dropped as u64;
        self.release_all(&release)?;
        Ok(dropped)
    }

    /// The turn failed: any step in flight is aborted and the table is
    /// restored to the turn's start, with the same blocks. If others may
    /// read rows the turn wrote into the open last block (a fork, a prefix
    /// hit, the index), that block comes back sealed and the next step
    /// copies its tokens into a block of the sequence's own, so those rows
    /// are never written again. Without a turn in progress it is refused
    /// and nothing changes.
    pub fn rollback_turn(&mut self, seq: SeqId) -> Result<()> {
        let r = self.rollback_turn_call(seq);
        self.checked(r)
    }

    pub(super) fn rollback_turn_call(&mut self, seq: SeqId) -> Result<()> {
        if self.seq(seq)?.turn.is_none() {
            return Err(CoordError::Order {
                seq,
                what: "rollback without a turn in progress",
            });
        }
        if self.seq(seq)?.pending.is_some() {
            self.abort(seq)?;
        }
        let s = self.seq_mut(seq)?;
        let Some(turn) = s.turn.take() else {
            return Err(CoordError::UnknownSeq(seq));
        };
        let mut now = std::mem::replace(&mut s.table, turn.table);
        s.copy_tail = turn.copy_tail;
        s.partial = turn.partial;
        s.indexed = turn.indexed;
        let open = match s.table.entries().last() {
            Some(e) if s.table.is_open() => e.slot().block().map(|b| (b, e.tokens())),
            _ => None,
        };
        self.release_all(&now.clear())?;
        if let Some((b, len)) = open {
            // Its rows after the snapshot's are written again: a cold copy
            // of the turn's content is not its copy.
            self.demoted.remove(&b);
            if self.reads_past(seq, b, len) {
                let s = self.seq_mut(seq)?;
                s.table.seal();
                s.copy_tail = true;
            }
        }
        Ok(())
    }

    /// Whether anyone but `seq` may read rows of hot block `b` from row
    /// `len` on: the index (it was given more tokens of `b`), or another
    /// sequence's table, turn snapshot or planned table listing `b` with
    /// more tokens.
    pub(super) fn reads_past(&self, seq: SeqId, b: BlockId, len: u32) -> bool {
        let past = |t: &BlockTable| {
            t.entries()
                .iter()
                .any(|e| e.slot().block() == Some(b) && e.tokens() > len)
        };
        self.cached.get(&b).is_some_and(|&l| l > len)
            || self
                .seqs
                .iter()
                .filter(|(id, _)| **id != seq)
                .any(|(_, o)| {
                    past(&o.table)
                        || o.turn.as_ref().is_some_and(|t| past(&t.table))
                        || o.pending.as_ref().is_some_and(|p| past(&p.next))
                })
    }

    /// Ends a sequence: aborts a step in flight, rolls back a turn in
    /// progress, releases its blocks (cached ones stay matchable).
    pub fn close(&mut self, seq: SeqId) -> Result<()> {
        let r = self.close_call(seq);
        self.checked(r)
    }

    pub(super) fn close_call(&mut self, seq: SeqId) -> Result<()> {
        if self.seq(seq)?.turn.is_some() {
            self.rollback_turn(seq)?;
        } else if self.seq(seq)?.pending.is_some() {
            self.abort(seq)?;
        }
        let mut s = self.seqs.remove(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        self.release_all(&s.table.clear())?;
        if let Some(e) = self.evict.as_mut() {
            e.forget(seq);
        }
        if let Some(l) = self.lifecycle.as_mut() {
            l.forget(seq);
        }
        Ok(())
    }
}
