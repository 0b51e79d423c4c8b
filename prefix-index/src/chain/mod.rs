//! [`HashChainIndex`]: a flat map from chained block key to block (vLLM v1's
//! `BlockHashToBlockMap`), with verification of every hit.

mod matcher;

use std::collections::{HashMap, HashSet};

use crate::check::check_block_size;
use crate::error::Result;
use crate::hash::{BlockHash, BlockHasher, Xxh3Hasher};
use crate::hash::{KeyHash, block_key};
use crate::slots::{SlotMap, Slotted};
use crate::walk::SealedLens;
use crate::{BlockRef, ExtraKeys, Inserted, MatchStats, PrefixMatcher};
use kvforge_pool::BlockId;

/// One indexed block.
struct Entry {
    block: BlockId,
    /// Unique for the life of the index: identifies this entry as a parent.
    serial: u64,
    parent_serial: u64,
    parent_key: BlockHash,
    /// The parent is the namespace root, not an entry.
    under_root: bool,
    /// Position of the token after this block (tokens from the root):
    /// where an `extend` below it continues.
    end: u64,
    tokens: Box<[u32]>,
    /// Lengths of sealed children: read on every match, so kept inline
    /// (empty, it allocates nothing).
    sealed: SealedLens,
    /// Keys of the child entries, for removing a subtree; allocated with the
    /// first child. Boxed: 8 bytes instead of an empty set's 32 in every
    /// entry of the map a match probes once per block (a match never reads
    /// this).
    #[allow(clippy::box_collection)]
    children: Option<Box<HashSet<BlockHash, KeyHash>>>,
}

impl Entry {
    fn add_child(&mut self, key: BlockHash, len: usize, block_size: usize) {
        self.children.get_or_insert_default().insert(key);
        if len < block_size {
            self.sealed.add(len as u32);
        }
    }

    fn remove_child(&mut self, key: BlockHash, len: usize, block_size: usize) {
        let removed = self.children.as_mut().is_some_and(|c| c.remove(&key));
        if removed && len < block_size {
            self.sealed.remove(len as u32);
        }
    }
}

/// The start of every chain in one namespace; exists while it has children.
/// A root is never removed with its subtree, so it counts its children
/// instead of listing them.
struct Root {
    extra: ExtraKeys,
    serial: u64,
    children: usize,
    sealed: SealedLens,
}

/// Prefix index as a flat hash map of chained xxh3-128 keys.
///
/// Lookup costs one hash of `16 + 4 × block_size` bytes, one map probe and one
/// token comparison per block. A hit must match the stored tokens *and* the
/// serial of the entry it was inserted under, so neither a collision nor a
/// re-inserted parent can hand out KV computed for another prefix. Each entry
/// knows its children, so forgetting one removes its subtree at once.
pub struct HashChainIndex<H: BlockHasher = Xxh3Hasher> {
    block_size: usize,
    hasher: H,
    entries: HashMap<BlockHash, Entry, KeyHash>,
    roots: HashMap<BlockHash, Root, KeyHash>,
    /// Block slot index -> (handle, key) of the entry that holds it.
    slots: SlotMap<BlockHash>,
    next_serial: u64,
    stats: MatchStats,
    scratch: Vec<u8>,
}

impl HashChainIndex<Xxh3Hasher> {
    /// An index with a random per-process seed (the safe default).
    pub fn new(block_size: usize) -> Result<Self> {
        Self::with_hasher(block_size, Xxh3Hasher::random())
    }

    /// An index with a fixed seed: reproducible keys for research.
    pub fn with_seed(block_size: usize, seed: u64) -> Result<Self> {
        Self::with_hasher(block_size, Xxh3Hasher::with_seed(seed))
    }
}

/// One node of the depth-first match: an entry (or the root) reached at
/// `pos` tokens, `depth` blocks deep, trying its candidate `next`.
struct Frame<'a> {
    key: BlockHash,
    serial: u64,
    sealed: &'a SealedLens,
    pos: usize,
    depth: usize,
    next: usize,
}

impl<H: BlockHasher> HashChainIndex<H> {
    /// An index with any hasher (tests use a colliding one).
    pub fn with_hasher(block_size: usize, hasher: H) -> Result<Self> {
        check_block_size(block_size)?;
        Ok(HashChainIndex {
            block_size,
            hasher,
            entries: HashMap::default(),
            roots: HashMap::default(),
            slots: HashMap::default(),
            next_serial: 1,
            stats: MatchStats::default(),
            scratch: Vec::new(),
        })
    }

    /// The hasher (e.g. to log its seed).
    pub fn hasher(&self) -> &H {
        &self.hasher
    }

    fn serial(&mut self) -> u64 {
        let s = self.next_serial;
        self.next_serial += 1;
        s
    }

