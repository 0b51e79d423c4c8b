//! Integration tests of `kvforge-prefix`: the conformance suite on both
//! indexes, a differential property test against a naive model, collision
//! safety with a deliberately colliding hasher, and `acquire_prefix` against
//! a real pool.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use kvforge_pool::{BlockAllocator, BlockPool, KvLayout, PoolConfig, StorageFormat};
use kvforge_prefix::{
    BlockHasher, BlockId, BlockRef, ExtraKeys, HashChainIndex, PrefixMatch, PrefixMatcher,
    RadixIndex, acquire_prefix, testing,
};
use proptest::prelude::*;

#[test]
fn hash_chain_index_passes_the_conformance_suite() {
    testing::check_matcher(|bs| HashChainIndex::with_seed(bs, 0x5eed).unwrap());
    testing::check_matcher(|bs| HashChainIndex::new(bs).unwrap());
}

#[test]
fn radix_index_passes_the_conformance_suite() {
    testing::check_matcher(|bs| RadixIndex::new(bs).unwrap());
}

#[test]
fn boxed_dyn_matchers_pass_the_conformance_suite() {
    testing::check_matcher(|bs| -> Box<dyn PrefixMatcher> {
        Box::new(RadixIndex::new(bs).unwrap())
    });
}

#[test]
fn zero_block_size_is_rejected() {
    assert!(HashChainIndex::new(0).is_err());
    assert!(RadixIndex::new(0).is_err());
}

/// Every key is the same: the worst possible hash function.
struct Colliding;
impl BlockHasher for Colliding {
    fn hash(&self, _: &[u8]) -> u128 {
        42
    }
}

/// Ignores the parent key (the first 16 bytes): equal blocks collide after
/// any prefix.
struct IgnoresParent;
impl BlockHasher for IgnoresParent {
    fn hash(&self, input: &[u8]) -> u128 {
        xxhash_rust::xxh3::xxh3_128(&input[16.min(input.len())..])
    }
}

#[test]
fn collisions_never_hand_out_the_wrong_blocks() {
    for bs in [1usize, 4] {
        let mut idx = HashChainIndex::with_hasher(bs, Colliding).unwrap();
        let e = ExtraKeys::default();
        let a: Vec<u32> = (0..4 * bs as u32).collect();
        let b: Vec<u32> = (100..100 + 4 * bs as u32).collect();
        idx.insert(&a, &e, &testing::full_blocks(0, 4, bs)).unwrap();
        let ins = idx
            .insert(&b, &e, &testing::full_blocks(10, 4, bs))
            .unwrap();
        assert_eq!(ins.new, 0);
        assert_eq!(ins.collisions, 1);
        // Sequence b must not receive a's blocks, whatever the keys say.
        assert_eq!(idx.match_prefix(&b, &e).tokens, 0);
        // a's first block is still found (its tokens verify); the rest of a
        // collided with it and was never stored.
        let r = idx.match_prefix(&a, &e);
        assert_eq!(r.blocks, vec![BlockRef::new(testing::block(0), bs as u32)]);
        // Other namespaces collide at the root and are refused, not merged.
        let other = ExtraKeys::namespace("x");
        assert_eq!(
            idx.insert(&a, &other, &testing::full_blocks(20, 1, bs))
                .unwrap()
                .collisions,
            1
        );
        assert_eq!(idx.match_prefix(&a, &other).tokens, 0);
    }
}

#[test]
fn same_tokens_under_a_colliding_parent_are_not_reused() {
    // Keys that ignore the parent give block [9, 9] one key after any first
    // block; only the parent check stops [1, 3] from reaching [1, 2]'s KV.
    let mut idx = HashChainIndex::with_hasher(2, IgnoresParent).unwrap();
    let e = ExtraKeys::default();
    idx.insert(&[1, 2, 9, 9], &e, &testing::full_blocks(0, 2, 2))
        .unwrap();
    idx.insert(&[1, 3], &e, &testing::full_blocks(5, 1, 2))
        .unwrap();
    let r = idx.match_prefix(&[1, 3, 9, 9], &e);
    assert_eq!(r.blocks, vec![BlockRef::new(testing::block(5), 2)]);
    let r = idx.match_prefix(&[1, 2, 9, 9], &e);
    assert_eq!(r.tokens, 4);
    // Inserting [1, 3, 9, 9] finds [9, 9]'s key owned by the other prefix.
    let ins = idx
        .insert(&[1, 3, 9, 9], &e, &testing::full_blocks(5, 2, 2))
        .unwrap();
    assert_eq!((ins.already_cached, ins.collisions), (1, 1));
}

// ----------------------------------------------------------------------------
// Differential test against the plainest possible model.

/// A map from (namespace, whole prefix as a list of blocks) to block id.
#[derive(Default)]
struct Model {
    bs: usize,
    paths: HashMap<(ExtraKeys, Vec<Vec<u32>>), BlockId>,
}

