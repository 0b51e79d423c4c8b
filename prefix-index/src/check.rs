//! The argument checks both indexes share: block sizes and insertions.

use crate::BlockRef;
use crate::error::{PrefixError, Result};

/// Largest block size an index accepts, in tokens.
pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// Checks a block size (shared by both indexes).
pub(crate) fn check_block_size(block_size: usize) -> Result<()> {
    if block_size == 0 {
        return Err(PrefixError::ZeroBlockSize);
    }
    if block_size > MAX_BLOCK_SIZE {
        return Err(PrefixError::BlockSizeTooLarge {
            block_size,
            max: MAX_BLOCK_SIZE,
        });
    }
    Ok(())
}

/// Checks an insertion's arguments before anything changes (shared by both
/// indexes).
pub(crate) fn validate_insert(
    tokens: &[u32],
    blocks: &[BlockRef],
    block_size: usize,
) -> Result<()> {
    let mut covered = 0usize;
    for b in blocks {
        if b.len == 0 || b.len as usize > block_size {
            return Err(PrefixError::BlockLength {
                block: b.block,
                len: b.len,
                block_size,
            });
        }
        covered += b.len as usize;
    }
    let mut slots: Vec<(u32, usize)> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (b.block.index(), i))
        .collect();
    slots.sort_unstable();
    if let Some(w) = slots.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(PrefixError::DuplicateBlock {
            block: blocks[w[1].1].block,
        });
    }
    if covered > tokens.len() {
        return Err(PrefixError::BlocksExceedTokens {
            covered,
            tokens: tokens.len(),
        });
    }
    Ok(())
}
