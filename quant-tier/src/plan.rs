//! [`TierPlan`]: which whole blocks have left the hot window; the
//! [`TierPolicy`] trait that a cache coordinator asks before each step.

use kvforge_pool::{BlockTable, Slot};

use crate::error::{QuantError, Result};

/// Decides which hot entries of a sequence's block table go to the cold
/// (quantized) tier before its next step. Policies only decide: the caller
/// quantizes and moves. Run [`crate::testing::check_tier_policy`] against
/// any implementation.
pub trait TierPolicy: Send + Sync {
    /// Appends to `out` the indexes (ascending, each once) of the entries
    /// of `table` to demote now: hot, full, without holes (rows token-level
    /// eviction marked invalid keep an entry hot until it is compacted or
    /// dropped), never the open last entry.
    fn demote(&self, table: &BlockTable, out: &mut Vec<usize>);

    /// Why the last [`demote`](Self::demote) could not answer (a policy
    /// written in Python raised), taken: the coordinator fails the step
    /// with these words and demotes nothing. Rust policies always answer.
    fn take_error(&self) -> Option<String> {
        None
    }
}

/// The newest `window` tokens stay in the compute dtype, and so do the
/// first `sink` tokens (attention sinks, as in StreamingLLM); every other
/// whole block entirely older than the window is quantized into the cold
/// tier and its hot block freed. Window and sink must be whole numbers of
/// blocks (rejected otherwise, never rounded silently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierPlan {
    block_size: usize,
    window: usize,
    sink: usize,
}

impl TierPlan {
    /// A plan with no sink; errors if `block_size` is 0 or `window` not a
    /// multiple of it.
    pub fn new(block_size: usize, window: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(QuantError::BlockSize);
        }
        if window % block_size != 0 {
            return Err(QuantError::Window {
                what: "hot window",
                tokens: window,
                block_size,
            });
        }
        Ok(TierPlan {
            block_size,
            window,
            sink: 0,
        })
    }

    /// The same plan keeping the first `sink` tokens hot; errors unless
    /// `sink` is a multiple of the block size.
    pub fn with_sink(self, sink: usize) -> Result<Self> {
        if sink % self.block_size != 0 {
            return Err(QuantError::Window {
                what: "sink",
                tokens: sink,
                block_size: self.block_size,
            });
        }
        Ok(TierPlan { sink, ..self })
    }

    /// Tokens kept in full precision at the end.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Tokens kept in full precision at the start.
    pub fn sink(&self) -> usize {
        self.sink
    }

    /// Blocks of a `len`-token sequence (all blocks full) that belong in
    /// the cold tier: the whole blocks after the sink that end before the
    /// last `window` tokens.
    pub fn cold_blocks(&self, len: usize) -> usize {
        len.saturating_sub(self.sink).saturating_sub(self.window) / self.block_size
    }

    /// Whether a full block at positions `first..first + block_size` of a
    /// sequence of `positions` tokens belongs in the cold tier.
    pub fn is_cold(&self, first: u64, positions: u64) -> bool {
        let (bs, w, s) = (self.block_size as u64, self.window as u64, self.sink as u64);
        first >= s && first + bs + w <= positions
    }
}

impl TierPolicy for TierPlan {
    fn demote(&self, table: &BlockTable, out: &mut Vec<usize>) {
        let positions = table.positions();
        let last = table.entries().len().wrapping_sub(1);
        for (i, e) in table.entries().iter().enumerate() {
            let full = e.tokens() as usize == self.block_size;
            if !self.is_cold(e.first(), positions) {
                continue;
            }
            let hot = matches!(e.slot(), Slot::Hot(_)) && e.holes() == 0;
            if hot && full && !(table.is_open() && i == last) {
                out.push(i);
            }
        }
    }
}
