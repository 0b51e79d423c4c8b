//! Which KV blocks already hold a prefix of this token sequence?
//!
//! A prefix index maps token-id prefixes, cut into blocks, to the
//! [`BlockId`]s of a `kvforge-pool` that hold their KV. It never allocates
//! and never frees: the caller retains what it matched
//! ([`acquire_prefix`]) and tells the index which blocks the pool reclaimed
//! ([`PrefixMatcher::forget`]).
//!
//! # Key design decisions
//!
//! * **Keys are token ids, never text.** Block `i`'s key is
//!   `xxh3-128(seed, key(i-1) ‖ token ids as little-endian u32)`; the chain
//!   starts at a root key that mixes in the namespace (tenant salt) and the
//!   adapter id, so two namespaces never share a block.
//! * **A hit is verified.** On every hit the stored token ids and the identity
//!   of the parent entry are compared before a block is handed out: a hash
//!   collision can cost a miss, never the wrong KV.
//! * **Lookup walks from the first block and stops at the first miss** on
//!   each path; where sealed and full blocks compete at one place, every
//!   verified path is followed and the longest wins.
//! * **Round-aligned blocks.** A caller may *seal* the partial last block of a
//!   turn (a [`BlockRef`] shorter than the block size). The next turn, whose
//!   prompt extends this one, hits it; later blocks start after it, so rounds
//!   are logical blocks made of fixed-size physical blocks.
//! * **Two implementations, one trait.** [`HashChainIndex`] (vLLM v1: a flat
//!   map from chained hash to block) and [`RadixIndex`] (SGLang: a radix tree
//!   over blocks). Both pass [`testing::check_matcher`].
//!
//! # Invariants
//!
//! * `match_prefix` returns blocks whose tokens equal the query's, in order,
//!   each verified against its parent; `tokens` is the sum of their lengths.
//! * An entry forgotten (its block reclaimed) is never returned again, and
//!   neither is anything that was inserted below it: both are removed at
//!   once, so memory is bounded by the reachable entries, and a namespace
//!   with no entry left has no root.
//! * A block handle is indexed at most once: registering it at a second
//!   place is refused ([`Inserted::already_indexed`]).
//! * Statistics count tokens: `hit_tokens <= query_tokens`; `cached_blocks`
//!   counts reachable entries, the same in every implementation.
//!
//! # Observability
//!
//! With `tracing` at debug level, target `kvforge_prefix`, each block looked up
//! emits one event with its position, key and hit/miss: the seed's main tool
//! for diagnosing a low hit rate.

#![deny(missing_docs)]

mod chain;
mod check;
mod error;
mod events;
mod hash;
mod radix;
mod slots;
pub mod testing;
mod walk;

pub use chain::HashChainIndex;
pub use check::MAX_BLOCK_SIZE;
pub use error::{PrefixError, Result};
pub use events::{EventSink, KvEvent, Medium, Watched};
pub use hash::{BlockHash, BlockHasher, Xxh3Hasher, block_key, root_key};
pub use kvforge_pool::BlockId;
pub use radix::RadixIndex;

use kvforge_pool::{BlockAllocator, Retained};

/// What besides the tokens decides whether KV can be shared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExtraKeys {
    /// Tenant / namespace salt: different namespaces never share blocks.
    pub namespace: String,
    /// Model adapter (e.g. LoRA) id: its KV differs from the base model's.
    pub adapter: Option<u64>,
}

impl ExtraKeys {
    /// Keys for a namespace with no adapter.
    pub fn namespace(namespace: impl Into<String>) -> Self {
        ExtraKeys {
            namespace: namespace.into(),
            adapter: None,
        }
    }

    /// The same keys with an adapter id.
    pub fn with_adapter(mut self, adapter: u64) -> Self {
        self.adapter = Some(adapter);
        self
    }
}

/// A block and how many tokens of the sequence it holds.
///
/// `len == block_size` for ordinary blocks; `len < block_size` marks a block
/// sealed at a turn boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockRef {
    /// The block.
    pub block: BlockId,
    /// Tokens it holds, `1..=block_size`.
    pub len: u32,
}

