//! The one error type of `kvforge-prefix`.

use kvforge_pool::{BlockId, PoolError};

/// Invalid arguments to an index, or a pool error met while acquiring a match.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    /// Block size zero.
    #[error("prefix index: block size must be greater than zero")]
    ZeroBlockSize,
    /// Block size above [`MAX_BLOCK_SIZE`](crate::MAX_BLOCK_SIZE).
    #[error("prefix index: block size {block_size} exceeds the maximum of {max} tokens")]
    BlockSizeTooLarge {
        /// The size asked for.
        block_size: usize,
        /// The largest supported.
        max: usize,
    },
    /// A block passed to `insert` holds no token or more than `block_size`.
    #[error("prefix index: block {block} holds {len} tokens; expected 1..={block_size}")]
    BlockLength {
        /// The block.
        block: BlockId,
        /// The length given.
        len: u32,
        /// The index's block size.
        block_size: usize,
    },
    /// The blocks passed to `insert` cover more tokens than were given.
    #[error("prefix index: the blocks cover {covered} tokens but only {tokens} were given")]
    BlocksExceedTokens {
        /// Sum of block lengths.
        covered: usize,
        /// Tokens given.
        tokens: usize,
    },
    /// The same physical block appears twice in one insertion.
    #[error("prefix index: block {block} appears twice in one sequence")]
    DuplicateBlock {
        /// The block.
        block: BlockId,
    },
    /// The allocator refused a retain while acquiring a matched prefix.
    #[error("prefix index: {0}")]
    Pool(#[from] PoolError),
}

/// `Result` with [`PrefixError`].
pub type Result<T, E = PrefixError> = std::result::Result<T, E>;
