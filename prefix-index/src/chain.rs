//! [`HashChainIndex`]: a flat map from chained block key to block (vLLM v1's
//! `BlockHashToBlockMap`), with verification of every hit.

use std::collections::HashMap;

use crate::hash::{FoldHash, block_key, root_key};
use crate::{
    BlockHash, BlockHasher, BlockId, BlockRef, ExtraKeys, Inserted, MatchStats, PrefixError,
    PrefixMatch, PrefixMatcher, Result, Xxh3Hasher, trace_block, validate_insert,
};

/// One indexed block.
struct Entry {
    block: BlockId,
    /// Unique for the life of the index: identifies this entry as a parent.
    serial: u64,
    parent_serial: u64,
    parent_key: BlockHash,
    tokens: Box<[u32]>,
    /// Lengths of sealed (short) children, longest first.
    sealed: Vec<u32>,
}

/// The start of every chain in one namespace.
struct Root {
    extra: ExtraKeys,
    serial: u64,
    sealed: Vec<u32>,
}

/// Prefix index as a flat hash map of chained xxh3-128 keys.
///
/// Lookup costs one hash of `16 + 4 × block_size` bytes, one map probe and one
/// token comparison per block. A hit must match the stored tokens *and* the
/// serial of the entry it was inserted under, so neither a collision nor a
/// re-inserted parent can hand out KV computed for another prefix.
pub struct HashChainIndex<H: BlockHasher = Xxh3Hasher> {
    block_size: usize,
    hasher: H,
    entries: HashMap<BlockHash, Entry, FoldHash>,
    roots: HashMap<BlockHash, Root, FoldHash>,
    /// Block index -> (handle, key) of the entry that holds it.
    slots: Vec<Option<(BlockId, BlockHash)>>,
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

impl<H: BlockHasher> HashChainIndex<H> {
    /// An index with any hasher (tests use a colliding one).
    pub fn with_hasher(block_size: usize, hasher: H) -> Result<Self> {
        if block_size == 0 {
            return Err(PrefixError::ZeroBlockSize);
        }
        Ok(HashChainIndex {
            block_size,
            hasher,
            entries: HashMap::default(),
            roots: HashMap::default(),
            slots: Vec::new(),
            next_serial: 1,
            stats: MatchStats::default(),
            scratch: Vec::with_capacity(16 + 4 * block_size),
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

    /// Whether the entry (or root) that was stored under `key` with `serial`
    /// is still in the index.
    fn is_live(&self, key: BlockHash, serial: u64) -> bool {
        self.roots.get(&key).is_some_and(|r| r.serial == serial)
            || self.entries.get(&key).is_some_and(|e| e.serial == serial)
    }

    /// Removes the entry at `key` and its slot record.
    fn remove_entry(&mut self, key: BlockHash) {
        if let Some(e) = self.entries.remove(&key) {
            let slot = &mut self.slots[e.block.index() as usize];
            if *slot == Some((e.block, key)) {
                *slot = None;
            }
            self.stats.forgotten_blocks += 1;
        }
    }
}

fn add_sealed(list: &mut Vec<u32>, len: u32) {
    if let Err(pos) = list.binary_search_by(|x| len.cmp(x)) {
        list.insert(pos, len);
    }
}

impl<H: BlockHasher> PrefixMatcher for HashChainIndex<H> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        let HashChainIndex {
            block_size,
            hasher,
            entries,
            roots,
            stats,
            scratch,
            ..
        } = self;
        let bs = *block_size;
        stats.queries += 1;
        stats.query_tokens += tokens.len() as u64;
        let mut m = PrefixMatch::default();
        let rk = root_key(hasher, extra);
        let Some(root) = roots.get(&rk).filter(|r| r.extra == *extra) else {
            trace_block(0, Some(rk), false);
            return m;
        };
        let (mut parent_key, mut parent_serial, mut sealed) = (rk, root.serial, &root.sealed);
        let mut p = 0;
        loop {
            let rest = &tokens[p..];
            let full = (rest.len() >= bs).then_some(bs as u32);
            let candidates = full
                .into_iter()
                .chain(sealed.iter().copied().filter(|&l| l as usize <= rest.len()));
            let mut found = None;
            for len in candidates {
                let toks = &rest[..len as usize];
                let key = block_key(hasher, parent_key, toks, scratch);
                let hit = entries
                    .get(&key)
                    .filter(|e| e.parent_serial == parent_serial && *e.tokens == *toks);
                trace_block(m.blocks.len(), Some(key), hit.is_some());
                if let Some(e) = hit {
                    found = Some((key, len, e));
                    break;
                }
            }
            let Some((key, len, e)) = found else { break };
            m.blocks.push(BlockRef::new(e.block, len));
            p += len as usize;
            (parent_key, parent_serial, sealed) = (key, e.serial, &e.sealed);
        }
        m.tokens = p;
        stats.hit_tokens += p as u64;
        stats.hit_blocks += m.blocks.len() as u64;
        m
    }

    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> Result<Inserted> {
        validate_insert(tokens, blocks, self.block_size)?;
        // Slots handed out again since they were indexed: their old content is gone.
        for b in blocks {
            if let Some(&Some((old, key))) = self.slots.get(b.block.index() as usize) {
                if old != b.block {
                    self.remove_entry(key);
                }
            }
        }
        let mut out = Inserted::default();
        let rk = root_key(&self.hasher, extra);
        let root_serial = match self.roots.get(&rk) {
            Some(r) if r.extra != *extra => {
                out.collisions += 1;
                self.stats.collisions += 1;
                return Ok(out);
            }
            Some(r) => r.serial,
            None => {
                let serial = self.serial();
                self.roots.insert(
                    rk,
                    Root {
                        extra: extra.clone(),
                        serial,
                        sealed: Vec::new(),
                    },
                );
                serial
            }
        };
        let (mut parent_key, mut parent_serial) = (rk, root_serial);
        let mut at_root = true;
        let mut p = 0;
        for b in blocks {
            let toks = &tokens[p..p + b.len as usize];
            let key = block_key(&self.hasher, parent_key, toks, &mut self.scratch);
            if let Some(e) = self.entries.get(&key) {
                if e.parent_serial == parent_serial && *e.tokens == *toks {
                    out.already_cached += 1;
                    self.stats.duplicate_blocks += 1;
                    (parent_key, parent_serial) = (key, e.serial);
                    at_root = false;
                    p += b.len as usize;
                    continue;
                }
                if !self.is_live(e.parent_key, e.parent_serial) {
                    // Its parent entry is gone: an orphan nobody can reach.
                    self.remove_entry(key);
                } else {
                    out.collisions += 1;
                    self.stats.collisions += 1;
                    break;
                }
            }
            let idx = b.block.index() as usize;
            if idx >= self.slots.len() {
                self.slots.resize(idx + 1, None);
            }
            if let Some((_, old_key)) = self.slots[idx] {
                // The slot was handed out again: its old content is gone.
                self.remove_entry(old_key);
            }
            let serial = self.serial();
            self.entries.insert(
                key,
                Entry {
                    block: b.block,
                    serial,
                    parent_serial,
                    parent_key,
                    tokens: toks.into(),
                    sealed: Vec::new(),
                },
            );
            self.slots[idx] = Some((b.block, key));
            if (b.len as usize) < self.block_size {
                let list = if at_root {
                    self.roots.get_mut(&rk).map(|r| &mut r.sealed)
                } else {
                    self.entries.get_mut(&parent_key).map(|e| &mut e.sealed)
                };
                if let Some(list) = list {
                    add_sealed(list, b.len);
                }
            }
            out.new += 1;
            self.stats.inserted_blocks += 1;
            (parent_key, parent_serial) = (key, serial);
            at_root = false;
            p += b.len as usize;
        }
        Ok(out)
    }

    fn forget(&mut self, block: BlockId) -> bool {
        match self.slots.get(block.index() as usize) {
            Some(&Some((id, key))) if id == block => {
                self.remove_entry(key);
                true
            }
            _ => false,
        }
    }

    fn stats(&self) -> MatchStats {
        MatchStats {
            cached_blocks: self.entries.len() as u64,
            ..self.stats
        }
    }
}