impl Model {
    fn match_prefix(&self, tokens: &[u32], e: &ExtraKeys) -> PrefixMatch {
        let mut m = PrefixMatch::default();
        let mut path: Vec<Vec<u32>> = Vec::new();
        'walk: loop {
            let rest = &tokens[m.tokens..];
            for len in (1..=self.bs.min(rest.len())).rev() {
                path.push(rest[..len].to_vec());
                if let Some(&b) = self.paths.get(&(e.clone(), path.clone())) {
                    m.blocks.push(BlockRef::new(b, len as u32));
                    m.tokens += len;
                    continue 'walk;
                }
                path.pop();
            }
            return m;
        }
    }

    fn insert(&mut self, tokens: &[u32], e: &ExtraKeys, blocks: &[BlockRef]) {
        // A reused slot drops whatever it held before.
        for b in blocks {
            let stale: Vec<BlockId> = self
                .paths
                .values()
                .filter(|v| v.index() == b.block.index() && **v != b.block)
                .copied()
                .collect();
            for s in stale {
                self.forget(s);
            }
        }
        let mut path = Vec::new();
        let mut p = 0;
        for b in blocks {
            path.push(tokens[p..p + b.len as usize].to_vec());
            p += b.len as usize;
            self.paths
                .entry((e.clone(), path.clone()))
                .or_insert(b.block);
        }
    }

    fn forget(&mut self, block: BlockId) {
        let Some(key) = self
            .paths
            .iter()
            .find(|(_, v)| **v == block)
            .map(|(k, _)| k.clone())
        else {
            return;
        };
        self.paths
            .retain(|(e, p), _| !(*e == key.0 && p.starts_with(&key.1)));
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Insert a sequence built from `parts` with blocks from `first`, sealing
    /// the tail when asked.
    Insert {
        ns: u8,
        parts: Vec<u8>,
        seal: bool,
        first: u32,
    },
    Match {
        ns: u8,
        parts: Vec<u8>,
        extra: Vec<u32>,
    },
    Forget {
        slot: u32,
    },
}

/// Sequences are concatenations of a few fixed chunks, so prefixes are shared.
fn tokens_of(parts: &[u8]) -> Vec<u32> {
    parts
        .iter()
        .flat_map(|&p| (0..(p as u32 % 5 + 1)).map(move |i| (p as u32) * 10 + i))
        .collect()
}

fn op() -> impl Strategy<Value = Op> {
    let parts = prop::collection::vec(0u8..4, 0..6);
    prop_oneof![
        (0u8..2, parts.clone(), any::<bool>(), 0u32..40).prop_map(|(ns, parts, seal, first)| {
            Op::Insert {
                ns,
                parts,
                seal,
                first,
            }
        }),
        (0u8..2, parts, prop::collection::vec(0u32..3, 0..3))
            .prop_map(|(ns, parts, extra)| Op::Match { ns, parts, extra }),
        (0u32..60).prop_map(|slot| Op::Forget { slot }),
    ]
}

/// New blocks for `n_tokens` tokens from slot `first` on, skipping the slots
/// of `held` (a pool never hands out a held block).
fn layout_blocks(
    n_tokens: usize,
    bs: usize,
    seal: bool,
    first: u32,
    epoch: u32,
    held: &[BlockRef],
) -> Vec<BlockRef> {
    let mut slots = (first..).filter(|s| held.iter().all(|h| h.block.index() != *s));
    let mut lens = vec![bs; n_tokens / bs];
    if seal && n_tokens % bs > 0 {
        lens.push(n_tokens % bs);
    }
    lens.into_iter()
        .zip(&mut slots)
        .map(|(len, s)| BlockRef::new(BlockId::new(s, epoch), len as u32))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn both_indexes_agree_with_the_model(bs in 1usize..5, ops in prop::collection::vec(op(), 1..40)) {
        let mut chain = HashChainIndex::with_seed(bs, 3).unwrap();
        let mut radix = RadixIndex::new(bs).unwrap();
        let mut model = Model { bs, ..Model::default() };
        let mut epoch = 1;
        for op in ops {
            match op {
                Op::Insert { ns, parts, seal, first } => {
                    let e = ExtraKeys::namespace(format!("ns{ns}"));
                    let t = tokens_of(&parts);
                    // Continue from what is cached, as an engine would.
                    let hit = model.match_prefix(&t, &e);
                    epoch += 1;
                    let mut blocks = hit.blocks.clone();
                    blocks.extend(layout_blocks(t.len() - hit.tokens, bs, seal, first + 100, epoch, &hit.blocks));
                    chain.insert(&t, &e, &blocks).unwrap();
                    radix.insert(&t, &e, &blocks).unwrap();
                    model.insert(&t, &e, &blocks);
                }
                Op::Match { ns, parts, extra } => {
                    let e = ExtraKeys::namespace(format!("ns{ns}"));
                    let mut t = tokens_of(&parts);
                    t.extend(extra);
                    let want = model.match_prefix(&t, &e);
                    prop_assert_eq!(&chain.match_prefix(&t, &e), &want, "chain");
                    prop_assert_eq!(&radix.match_prefix(&t, &e), &want, "radix");
                }
                Op::Forget { slot } => {
                    let target = model.paths.values().find(|b| b.index() == slot + 100).copied();
                    if let Some(b) = target {
                        prop_assert!(chain.forget(b));
                        prop_assert!(radix.forget(b));
                        model.forget(b);
                    }
                }
            }
            prop_assert_eq!(radix.stats().cached_blocks as usize, model.paths.len());
        }
    }
}

