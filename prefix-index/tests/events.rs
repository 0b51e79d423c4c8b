//! The watched index: it passes the conformance suite, and a router that
//! replays its events knows exactly what the wrapped index holds, over
//! random insertions, extensions, forgets, relocations and reused slots,
//! on both indexes.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvforge_pool::MAX_TIER_BLOCKS;
use kvforge_prefix::{
    BlockId, BlockRef, EventSink, ExtraKeys, HashChainIndex, KvEvent, Medium, PrefixMatcher,
    RadixIndex, Watched, testing,
};

/// Every batch published: (namespace, events).
type Log = Arc<Mutex<Vec<(String, Vec<KvEvent>)>>>;

struct Collect(Log);

impl EventSink for Collect {
    fn publish(&mut self, namespace: &str, events: Vec<KvEvent>) {
        self.0.lock().unwrap().push((namespace.to_owned(), events));
    }
}

fn watched<M: PrefixMatcher>(inner: M) -> (Watched<M>, Log) {
    let log = Log::default();
    (Watched::new(inner, Box::new(Collect(log.clone())), 7), log)
}

#[test]
fn watched_indexes_pass_the_conformance_suite() {
    testing::check_matcher(|bs| watched(HashChainIndex::with_seed(bs, 1).unwrap()).0);
    testing::check_matcher(|bs| watched(RadixIndex::new(bs).unwrap()).0);
}

#[test]
fn an_insertion_stores_a_chain_and_a_forget_removes_its_subtree() {
    let (mut ix, log) = watched(RadixIndex::new(2).unwrap());
    let e = ExtraKeys::namespace("t");
    let blocks = [
        BlockRef::new(BlockId::new(1, 1), 2),
        BlockRef::new(BlockId::new(2, 1), 2),
    ];
    ix.insert(&[5, 6, 7, 8], &e, &blocks).unwrap();
    let batches = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(batches.len(), 1);
    let (ns, events) = &batches[0];
    assert_eq!(ns, "t");
    let (h1, h2) = match &events[..] {
        [
            KvEvent::BlockStored {
                block_hashes: a,
                parent_block_hash: None,
                token_ids: t1,
                block_size: 2,
                medium: Medium::Hot,
                ..
            },
            KvEvent::BlockStored {
                block_hashes: b,
                parent_block_hash: Some(p),
                token_ids: t2,
                ..
            },
        ] if t1 == &[5, 6] && t2 == &[7, 8] && *p == a[0] => (a[0], b[0]),
        other => panic!("unexpected events {other:?}"),
    };
    // Inserting it again stores nothing.
    ix.insert(&[5, 6, 7, 8], &e, &blocks).unwrap();
    assert!(log.lock().unwrap().is_empty());
    assert!(ix.forget(blocks[0].block));
    let batches = std::mem::take(&mut *log.lock().unwrap());
    match &batches[..] {
        [(_, ev)] => match &ev[..] {
            [
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium: Medium::Hot,
                },
            ] => {
                let mut got = block_hashes.clone();
                got.sort_unstable();
                let mut want = vec![h1, h2];
                want.sort_unstable();
                assert_eq!(got, want);
            }
            other => panic!("unexpected events {other:?}"),
        },
        other => panic!("unexpected batches {other:?}"),
    }
}

/// A replayed block: its parent's key, its tokens, where it lives.
type Block = (Option<u64>, Vec<u32>, Medium);

/// A router's view, built from the events alone.
#[derive(Default)]
struct Replay {
    /// (namespace, key) -> (parent key, tokens, medium).
    blocks: HashMap<(String, u64), Block>,
}

impl Replay {
    fn apply(&mut self, log: &Log) {
        for (ns, events) in log.lock().unwrap().drain(..) {
            for e in events {
                match e {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        medium,
                        ..
                    } => {
                        assert_eq!(block_hashes.len(), 1);
                        let k = (ns.clone(), block_hashes[0]);
                        let fresh = self
                            .blocks
                            .insert(k, (parent_block_hash, token_ids, medium))
                            .is_none();
                        assert!(fresh, "a block stored twice without a removal");
                    }
                    KvEvent::BlockRemoved {
                        block_hashes,
                        medium,
                    } => {
                        for h in block_hashes {
                            let gone = self.blocks.remove(&(ns.clone(), h));
                            assert_eq!(
                                gone.map(|g| g.2),
                                Some(medium),
                                "removed what was not stored"
                            );
                        }
                    }
                    KvEvent::AllBlocksCleared => self.blocks.clear(),
                }
            }
        }
    }

    /// Every block's whole prefix, from its chain of parents (which must
    /// all be there: a removal takes the subtree).
    fn prefixes(&self) -> Vec<(String, Vec<u32>)> {
        let mut out = Vec::new();
        for ((ns, _), (parent, tokens, _)) in &self.blocks {
            let mut all = tokens.clone();
            let mut up = *parent;
            while let Some(p) = up {
                let (pp, t, _) = self
                    .blocks
                    .get(&(ns.clone(), p))
                    .expect("a block whose parent was removed");
                let mut front = t.clone();
                front.extend(all);
                all = front;
                up = *pp;
            }
            out.push((ns.clone(), all));
        }
        out
    }
}

