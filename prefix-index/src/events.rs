//! What enters and leaves a prefix index, as the events a KV-aware router
//! follows (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`).
//!
//! [`Watched`] wraps any [`PrefixMatcher`]: it forwards every call and
//! keeps a mirror of the indexed blocks (their chained keys, parents,
//! tokens and namespace), so that it can say which blocks an insertion
//! added and which a forget removed with its subtree — whatever the
//! wrapped index is. Each call's events go to an [`EventSink`] in one
//! batch per namespace, so a server can hand every tenant its own stream.
//!
//! Keys are xxh3-128 chains from the namespace's root (the index's own
//! scheme, [`block_key`] / [`root_key`]) under the wrapper's seed; an event
//! carries their low 64 bits. A router that replays a namespace's events in
//! order knows exactly the blocks indexed in it (tested against the
//! wrapped index in `tests/events.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use kvforge_pool::{BlockId, TieredPool};

use crate::error::Result;
use crate::hash::{BlockHash, Xxh3Hasher, block_key, root_key};
use crate::{BlockRef, ExtraKeys, Inserted, MatchStats, PrefixMatch, PrefixMatcher};

/// Where a block's KV lives.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Full precision (the pool's tier 0).
    Hot,
    /// Quantized (any other tier).
    Cold,
}

impl Medium {
    /// The medium of a tiered pool's handle.
    pub fn of(block: BlockId) -> Medium {
        if TieredPool::tier_of(block) == 0 {
            Medium::Hot
        } else {
            Medium::Cold
        }
    }
}

/// One change to what an index holds, in vLLM's field names.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "type"))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks now indexed, a chain: the first hangs below
    /// `parent_block_hash` (`None`: the namespace's root), each holds the
    /// next `block_size` tokens of `token_ids` (kvforge emits one block per
    /// event; a block sealed at a turn's end holds fewer tokens).
    BlockStored {
        /// Keys of the blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Key of the block before the first.
        parent_block_hash: Option<u64>,
        /// The tokens the blocks hold.
        token_ids: Vec<u32>,
        /// Tokens per full block.
        block_size: usize,
        /// The model adapter, if any.
        lora_id: Option<u64>,
        /// Where the KV lives.
        medium: Medium,
    },
    /// Blocks no longer indexed (reclaimed, or below one that was).
    BlockRemoved {
        /// Their keys.
        block_hashes: Vec<u64>,
        /// Where their KV lived.
        medium: Medium,
    },
    /// Nothing is indexed (a stream's start: the instance holds nothing).
    AllBlocksCleared,
}

/// Where a [`Watched`] index sends its events.
pub trait EventSink: Send {
    /// The events of one index call in `namespace` (the [`ExtraKeys`]
    /// namespace of the blocks), in order.
    fn publish(&mut self, namespace: &str, events: Vec<KvEvent>);
}

/// One mirrored block.
struct Node {
    block: BlockId,
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
    children: Vec<BlockHash>,
    namespace: Arc<str>,
    lora: Option<u64>,
}

/// A [`PrefixMatcher`] that reports what enters and leaves it.
pub struct Watched<M> {
    inner: M,
    sink: Box<dyn EventSink>,
    hasher: Xxh3Hasher,
    scratch: Vec<u8>,
    nodes: HashMap<BlockHash, Node>,
    /// Block slot index -> the handle mirrored there and its key.
    slots: HashMap<u32, (BlockId, BlockHash)>,
    /// This call's events, with their namespaces.
    pending: Vec<(Arc<str>, KvEvent)>,
}

impl<M: PrefixMatcher> Watched<M> {
    /// Watches `inner`, which must be empty; keys hashed with `seed`.
    pub fn new(inner: M, sink: Box<dyn EventSink>, seed: u64) -> Self {
        Watched {
            inner,
            sink,
            hasher: Xxh3Hasher::with_seed(seed),
            scratch: Vec::new(),
            nodes: HashMap::new(),
            slots: HashMap::new(),
            pending: Vec::new(),
        }
    }

    /// The wrapped index.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// Blocks the mirror holds (equal to the index's `cached_blocks`).
    pub fn watched_blocks(&self) -> usize {
        self.nodes.len()
    }

    fn indexed(&self, block: BlockId) -> Option<BlockHash> {
        match self.slots.get(&block.index()) {
            Some(&(id, key)) if id == block => Some(key),
            _ => None,
        }
    }

