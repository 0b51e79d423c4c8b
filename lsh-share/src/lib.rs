//! Store a cold KV block once when another block already holds (nearly)
//! the same content.
//!
//! A [`Deduplicator`] is offered each new cold block's content and may name
//! a *canonical* block to read in its place; the cache coordinator then
//! turns the new entry into an
//! [`Alias`](kvforge_pool::Slot::Alias) of the canonical block (one more
//! reference on it) and frees the new block. Sharing happens only in the
//! cold (quantized) tier, as in the design seed.
//!
//! Policies only decide. Every candidate is verified by the caller before
//! it is returned: a deduplicator never aliases on a hash alone.
//!
//! # Implementations
//!
//! * [`ExactDedup`] — identical quantized bytes (xxh3-128 buckets, then a
//!   byte comparison by the caller). It shares only what is bit-for-bit the
//!   same, so it never changes a result; it finds little in natural text.
//!
//! Near-duplicate sharing (random-hyperplane LSH over the dequantized
//! vectors, cosine threshold) comes with the LSH issue, measured first; it
//! must pass [`testing::check_deduplicator`] too.

#![deny(missing_docs)]

pub mod testing;

use std::collections::HashMap;

use kvforge_pool::BlockId;
use xxhash_rust::xxh3::{Xxh3Builder, xxh3_128};

/// Counters since the deduplicator was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareStats {
    /// Blocks offered.
    pub offered: u64,
    /// Offers answered with a canonical block.
    pub shared: u64,
    /// Candidates the caller's verification rejected.
    pub rejected: u64,
    /// Canonical candidates known now.
    pub canonical: u64,
}

/// Finds a canonical block for a new cold block's content.
///
/// Contract (checked by [`testing::check_deduplicator`]): `offer` returns
/// only a block that was offered before, is not forgotten, is not `block`
/// itself, and that `same` accepted; a block it does not return becomes a
/// candidate for later offers; `forget` removes a candidate for good.
pub trait Deduplicator: Send {
    /// A short name for reports.
    fn name(&self) -> String;

    /// `block` now holds `content` (its quantized bytes). Returns a
    /// canonical block to alias it to: one for which `same(candidate)`
    /// returned true (the caller compares the stored contents). Otherwise
    /// `block` becomes a candidate itself.
    fn offer(
        &mut self,
        block: BlockId,
        content: &[u8],
        same: &mut dyn FnMut(BlockId) -> bool,
    ) -> Option<BlockId>;

    /// `block`'s storage is gone (freed or reclaimed): never return it.
    fn forget(&mut self, block: BlockId);

    /// Counters.
    fn stats(&self) -> ShareStats;
}

/// Shares blocks whose quantized bytes are identical.
#[derive(Default)]
pub struct ExactDedup {
    buckets: HashMap<u128, Vec<BlockId>, Xxh3Builder>,
    keys: HashMap<BlockId, u128, Xxh3Builder>,
    stats: ShareStats,
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

    fn offer(
        &mut self,
        block: BlockId,
        content: &[u8],
        same: &mut dyn FnMut(BlockId) -> bool,
    ) -> Option<BlockId> {
        self.stats.offered += 1;
        let key = xxh3_128(content);
        let bucket = self.buckets.entry(key).or_default();
        for &c in bucket.iter() {
            if c == block {
                continue;
            }
            if same(c) {
                self.stats.shared += 1;
                return Some(c);
            }
            self.stats.rejected += 1;
        }
        if !bucket.contains(&block) {
            bucket.push(block);
            if let Some(old) = self.keys.insert(block, key) {
                // Offered again with other content: leave the old bucket.
                if let Some(b) = self.buckets.get_mut(&old) {
                    b.retain(|&x| x != block);
                }
            }
        }
        self.stats.canonical = self.keys.len() as u64;
        None
    }

    fn forget(&mut self, block: BlockId) {
        if let Some(key) = self.keys.remove(&block) {
            if let Some(b) = self.buckets.get_mut(&key) {
                b.retain(|&x| x != block);
                if b.is_empty() {
                    self.buckets.remove(&key);
                }
            }
        }
        self.stats.canonical = self.keys.len() as u64;
    }

    fn stats(&self) -> ShareStats {
        self.stats
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
