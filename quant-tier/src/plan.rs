//! [`TierPlan`]: which whole blocks have left the hot window.

use crate::{QuantError, Result};

/// The newest `window` tokens stay in the compute dtype; every whole block
/// entirely older than that is quantized into the cold tier and its hot block
/// freed. The window must be a whole number of blocks (rejected otherwise,
/// never rounded silently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierPlan {
    block_size: usize,
    window: usize,
}

impl TierPlan {
    /// A plan; errors if `block_size` is 0 or `window` not a multiple of it.
    pub fn new(block_size: usize, window: usize) -> Result<Self> {
        if block_size == 0 || window % block_size != 0 {
            return Err(QuantError::Window { window, block_size });
        }
        Ok(TierPlan { block_size, window })
    }

    /// Tokens kept in full precision.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Blocks of a `len`-token sequence that belong in the cold tier: the
    /// leading whole blocks that end before the last `window` tokens.
    pub fn cold_blocks(&self, len: usize) -> usize {
        len.saturating_sub(self.window) / self.block_size
    }
}
