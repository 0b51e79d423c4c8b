//! Prefix reuse: a sequence opened on the longest cached prefix, its
//! blocks registered in the index.

use kvforge_pool::{BlockId, Slot, TieredPool};
use kvforge_prefix::{BlockRef, EventSink, ExtraKeys, PrefixMatcher, Watched, acquire_prefix};

use crate::config::TurnTail;
use crate::error::{CoordError, Result};

use super::demote::follow_moves;
use super::{Coordinator, HOT, Opened, SeqId};

impl Coordinator {
    /// Opens a sequence for a prompt of `tokens`: with reuse on, it starts
    /// with the longest cached prefix of `tokens[..len - 1]` (the last token
    /// is always computed, for its logits), hot and cold blocks as they
    /// are cached, with a reference on each. The match is cut where
    /// reviving cached blocks (or keeping blocks a step in flight is
    /// about to free) would put the bytes in use over the budget, whether
    /// the steps in flight are committed or aborted.
    pub fn open(&mut self, tokens: &[u32], extra: &ExtraKeys) -> Result<Opened> {
        let r = self.open_call(tokens, extra);
        self.checked(r)
    }

    /// The tokens [`open`](Self::open) would find cached for `tokens`
    /// now, as far as the index knows (a block reclaimed since, or the
    /// budget, may cut the open shorter), without taking a reference or
    /// counting a query: for a caller preparing a request before it opens.
    pub fn cached_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> usize {
        let upto = tokens.len().saturating_sub(1);
        self.index
            .as_mut()
            .map_or(0, |i| i.peek_prefix(&tokens[..upto], extra).tokens)
    }

    pub(super) fn open_call(&mut self, tokens: &[u32], extra: &ExtraKeys) -> Result<Opened> {
        let Some(index) = self.index.as_mut() else {
            return Ok(Opened {
                seq: self.open_empty(),
                reused: 0,
            });
        };
        let upto = tokens.len().saturating_sub(1);
        let mut m = acquire_prefix(index, &self.tiers, &tokens[..upto], extra)?;
        let copy = self.tail() == Some(TurnTail::Copy);
        let bs = self.block_size() as u32;
        // A partial tail can only be copied out of the hot tier.
        if let Some(last) = m.blocks.last().copied() {
            if copy && last.len < bs && TieredPool::tier_of(last.block) != HOT {
                self.release_all(&[last.block])?;
                m.truncate(m.blocks.len() - 1);
            }
        }
        while self.worst_bytes() > self.budget {
            let Some(last) = m.blocks.last().copied() else {
                break;
            };
            self.release_all(&[last.block])?;
            m.truncate(m.blocks.len() - 1);
        }
        let seq = self.open_empty();
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        for b in &m.blocks {
            let slot = if TieredPool::tier_of(b.block) == HOT {
                Slot::Hot(b.block)
            } else {
                Slot::Cold(b.block)
            };
            s.table.push(slot, b.len, false)?;
        }
        s.copy_tail = copy && m.blocks.last().is_some_and(|b| b.len < bs);
        let hot = m
            .blocks
            .iter()
            .filter(|b| TieredPool::tier_of(b.block) == HOT)
            .count();
        self.counters.reused_hot_blocks += hot as u64;
        self.counters.reused_cold_blocks += (m.blocks.len() - hot) as u64;
        Ok(Opened {
            seq,
            reused: m.tokens,
        })
    }

    /// Registers in the prefix index every entry from the start of `seq`
    /// (hot or cold) up to the first entry whose KV, or the KV after it,
    /// is not that of the plain prefix: an alias (another block's
    /// content), a dropped or holed entry, a packed one. `tokens` are the
    /// tokens whose KV the table holds. The partial last block is handled
    /// as the configured [`TurnTail`] says. Returns the tokens the index
    /// holds for `seq` from its start: fewer than the table when a block
    /// is indexed elsewhere as another sequence's entry (a shared partial
    /// block), whose chain cannot be continued.
    pub fn register(&mut self, seq: SeqId, tokens: &[u32], extra: &ExtraKeys) -> Result<usize> {
        let r = self.register_call(seq, tokens, extra);
        self.checked(r)
    }