    /// Removes the entry at `key` and everything below it; detaches it from
    /// its parent and drops a root left without children.
    fn remove_subtree(&mut self, key: BlockHash) {
        let Some(top) = self.entries.remove(&key) else {
            return;
        };
        let (bs, len) = (self.block_size, top.tokens.len());
        if top.under_root {
            if let Some(r) = self.roots.get_mut(&top.parent_key) {
                r.children -= 1;
                if len < bs {
                    r.sealed.remove(len as u32);
                }
                if r.children == 0 {
                    self.roots.remove(&top.parent_key);
                }
            }
        } else if let Some(p) = self.entries.get_mut(&top.parent_key) {
            p.remove_child(key, len, bs);
        }
        // A leaf (the common case) needs no stack.
        let mut stack = Vec::new();
        let mut next = Some((key, top));
        while let Some((k, e)) = next {
            match self.slots.remove(&e.block.index()) {
                Some(v) if v != (e.block, k) => {
                    self.slots.insert(e.block.index(), v);
                }
                _ => {}
            }
            self.stats.forgotten_blocks += 1;
            for c in e.children.into_iter().flat_map(|c| c.into_iter()) {
                if let Some(child) = self.entries.remove(&c) {
                    stack.push((c, child));
                }
            }
            next = stack.pop();
        }
    }

    /// Inserts `blocks` (holding `tokens`, from position `base` on) below
    /// `parent`: the root of `root = Some((key, namespace))` (created if
    /// its serial is `None`), or, with `root = None`, an entry.
    fn insert_below(
        &mut self,
        root: Option<(BlockHash, &ExtraKeys)>,
        mut parent: (BlockHash, Option<u64>),
        base: u64,
        tokens: &[u32],
        blocks: &[BlockRef],
        out: &mut Inserted,
    ) {
        let mut p = 0;
        for b in blocks {
            let toks = &tokens[p..p + b.len as usize];
            self.stats.insert_tokens += toks.len() as u64;
            let key = block_key(&self.hasher, parent.0, toks, &mut self.scratch);
            if let Some(e) = self.entries.get(&key) {
                if Some(e.parent_serial) == parent.1 && *e.tokens == *toks {
                    out.already_cached += 1;
                    self.stats.duplicate_blocks += 1;
                    parent = (key, Some(e.serial));
                    p += b.len as usize;
                    continue;
                }
                // Every entry is reachable: another prefix owns this key.
                out.collisions += 1;
                self.stats.collisions += 1;
                break;
            }
            if self.slots.contains_key(&b.block.index()) {
                // The same handle is indexed elsewhere, or the slot holds a
                // newer epoch than the caller's (older ones were removed).
                out.already_indexed += 1;
                break;
            }
            let parent_serial = match (parent.1, root) {
                (Some(s), _) => s,
                (None, Some((rk, extra))) => {
                    let serial = self.serial();
                    let root = Root {
                        extra: extra.clone(),
                        serial,
                        children: 0,
                        sealed: SealedLens::default(),
                    };
                    self.roots.insert(rk, root);
                    serial
                }
                (None, None) => break,
            };
            let serial = self.serial();
            let (bs, len) = (self.block_size, toks.len());
            let under_root = root.is_some_and(|(rk, _)| parent.0 == rk);
            if under_root {
                if let Some(r) = self.roots.get_mut(&parent.0) {
                    r.children += 1;
                    if len < bs {
                        r.sealed.add(len as u32);
                    }
                }
            } else if let Some(pe) = self.entries.get_mut(&parent.0) {
                pe.add_child(key, len, bs);
            }
            self.entries.insert(
                key,
                Entry {
                    block: b.block,
                    serial,
                    parent_serial,
                    parent_key: parent.0,
                    under_root,
                    end: base + (p + len) as u64,
                    tokens: toks.into(),
                    sealed: SealedLens::default(),
                    children: None,
                },
            );
            self.slots.insert(b.block.index(), (b.block, key));
            out.new += 1;
            self.stats.inserted_blocks += 1;
            parent = (key, Some(serial));
            p += b.len as usize;
        }
    }
}

impl<H: BlockHasher> Slotted for HashChainIndex<H> {
    type Place = BlockHash;
    fn slot_map(&mut self) -> &mut SlotMap<BlockHash> {
        &mut self.slots
    }
    fn repoint(&mut self, key: BlockHash, _old: BlockId, new: BlockId) {
        if let Some(e) = self.entries.get_mut(&key) {
            e.block = new;
        }
    }
}

impl<H: BlockHasher> std::fmt::Debug for HashChainIndex<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashChainIndex")
            .field("block_size", &self.block_size)
            .field("stats", &self.stats())
            .finish()
    }
}