impl BlockRef {
    /// A block holding `len` tokens.
    pub const fn new(block: BlockId, len: u32) -> Self {
        BlockRef { block, len }
    }
}

/// The longest verified cached prefix of a query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Matched blocks, in sequence order.
    pub blocks: Vec<BlockRef>,
    /// Tokens they cover (sum of `len`).
    pub tokens: usize,
}

impl PrefixMatch {
    /// Keeps only the first `n` blocks.
    pub fn truncate(&mut self, n: usize) {
        self.blocks.truncate(n);
        self.tokens = self.blocks.iter().map(|b| b.len as usize).sum();
    }
}

/// What one insertion did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Blocks added to the index.
    pub new: usize,
    /// Blocks whose content was already indexed (possibly under another
    /// block id, which the index keeps; the caller's copy is redundant).
    pub already_cached: usize,
    /// Blocks not indexed because a different prefix owns their key (a hash
    /// collision); insertion stops there.
    pub collisions: usize,
    /// Blocks not indexed because the same handle is already indexed at
    /// another place (a block holds one content, so the first registration
    /// stays); insertion stops there.
    pub already_indexed: usize,
}

/// Counters in tokens and blocks since the index was built.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatchStats {
    /// `match_prefix` calls.
    pub queries: u64,
    /// Tokens presented to `match_prefix`.
    pub query_tokens: u64,
    /// Tokens covered by returned matches.
    pub hit_tokens: u64,
    /// Blocks returned by matches.
    pub hit_blocks: u64,
    /// Blocks added by `insert`.
    pub inserted_blocks: u64,
    /// Blocks `insert` found already indexed.
    pub duplicate_blocks: u64,
    /// Keys found occupied by a different prefix.
    pub collisions: u64,
    /// Entries removed by `forget` (and by re-use of their block slot),
    /// including those below a forgotten one.
    pub forgotten_blocks: u64,
    /// Tokens `insert` and `extend` hashed or compared: what registering
    /// costs (a session's turn should cost its new tokens, not its history).
    pub insert_tokens: u64,
    /// Blocks indexed now, every one of them reachable by some query.
    pub cached_blocks: u64,
    /// Namespaces (root chains) with at least one indexed block.
    pub namespaces: u64,
}

impl MatchStats {
    /// `hit_tokens / query_tokens`, or 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.query_tokens as f64
        }
    }
}

/// A prefix index over fixed-size KV blocks.
///
/// Run [`testing::check_matcher`] against any implementation.
pub trait PrefixMatcher: Send {
    /// Tokens per full block.
    fn block_size(&self) -> usize;

    /// The longest verified cached prefix of `tokens` in namespace `extra`.
    /// Where full and sealed (shorter) blocks compete, every verified path
    /// is followed and the one covering the most tokens wins; among equally
    /// long paths, the first in depth-first order with longer blocks tried
    /// first (so full blocks win ties).
    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch;

    /// What [`match_prefix`](Self::match_prefix) would return, without
    /// counting a query: a caller estimating a hit ahead of its request
    /// (a remote prefetch) leaves the hit rate as the requests made it.
    fn peek_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch;

    /// Registers `blocks`, which hold `tokens` from the start in order
    /// (block `i` holds the `len_i` tokens after blocks `0..i`). Blocks
    /// already indexed at their place are kept; their chain is followed. A
    /// handle already indexed at another place is refused and insertion
    /// stops there ([`Inserted::already_indexed`]); a handle of a slot that
    /// holds an older epoch in the index replaces it (the pool reused it).
    ///
    /// Errors (nothing is changed): a block length of 0 or above the block
    /// size, blocks covering more tokens than given, a block listed twice.
    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> Result<Inserted>;

    /// [`insert`](Self::insert) continuing below the indexed block
    /// `parent`, which holds `parent.len` tokens and ends at position
    /// `end` of the sequence: `blocks` hold `tokens` and follow it. A
    /// session that registers turn after turn passes only what is new, so
    /// the cost is proportional to the new tokens, not the conversation.
    /// `Ok(None)` (nothing changed) when `parent` is not indexed (any more)
    /// with that length at that place — a block shared by two sequences
    /// may be indexed as another one's shorter (sealed) entry, and
    /// continuing below that would index KV at the wrong positions: the
    /// caller inserts from the start instead. Same errors as `insert`,
    /// plus `parent` listed among `blocks`.
    fn extend(
        &mut self,
        parent: BlockRef,
        end: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
    ) -> Result<Option<Inserted>>;