    /// Removes `block`'s node and its subtree, as the index's `forget`.
    fn remove(&mut self, block: BlockId) {
        let Some(top) = self.indexed(block) else {
            return;
        };
        let Some(parent) = self.nodes.get(&top).map(|n| n.parent) else {
            return;
        };
        if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children.retain(|&c| c != top);
        }
        let (mut hot, mut cold, mut ns) = (Vec::new(), Vec::new(), None);
        let mut stack = vec![top];
        while let Some(k) = stack.pop() {
            let Some(n) = self.nodes.remove(&k) else {
                continue;
            };
            if self.slots.get(&n.block.index()) == Some(&(n.block, k)) {
                self.slots.remove(&n.block.index());
            }
            match Medium::of(n.block) {
                Medium::Hot => hot.push(k.0 as u64),
                Medium::Cold => cold.push(k.0 as u64),
            }
            stack.extend(n.children);
            ns.get_or_insert(n.namespace);
        }
        let Some(ns) = ns else { return };
        for (block_hashes, medium) in [(hot, Medium::Hot), (cold, Medium::Cold)] {
            if !block_hashes.is_empty() {
                let e = KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                };
                self.pending.push((ns.clone(), e));
            }
        }
    }

    /// The index's `forget_stale`: older epochs of the slots `blocks` hold.
    fn forget_stale(&mut self, blocks: &[BlockRef]) {
        for b in blocks {
            if let Some(&(old, _)) = self.slots.get(&b.block.index()) {
                if old.epoch() < b.block.epoch() {
                    self.remove(old);
                }
            }
        }
    }

    /// The stored event of node `key`.
    fn stored(&self, key: BlockHash) -> Option<(Arc<str>, KvEvent)> {
        let n = self.nodes.get(&key)?;
        let e = KvEvent::BlockStored {
            block_hashes: vec![key.0 as u64],
            parent_block_hash: n.parent.map(|p| p.0 as u64),
            token_ids: n.tokens.to_vec(),
            block_size: self.inner.block_size(),
            lora_id: n.lora,
            medium: Medium::of(n.block),
        };
        Some((n.namespace.clone(), e))
    }

    /// Mirrors what an insertion reported: `blocks` hold `tokens` below
    /// `parent` (`None`: the root of `extra`); the first
    /// `out.already_cached` were indexed, the `out.new` after them are new.
    fn record(
        &mut self,
        parent: Option<BlockHash>,
        extra: &ExtraKeys,
        tokens: &[u32],
        blocks: &[BlockRef],
        out: &Inserted,
    ) {
        let mut key = parent.unwrap_or_else(|| root_key(&self.hasher, extra));
        let (namespace, lora) = match parent.and_then(|p| self.nodes.get(&p)) {
            Some(p) => (p.namespace.clone(), p.lora),
            None => (Arc::from(extra.namespace.as_str()), extra.adapter),
        };
        let mut up = parent;
        let mut at = 0;
        for (i, b) in blocks.iter().enumerate().take(out.already_cached + out.new) {
            let toks = &tokens[at..at + b.len as usize];
            at += toks.len();
            key = block_key(&self.hasher, key, toks, &mut self.scratch);
            if i >= out.already_cached {
                if let Some(p) = up.and_then(|p| self.nodes.get_mut(&p)) {
                    p.children.push(key);
                }
                let node = Node {
                    block: b.block,
                    parent: up,
                    tokens: toks.into(),
                    children: Vec::new(),
                    namespace: namespace.clone(),
                    lora,
                };
                self.nodes.insert(key, node);
                self.slots.insert(b.block.index(), (b.block, key));
                self.pending.extend(self.stored(key));
            }
            up = Some(key);
        }
    }

    /// Sends this call's events, one batch per run of one namespace.
    fn flush(&mut self) {
        let mut batch: Vec<KvEvent> = Vec::new();
        let mut ns: Option<Arc<str>> = None;
        for (n, e) in std::mem::take(&mut self.pending) {
            if ns.as_ref().is_some_and(|m| *m != n) {
                let m = ns.take().unwrap_or_default();
                self.sink.publish(&m, std::mem::take(&mut batch));
            }
            ns = Some(n);
            batch.push(e);
        }
        if let Some(m) = ns {
            self.sink.publish(&m, batch);
        }
    }
}

impl<M: PrefixMatcher> PrefixMatcher for Watched<M> {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        self.inner.match_prefix(tokens, extra)
    }

    fn peek_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        self.inner.peek_prefix(tokens, extra)
    }

    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> Result<Inserted> {
        let out = self.inner.insert(tokens, extra, blocks)?;
        self.forget_stale(blocks);
        self.record(None, extra, tokens, blocks, &out);
        self.flush();
        Ok(out)
    }

    fn extend(
        &mut self,
        parent: BlockRef,
        end: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
    ) -> Result<Option<Inserted>> {
        let out = self.inner.extend(parent, end, tokens, blocks)?;
        self.forget_stale(blocks);
        if let (Some(o), Some(p)) = (&out, self.indexed(parent.block)) {
            self.record(Some(p), &ExtraKeys::default(), tokens, blocks, o);
        }
        self.flush();
        Ok(out)
    }

    fn forget(&mut self, block: BlockId) -> bool {
        let forgotten = self.inner.forget(block);
        self.remove(block);
        self.flush();
        forgotten
    }

    /// Every block's removal in one batch (a pool reclaims many at once).
    fn forget_all(&mut self, blocks: &[BlockId]) -> usize {
        let mut forgotten = 0;
        for &b in blocks {
            forgotten += usize::from(self.inner.forget(b));
            self.remove(b);
        }
        self.flush();
        forgotten
    }

    fn relocate(&mut self, old: BlockId, new: BlockId) -> bool {
        let moved = self.inner.relocate(old, new);
        // The index's rule: an older epoch of `new`'s slot is forgotten
        // first (with its subtree, which may hold `old`).
        if old != new && self.indexed(old).is_some() {
            if let Some(&(id, _)) = self.slots.get(&new.index()) {
                if id.epoch() < new.epoch() {
                    self.remove(id);
                }
            }
        }
        if moved {
            if let Some(key) = self.indexed(old) {
                self.slots.remove(&old.index());
                self.slots.insert(new.index(), (new, key));
                let e = KvEvent::BlockRemoved {
                    block_hashes: vec![key.0 as u64],
                    medium: Medium::of(old),
                };
                if let Some(n) = self.nodes.get_mut(&key) {
                    n.block = new;
                    self.pending.push((n.namespace.clone(), e));
                }
                self.pending.extend(self.stored(key));
            }
        }
        self.flush();
        moved
    }

    fn stats(&self) -> MatchStats {
        self.inner.stats()
    }
}

impl<M> std::fmt::Debug for Watched<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("blocks", &self.nodes.len())
            .finish()
    }
}