    pub(super) fn register_call(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Result<usize> {
        let Some(tail) = self.tail() else {
            return Ok(0);
        };
        self.idle(seq, "registered during a step")?;
        let (refs, covered, registered_open) = self.registrable(seq, tail)?;
        if covered > tokens.len() {
            return Err(CoordError::Order {
                seq,
                what: "registered with fewer tokens than the table holds",
            });
        }
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        if tail == TurnTail::Seal {
            s.table.seal();
        }
        // The turn so far succeeded: its demotions' index moves apply now,
        // so the chain below is found under the handles the table holds.
        let moves = s
            .turn
            .as_mut()
            .map(|t| std::mem::take(&mut t.relocations))
            .unwrap_or_default();
        follow_moves(&mut s.partial, &moves);
        let before = s.partial.take();
        let k = s.indexed.min(refs.len());
        self.relocate(&moves)?;
        let Some(chained) = self.index_chain(&refs, k, before, &tokens[..covered], extra)? else {
            return Ok(0);
        };
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let last_open = registered_open && chained == refs.len();
        s.indexed = chained - usize::from(last_open);
        s.partial = last_open.then(|| refs[chained - 1].block);
        Ok(refs[..chained].iter().map(|r| r.len as usize).sum())
    }

    /// The entries of `seq` a registration under `tail` hands the index,
    /// from the start up to the first whose KV (or the KV after it) is not
    /// the plain prefix's: an alias (another block's content), a dropped
    /// or holed entry, a packed one. Returns them, the tokens they cover
    /// and whether the open last block is among them (under `Copy`).
    fn registrable(&self, seq: SeqId, tail: TurnTail) -> Result<(Vec<BlockRef>, usize, bool)> {
        let t = &self.seq(seq)?.table;
        // Under `Seal` the table is sealed first (once nothing can fail).
        let open = t.is_open() && tail != TurnTail::Seal;
        let done = t.entries().len() - usize::from(open && tail == TurnTail::Skip);
        let mut refs = Vec::with_capacity(done);
        let mut covered = 0usize;
        for e in &t.entries()[..done] {
            match e.slot() {
                // A packed block holds pages of other positions; KV after
                // a hole was computed without the rows evicted.
                Slot::Hot(_) | Slot::Cold(_) if e.is_packed() || e.holes() != 0 => break,
                Slot::Hot(b) | Slot::Cold(b) => refs.push(BlockRef::new(b, e.tokens())),
                Slot::Alias { .. } | Slot::Dropped => break,
            }
            covered += e.tokens() as usize;
        }
        let registered_open = open && tail == TurnTail::Copy && refs.len() == done;
        Ok((refs, covered, registered_open))
    }

    /// Hands `refs` (holding `tokens`) to the index: only what is new,
    /// below the `k`-th block registered before, if the index still holds
    /// it there; else from the start. `before`, the open block registered
    /// last time, gives its shorter entry up first. Returns how many of
    /// `refs` the index now holds as this sequence's chain (`None`: no
    /// index): it follows blocks it already holds (ours or another
    /// sequence's copy of the same content), adds ours after them, and
    /// stops at the first it refuses — only that far is the chain ours to
    /// continue.
    fn index_chain(
        &mut self,
        refs: &[BlockRef],
        k: usize,
        before: Option<BlockId>,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Result<Option<usize>> {
        let Some(index) = self.index.as_mut() else {
            return Ok(None);
        };
        if let Some(b) = before {
            if refs.iter().any(|r| r.block == b) {
                index.forget(b);
            }
        }
        let done: usize = refs[..k].iter().map(|r| r.len as usize).sum();
        let extended = match k {
            0 => None,
            _ => index.extend(refs[k - 1], done, &tokens[done..], &refs[k..])?,
        };
        let (start, out) = match extended {
            Some(out) => (k, out),
            None => (0, index.insert(tokens, extra, refs)?),
        };
        let first_new = start + out.already_cached;
        let chained = first_new + out.new;
        for &r in &refs[first_new..chained] {
            self.mark_cached(r)?;
        }
        Ok(Some(chained))
    }

    /// From now on, reports what enters and leaves the prefix index to
    /// `sink` ([`KvEvent`](kvforge_prefix::KvEvent)s for a KV-aware
    /// router; keys hashed with `seed`). Errors, changing nothing, when
    /// prefix reuse is off or the index holds blocks already. A
    /// reconfigured cache builds a new coordinator, unwatched.
    pub fn watch_index(&mut self, sink: Box<dyn EventSink>, seed: u64) -> Result<()> {
        if self.index_watched {
            return Err(CoordError::Config(
                "the prefix index is watched already".into(),
            ));
        }
        let Some(index) = self.index.take_if(|i| i.stats().cached_blocks == 0) else {
            return Err(CoordError::Config(match self.index {
                None => "KV events need prefix reuse on".into(),
                Some(_) => "KV events must be watched from an empty prefix index".into(),
            }));
        };
        self.index = Some(Box::new(Watched::new(index, sink, seed)));
        self.index_watched = true;
        Ok(())
    }

    /// Seals the last block: the next token starts a new one.
    pub fn seal(&mut self, seq: SeqId) -> Result<()> {
        let r = self.seal_call(seq);
        self.checked(r)
    }

    pub(super) fn seal_call(&mut self, seq: SeqId) -> Result<()> {
        self.idle(seq, "sealed during a step")?;
        self.seq_mut(seq)?.table.seal();
        Ok(())
    }
}
