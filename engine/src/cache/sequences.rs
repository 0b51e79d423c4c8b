//! The coordinator's sequence calls behind [`Sequence`] handles: open on a
//! cached prefix, register, turns, forks, free.

use kvforge_coordinator::{Coordinator, Segment, SeqId, TurnInput, TurnLifecycle};
use kvforge_pool::BlockTable;
use kvforge_prefix::ExtraKeys;

use crate::error::Result;

use super::*;

impl PagedKvCache {
    /// A copy of a sequence's block table (empty before its first step).
    pub fn table(&self, seq: &Sequence) -> Result<BlockTable> {
        match seq.id {
            Some(id) => Ok(self.coordinator().table(id)?.clone()),
            None => Ok(BlockTable::new(self.block_size as u32)?),
        }
    }

    /// Opens a sequence for a prompt: with prefix reuse on, it starts with
    /// the longest cached prefix of `tokens` (all but the last token), then
    /// with a remote tier, the blocks after it that the tier holds (asked
    /// for on this thread: a caller that cannot wait for the store asks
    /// [`remote_lookup`](Self::remote_lookup) elsewhere and opens with
    /// [`open_with`](Self::open_with)).
    pub fn open(&self, tokens: &[u32], extra: &ExtraKeys) -> Result<Sequence> {
        let mut seq = self.open_with(tokens, extra, None)?;
        if let Some(l) = self.lookup_after(seq.len, tokens, extra) {
            self.import_fetched(&mut seq, tokens, extra, l.fetch());
        }
        Ok(seq)
    }

    /// Opens a sequence on the longest locally cached prefix of `tokens`,
    /// then imports what `fetched` (the answer to a
    /// [`remote_lookup`](Self::remote_lookup) for the same tokens and
    /// namespace) holds after it.
    pub fn open_with(
        &self,
        tokens: &[u32],
        extra: &ExtraKeys,
        fetched: Option<RemoteFetched>,
    ) -> Result<Sequence> {
        let o = self.coordinator().open(tokens, extra)?;
        let mut seq = Sequence {
            id: Some(o.seq),
            len: o.reused,
        };
        if let Some(f) = fetched {
            self.import_fetched(&mut seq, tokens, extra, f);
        }
        Ok(seq)
    }

    /// Registers the completed blocks of `seq`, which holds the KV of
    /// `tokens`, in the prefix index (no-op with reuse off).
    pub fn register(&self, seq: &Sequence, tokens: &[u32], extra: &ExtraKeys) -> Result<usize> {
        let Some(id) = seq.id else { return Ok(0) };
        let (covered, blocks) = {
            let mut c = self.coordinator();
            let covered = c.register(id, tokens, extra)?;
            (covered, self.export_remote(&c, id, tokens, extra, covered))
        };
        self.offer_remote(tokens, blocks);
        Ok(covered)
    }

    /// Starts a turn that [`rollback_turn`](Self::rollback_turn) can undo.
    pub fn begin_turn(&self, seq: &mut Sequence) -> Result<()> {
        let id = self.ensure(seq)?;
        Ok(self.coordinator().begin_turn(id)?)
    }

    /// Ends a turn (the lifecycle policy may drop old segments).
    pub fn end_turn(&self, seq: &mut Sequence) -> Result<()> {
        self.finish_turn(seq, |c, id| c.end_turn(id).map(|_| ()))
    }

    /// Ends a turn with what the lifecycle needs: the turn's segment cuts,
    /// the sequence's tokens, the model's labels. See
    /// [`Coordinator::end_turn_labelled`].
    pub fn end_turn_labelled(&self, seq: &mut Sequence, t: &TurnInput) -> Result<TurnLifecycle> {
        let mut out = TurnLifecycle::default();
        self.finish_turn(seq, |c, id| {
            out = c.end_turn_labelled(id, t)?;
            Ok(())
        })?;
        Ok(out)
    }

    /// A segment handed out for summarising was replaced (its entries are
    /// dropped) or is kept. Returns the entries dropped.
    pub fn compressed(&self, seq: &mut Sequence, seg: Segment, replaced: bool) -> Result<usize> {
        let mut n = 0;
        self.finish_turn(seq, |c, id| {
            n = c.compressed(id, seg, replaced)?;
            Ok(())
        })?;
        Ok(n)
    }

    /// The segments the turn of `seq` in progress adds when it ends with
    /// `cuts` (empty without a lifecycle or a sequence).
    pub fn turn_segments(&self, seq: &Sequence, cuts: &[u64]) -> Result<Vec<Segment>> {
        match seq.id {
            Some(id) => Ok(self.coordinator().turn_segments(id, cuts)?),
            None => Ok(Vec::new()),
        }
    }

    /// A sequence that reads what `seq` holds (the same blocks, a reference
    /// of its own on each); what it writes next is its own. Free it with
    /// [`free`](Self::free).
    pub fn fork(&self, seq: &Sequence) -> Result<Sequence> {
        match seq.id {
            Some(id) => Ok(Sequence {
                id: Some(self.coordinator().fork(id)?),
                len: seq.len,
            }),
            None => Ok(Sequence::default()),
        }
    }

    /// Restores `seq` to the start of its turn.
    pub fn rollback_turn(&self, seq: &mut Sequence) -> Result<()> {
        self.finish_turn(seq, Coordinator::rollback_turn)
    }

    /// Runs `op` (end or roll back the turn of `seq`), then takes the
    /// sequence's length from its table and frees the cold storage `op`
    /// released.
    pub(super) fn finish_turn(
        &self,
        seq: &mut Sequence,
        op: impl FnOnce(&mut Coordinator, SeqId) -> kvforge_coordinator::Result<()>,
    ) -> Result<()> {
        if let Some(id) = seq.id {
            let mut c = self.coordinator();
            op(&mut c, id)?;
            seq.len = c.table(id)?.positions() as usize;
            self.free_cold(&mut c);
        }
        Ok(())
    }

    /// Releases a sequence's blocks and empties it.
    pub fn free(&self, seq: &mut Sequence) -> Result<()> {
        if let Some(id) = seq.id.take() {
            let mut c = self.coordinator();
            let r = c.close(id);
            self.free_cold(&mut c);
            r?;
        }
        seq.len = 0;
        Ok(())
    }

    pub(super) fn ensure(&self, seq: &mut Sequence) -> Result<SeqId> {
        Ok(*seq
            .id
            .get_or_insert_with(|| self.coordinator().open_empty()))
    }

    /// Drops the stored content of cold blocks that nobody holds or caches.
    pub(super) fn free_cold(&self, c: &mut Coordinator) {
        let freed = c.take_freed_cold();
        if let Some(t) = &self.cold {
            t.free(freed);
        }
    }
}
