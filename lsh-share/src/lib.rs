//! Store a cold KV block once when another block already holds (nearly)
//! the same content.
//!
//! A [`Deduplicator`] is offered each new cold block's [`Content`] and may
//! name a *canonical* block to read in its place; the cache coordinator
//! then turns the new entry into an
//! [`Alias`](kvforge_pool::Slot::Alias) of the canonical block (one more
//! reference on it) and frees the new block. Sharing happens only in the
//! cold (quantized) tier, as in the design seed.
//!
//! A deduplicator never aliases on a hash alone: it fetches every
//! candidate's stored content from the caller and returns only one that
//! [`matches`](Deduplicator::matches) the offered content.
//!
//! # Implementations
//!
//! * [`ExactDedup`] — identical quantized bytes (xxh3-128 buckets, then a
//!   byte comparison). It shares only what is bit-for-bit the same, so it
//!   never changes a result.
//! * [`SimHashDedup`] — near-duplicates: random-hyperplane signatures of the
//!   dequantized vector (`bits` hyperplanes per table, `tables` tables),
//!   candidates from the buckets of every table, verified by their exact
//!   cosine against a threshold.
//!
//! Both pass [`testing::check_deduplicator`].

#![deny(missing_docs)]

mod simhash;
pub mod testing;

use std::collections::HashMap;

use kvforge_pool::BlockId;
use xxhash_rust::xxh3::{Xxh3Builder, xxh3_128};

pub use simhash::{MAX_BITS, SimHashConfig, SimHashDedup, cosine};

/// A bad configuration or input; nothing changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShareError {
    /// A parameter that cannot work.
    #[error("sharing config: {0}")]
    Config(String),
    /// Content a deduplicator cannot compare.
    #[error("sharing: {0}")]
    Content(String),
}

/// What a deduplicator sees of a cold block.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Content {
    /// The stored bytes (codes and group parameters).
    pub bytes: Vec<u8>,
    /// The dequantized elements, when the deduplicator
    /// [`wants_vectors`](Deduplicator::wants_vectors) (empty otherwise).
    pub vector: Vec<f32>,
}

/// Counters since the deduplicator was built.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareStats {
    /// Blocks offered.
    pub offered: u64,
    /// Offers answered with a canonical block.
    pub shared: u64,
    /// Candidates whose stored content did not match (or was gone).
    pub rejected: u64,
    /// Canonical candidates known now.
    pub canonical: u64,
}

/// Finds a canonical block for a new cold block's content.
///
/// Contract (checked by [`testing::check_deduplicator`]): `offer` returns
/// only a block that was offered before, is not forgotten, is not `block`
/// itself, whose content it fetched through `stored` and that
/// [`matches`](Self::matches) the offered content; a block it does not
/// return becomes a candidate for later offers; `forget` removes a
/// candidate for good. Only candidates are returned, so an alias never
/// points at another alias.
pub trait Deduplicator: Send {
    /// A short name for reports.
    fn name(&self) -> String;

    /// Whether [`Content::vector`] must be filled (the caller dequantizes
    /// for it).
    fn wants_vectors(&self) -> bool {
        false
    }

    /// Whether a block holding `a` may be read as one holding `b`.
    fn matches(&self, a: &Content, b: &Content) -> bool;

    /// `block` now holds `content`. Returns a canonical block to alias it
    /// to, one whose content (fetched with `stored`; `None` when it is
    /// gone) [`matches`](Self::matches); otherwise `block` becomes a
    /// candidate itself. An error (content it cannot compare) changes
    /// nothing.
    fn offer(
        &mut self,
        block: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>, ShareError>;

    /// `block`'s storage is gone (freed or reclaimed): never return it.
    fn forget(&mut self, block: BlockId);

    /// Counters.
    fn stats(&self) -> ShareStats;
}

/// Candidate lists by key, each candidate's keys, and the counters: what
/// both deduplicators keep.
struct Candidates<K> {
    lists: HashMap<K, Vec<BlockId>, Xxh3Builder>,
    keys: HashMap<BlockId, Vec<K>, Xxh3Builder>,
    stats: ShareStats,
}

impl<K: std::hash::Hash + Eq + Copy> Default for Candidates<K> {
    fn default() -> Self {
        Candidates {
            lists: HashMap::default(),
            keys: HashMap::default(),
            stats: ShareStats::default(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Copy> Candidates<K> {
    /// An offer of `block` under `keys`: the candidates under any of them,
    /// each once and oldest first per key, are fetched and checked in turn;
    /// the first whose stored content `matches` is returned. Otherwise
    /// `block` becomes a candidate under `keys`.
    fn offer(
        &mut self,
        block: BlockId,
        keys: Vec<K>,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
        matches: impl Fn(&Content, &Content) -> bool,
    ) -> Option<BlockId> {
        self.stats.offered += 1;
        let mut seen: Vec<BlockId> = Vec::new();
        for k in &keys {
            for &c in self.lists.get(k).into_iter().flatten() {
                if c == block || seen.contains(&c) {
                    continue;
                }
                seen.push(c);
                match stored(c) {
                    Some(s) if matches(content, &s) => {
                        self.stats.shared += 1;
                        return Some(c);
                    }
                    _ => self.stats.rejected += 1,
                }
            }
        }
        self.remove(block);
        for &k in &keys {
            self.lists.entry(k).or_default().push(block);
        }
        self.keys.insert(block, keys);
        self.stats.canonical = self.keys.len() as u64;
        None
    }

    /// `block` is a candidate no more.
    fn remove(&mut self, block: BlockId) {
        for k in self.keys.remove(&block).unwrap_or_default() {
            if let Some(l) = self.lists.get_mut(&k) {
                l.retain(|&x| x != block);
                if l.is_empty() {
                    self.lists.remove(&k);
                }
            }
        }
        self.stats.canonical = self.keys.len() as u64;
    }
}

/// [`ExactDedup`]'s test: the stored bytes are identical.
fn same_bytes(a: &Content, b: &Content) -> bool {
    a.bytes == b.bytes
}

/// Shares blocks whose quantized bytes are identical.
#[derive(Default)]
pub struct ExactDedup {
    index: Candidates<u128>,
}

impl ExactDedup {
    /// An empty deduplicator.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Deduplicator for ExactDedup {
    fn name(&self) -> String {
        "exact".into()
    }

    fn matches(&self, a: &Content, b: &Content) -> bool {
        same_bytes(a, b)
    }

    fn offer(
        &mut self,
        block: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>, ShareError> {
        let key = xxh3_128(&content.bytes);
        Ok(self
            .index
            .offer(block, vec![key], content, stored, same_bytes))
    }

    fn forget(&mut self, block: BlockId) {
        self.index.remove(block);
    }

    fn stats(&self) -> ShareStats {
        self.index.stats
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
