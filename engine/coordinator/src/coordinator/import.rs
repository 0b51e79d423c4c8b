//! Blocks whose KV comes from outside the process (a shared remote tier):
//! fresh blocks appended to a sequence just opened, for the engine to fill.

use kvforge_pool::{BlockId, Slot};

use crate::error::{CoordError, Result};

use super::{Coordinator, HOT, SeqId};

impl Coordinator {
    /// Appends up to `n` fresh, full blocks of `tier` to idle `seq`, whose
    /// table ends on a block boundary at position `at` (the first position
    /// of the KV the caller holds: a table that ends elsewhere is refused,
    /// so a block can never land at another block's positions), for the
    /// engine to fill with KV it read from elsewhere (verified to be this
    /// prefix's). Fewer when the
    /// byte budget (however the steps in flight end) or the tier's free
    /// blocks run out; returns the blocks, in position order. They are the
    /// sequence's own, like blocks it computed: [`register`](Self::register)
    /// indexes them, [`close`](Self::close) releases them.
    pub fn import(&mut self, seq: SeqId, tier: usize, at: u64, n: usize) -> Result<Vec<BlockId>> {
        let r = self.import_call(seq, tier, at, n);
        self.checked(r)
    }

    /// How many blocks of `tier` an [`import`](Self::import) into `seq`
    /// could take now: 0 when it would be refused; else what the byte
    /// budget (however the steps in flight end) and the tier's free blocks
    /// leave. Ask before fetching what to import.
    pub fn import_room(&self, seq: SeqId, tier: usize) -> usize {
        self.importable(seq)
            .and_then(|()| self.room(tier))
            .unwrap_or(0)
    }

    fn importable(&self, seq: SeqId) -> Result<()> {
        self.idle(seq, "imported into during a step")?;
        let bs = self.block_size() as u32;
        let s = self.seq(seq)?;
        if s.table.is_open()
            || s.copy_tail
            || s.turn.is_some()
            || s.table.positions() % u64::from(bs) != 0
        {
            return Err(CoordError::Order {
                seq,
                what: "imported into a table that does not end on a closed, own block",
            });
        }
        Ok(())
    }

    fn room(&self, tier: usize) -> Result<usize> {
        let per = self.tiers.layout(tier)?.block_bytes().max(1);
        let room = self.budget.saturating_sub(self.worst_bytes()) / per;
        let st = self.tiers.tier_stats(tier)?;
        let free = st.max_blocks.saturating_sub(st.in_use + st.retired);
        Ok(free.min(usize::try_from(room).unwrap_or(usize::MAX)))
    }

    fn import_call(&mut self, seq: SeqId, tier: usize, at: u64, n: usize) -> Result<Vec<BlockId>> {
        self.importable(seq)?;
        if self.seq(seq)?.table.positions() != at {
            return Err(CoordError::Order {
                seq,
                what: "imported at a position its table does not end at",
            });
        }
        let bs = self.block_size() as u32;
        let n = n.min(self.room(tier)?);
        let mut taken = Vec::new();
        let blocks = match self.allocate(tier, n, &mut taken) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.release_all(&taken);
                return Err(e);
            }
        };
        let s = self.seq_mut(seq)?;
        for &b in &blocks {
            let slot = if tier == HOT {
                Slot::Hot(b)
            } else {
                Slot::Cold(b)
            };
            s.table.push(slot, bs, false)?;
        }
        Ok(blocks)
    }
}