// ----------------------------------------------------------------------------
// acquire_prefix with a real pool.

fn pool(blocks: usize) -> BlockPool {
    let layout = KvLayout::new(1, 1, 8, 4, StorageFormat::F16).unwrap();
    BlockPool::new(layout, PoolConfig::fixed(blocks)).unwrap()
}

/// Allocates, registers and releases one sequence, as an engine would.
fn cache_sequence(
    pool: &BlockPool,
    idx: &mut dyn PrefixMatcher,
    t: &[u32],
    e: &ExtraKeys,
) -> Vec<BlockId> {
    let n = t.len() / idx.block_size();
    let a = pool.allocate(n).unwrap();
    idx.forget_all(&a.reclaimed);
    let refs: Vec<BlockRef> = a.blocks.iter().map(|&b| BlockRef::new(b, 4)).collect();
    idx.insert(t, e, &refs).unwrap();
    for &b in &a.blocks {
        pool.mark_cached(b).unwrap();
    }
    pool.release_sequence(&a.blocks).unwrap();
    a.blocks
}

#[test]
fn acquire_prefix_revives_cached_blocks_and_stops_at_reclaimed_ones() {
    for mut idx in [
        Box::new(HashChainIndex::with_seed(4, 1).unwrap()) as Box<dyn PrefixMatcher>,
        Box::new(RadixIndex::new(4).unwrap()),
    ] {
        let p = pool(4);
        let e = ExtraKeys::default();
        let t: Vec<u32> = (0..16).collect();
        let blocks = cache_sequence(&p, idx.as_mut(), &t, &e);
        assert_eq!(p.stats().cached_free, 4);
        // Reclaim the last block behind the index's back (no forget call).
        let other = p.allocate(1).unwrap();
        assert_eq!(other.reclaimed, vec![blocks[3]], "tail first");
        let m = acquire_prefix(idx.as_mut(), &p, &t, &e).unwrap();
        assert_eq!(m.tokens, 12, "the reclaimed block ends the match");
        for b in &m.blocks {
            assert_eq!(p.ref_count(b.block), Ok(1));
        }
        assert_eq!(idx.match_prefix(&t, &e).tokens, 12, "and it was forgotten");
        p.release_sequence(&m.blocks.iter().map(|b| b.block).collect::<Vec<_>>())
            .unwrap();
        p.release(other.blocks[0]).unwrap();
        assert_eq!(p.stats().in_use, 0);
    }
}

#[test]
fn acquire_prefix_gives_back_references_on_error() {
    let p = pool(2);
    let mut idx = RadixIndex::new(4).unwrap();
    let e = ExtraKeys::default();
    let t: Vec<u32> = (0..8).collect();
    let a = p.allocate(2).unwrap();
    // Indexed but never marked cached: once free, retaining it is an error.
    let refs: Vec<BlockRef> = a.blocks.iter().map(|&b| BlockRef::new(b, 4)).collect();
    idx.insert(&t, &e, &refs).unwrap();
    p.mark_cached(a.blocks[0]).unwrap();
    p.release_sequence(&a.blocks).unwrap();
    let before = p.stats();
    assert!(acquire_prefix(&mut idx, &p, &t, &e).is_err());
    assert_eq!(
        p.stats(),
        before,
        "the first block's reference was given back"
    );
}

/// A `MakeWriter` that collects log output in memory.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

#[test]
fn debug_log_has_one_event_per_block_with_its_hash_and_outcome() {
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(out.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let mut idx = HashChainIndex::with_seed(4, 1).unwrap();
        let e = ExtraKeys::default();
        let t: Vec<u32> = (0..12).collect();
        idx.insert(&t, &e, &testing::full_blocks(0, 2, 4)).unwrap();
        assert_eq!(idx.match_prefix(&t, &e).tokens, 8);
    });
    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("block lookup")).collect();
    assert_eq!(lines.len(), 3, "two hits, then the miss on block 2:\n{log}");
    assert!(
        lines[0].contains("position=0")
            && lines[0].contains("hit=true")
            && lines[0].contains("hash=Some(BlockHash(")
    );
    assert!(lines[2].contains("position=2") && lines[2].contains("hit=false"));
}