    /// The pool reclaimed (or freed for good) this block: drop its entry
    /// and everything inserted below it. A handle whose epoch differs from
    /// the indexed one is ignored. Returns whether the handle was indexed
    /// (its entry was removed). Cost: the entries removed, plus O(1).
    fn forget(&mut self, block: BlockId) -> bool;

    /// The content of indexed block `old` now lives in block `new` (the
    /// cache quantized it into a cold tier): the entry hands out `new` from
    /// now on, with everything below it unchanged. Returns whether it did.
    /// Refused (`false`, nothing changes) when `old` is not indexed or
    /// `new`'s slot is indexed at the same or a newer epoch; an older epoch
    /// of `new`'s slot is forgotten first (the pool reused the slot).
    fn relocate(&mut self, old: BlockId, new: BlockId) -> bool;

    /// Counters.
    fn stats(&self) -> MatchStats;

    /// [`forget`](Self::forget) for each block (e.g. an
    /// [`Allocation::reclaimed`](kvforge_pool::Allocation::reclaimed) list).
    fn forget_all(&mut self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|&&b| self.forget(b)).count()
    }
}

/// Forwards every required method through a pointer type.
macro_rules! forward_matcher {
    ($($ptr:ty),*) => {$(
        impl<M: PrefixMatcher + ?Sized> PrefixMatcher for $ptr {
            fn block_size(&self) -> usize {
                (**self).block_size()
            }
            fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
                (**self).match_prefix(tokens, extra)
            }
            fn peek_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
                (**self).peek_prefix(tokens, extra)
            }
            fn insert(
                &mut self,
                tokens: &[u32],
                extra: &ExtraKeys,
                blocks: &[BlockRef],
            ) -> Result<Inserted> {
                (**self).insert(tokens, extra, blocks)
            }
            fn extend(
                &mut self,
                parent: BlockRef,
                end: usize,
                tokens: &[u32],
                blocks: &[BlockRef],
            ) -> Result<Option<Inserted>> {
                (**self).extend(parent, end, tokens, blocks)
            }
            fn forget(&mut self, block: BlockId) -> bool {
                (**self).forget(block)
            }
            fn relocate(&mut self, old: BlockId, new: BlockId) -> bool {
                (**self).relocate(old, new)
            }
            fn stats(&self) -> MatchStats {
                (**self).stats()
            }
        }
    )*};
}

forward_matcher!(Box<M>, &mut M);

/// Matches `tokens` and takes a reference on every matched block, so the pool
/// cannot reclaim them while the caller uses them.
///
/// A block the pool reclaimed between its insertion and now ends the match
/// there (and is forgotten). On a pool error, the references taken so far are
/// given back and the error returned: nothing changes.
pub fn acquire_prefix<M, A>(
    matcher: &mut M,
    allocator: &A,
    tokens: &[u32],
    extra: &ExtraKeys,
) -> Result<PrefixMatch>
where
    M: PrefixMatcher + ?Sized,
    A: BlockAllocator + ?Sized,
{
    let mut m = matcher.match_prefix(tokens, extra);
    for i in 0..m.blocks.len() {
        let block = m.blocks[i].block;
        match allocator.retain(block) {
            Ok(Retained::Held(_)) => {}
            Ok(Retained::Reclaimed) => {
                matcher.forget(block);
                m.truncate(i);
                break;
            }
            Err(e) => {
                for b in m.blocks[..i].iter().rev() {
                    // These were retained just above; releasing them cannot fail.
                    let _ = allocator.release(b.block);
                }
                return Err(e.into());
            }
        }
    }
    Ok(m)
}

/// Emits the per-block hit/miss event (debug level, target `kvforge_prefix`).
#[inline]
pub(crate) fn trace_block(position: usize, key: Option<BlockHash>, hit: bool) {
    tracing::debug!(target: "kvforge_prefix", position, hash = ?key, hit, "block lookup");
}

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