/// xorshift64*: a reproducible stream for the random walk.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % n
    }
}

fn random_walk<M: PrefixMatcher>(inner: M, seed: u64) {
    const BS: usize = 2;
    let (mut ix, log) = watched(inner);
    let mut rng = Rng(seed);
    let mut epochs = [1u32; 24];
    let mut used: Vec<BlockId> = Vec::new();
    // Past insertions: (namespace, tokens, blocks), for extensions.
    let mut past: Vec<(ExtraKeys, Vec<u32>, Vec<BlockRef>)> = Vec::new();
    let mut replay = Replay::default();
    let handle = |rng: &mut Rng, epochs: &mut [u32; 24]| {
        let slot = rng.below(24) as usize;
        if rng.below(3) == 0 {
            epochs[slot] += 1;
        }
        let tier = if rng.below(4) == 0 {
            MAX_TIER_BLOCKS as u32
        } else {
            0
        };
        BlockId::new(tier | slot as u32, epochs[slot])
    };
    for _ in 0..3000 {
        let op = rng.below(10);
        let blocks_of = |rng: &mut Rng, n: usize, handle: &mut dyn FnMut(&mut Rng) -> BlockId| {
            let mut tokens = Vec::new();
            let mut blocks = Vec::new();
            for i in 0..n {
                let len = if i + 1 == n && rng.below(4) == 0 {
                    1
                } else {
                    BS
                };
                tokens.extend((0..len).map(|_| rng.below(3) as u32));
                blocks.push(BlockRef::new(handle(rng), len as u32));
            }
            (tokens, blocks)
        };
        if op < 4 || past.is_empty() {
            let ns = ExtraKeys::namespace(["a", "b"][rng.below(2) as usize]);
            let n = 1 + rng.below(4) as usize;
            let (tokens, blocks) = blocks_of(&mut rng, n, &mut |r| handle(r, &mut epochs));
            if ix.insert(&tokens, &ns, &blocks).is_ok() {
                used.extend(blocks.iter().map(|b| b.block));
                past.push((ns, tokens, blocks));
            }
        } else if op < 6 {
            let (ns, tokens, blocks) = past[rng.below(past.len() as u64) as usize].clone();
            let parent = *blocks.last().unwrap();
            if parent.len as usize != BS {
                continue;
            }
            let n = 1 + rng.below(3) as usize;
            let (more, new) = blocks_of(&mut rng, n, &mut |r| handle(r, &mut epochs));
            if let Ok(Some(_)) = ix.extend(parent, tokens.len(), &more, &new) {
                used.extend(new.iter().map(|b| b.block));
                let mut all = tokens;
                all.extend(more);
                past.push((ns, all, [blocks, new].concat()));
            }
        } else if op < 8 {
            let b = used[rng.below(used.len() as u64) as usize];
            if rng.below(2) == 0 {
                ix.forget(b);
            } else {
                // A pool's reclaimed list: several at once, one batch.
                let c = used[rng.below(used.len() as u64) as usize];
                ix.forget_all(&[b, c]);
            }
        } else {
            let old = used[rng.below(used.len() as u64) as usize];
            let new = handle(&mut rng, &mut epochs);
            if ix.relocate(old, new) {
                used.push(new);
            }
        }
        replay.apply(&log);
        assert_eq!(replay.blocks.len(), ix.watched_blocks());
        assert_eq!(replay.blocks.len() as u64, ix.stats().cached_blocks);
        for (ns, tokens) in replay.prefixes() {
            // The index holds the replayed chain whole.
            let m = ix.peek_prefix(&tokens, &ExtraKeys::namespace(ns));
            assert_eq!(m.tokens, tokens.len(), "a replayed chain the index lacks");
        }
    }
}

#[test]
fn replayed_events_equal_the_index_over_a_random_walk() {
    for seed in [1, 2, 3, 0x5eed] {
        random_walk(HashChainIndex::with_seed(2, seed).unwrap(), seed);
        random_walk(RadixIndex::new(2).unwrap(), seed);
    }
}
