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
fn bad_block_sizes_are_rejected() {
    assert!(HashChainIndex::new(0).is_err());
    assert!(RadixIndex::new(0).is_err());
    for bs in [kvforge_prefix::MAX_BLOCK_SIZE + 1, usize::MAX / 8] {
        let e = HashChainIndex::with_seed(bs, 1).unwrap_err();
        assert!(e.to_string().contains("exceeds the maximum"), "{e}");
        assert!(RadixIndex::new(bs).is_err());
    }
}

#[test]
fn a_block_slot_near_u32_max_costs_one_entry() {
    // Slot tables are maps: memory follows live entries, not the largest slot.
    for mut idx in [
        Box::new(HashChainIndex::with_seed(2, 1).unwrap()) as Box<dyn PrefixMatcher>,
        Box::new(RadixIndex::new(2).unwrap()),
    ] {
        let e = ExtraKeys::default();
        let b = BlockId::new(u32::MAX - 1, 1);
        idx.insert(&[1, 2], &e, &[BlockRef::new(b, 2)]).unwrap();
        assert_eq!(
            idx.match_prefix(&[1, 2], &e).blocks,
            vec![BlockRef::new(b, 2)]
        );
        assert!(idx.forget(b));
    }
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
    /// The longest path, trying longer blocks first; ties keep the first.
    fn match_prefix(&self, tokens: &[u32], e: &ExtraKeys) -> PrefixMatch {
        let mut best = PrefixMatch::default();
        self.walk(tokens, e, &mut Vec::new(), &mut Vec::new(), &mut best);
        best
    }

    fn walk(
        &self,
        tokens: &[u32],
        e: &ExtraKeys,
        path: &mut Vec<Vec<u32>>,
        refs: &mut Vec<BlockRef>,
        best: &mut PrefixMatch,
    ) {
        let pos: usize = refs.iter().map(|b| b.len as usize).sum();
        let rest = &tokens[pos..];
        for len in (1..=self.bs.min(rest.len())).rev() {
            path.push(rest[..len].to_vec());
            if let Some(&b) = self.paths.get(&(e.clone(), path.clone())) {
                refs.push(BlockRef::new(b, len as u32));
                if pos + len > best.tokens {
                    *best = PrefixMatch {
                        blocks: refs.clone(),
                        tokens: pos + len,
                    };
                }
                self.walk(tokens, e, path, refs, best);
                refs.pop();
            }
            path.pop();
        }
    }

    /// Returns whether a block was refused (its handle indexed elsewhere).
    fn insert(&mut self, tokens: &[u32], e: &ExtraKeys, blocks: &[BlockRef]) -> bool {
        // A reused slot (newer epoch) drops whatever it held before.
        for b in blocks {
            let stale: Vec<BlockId> = self
                .paths
                .values()
                .filter(|v| v.index() == b.block.index() && v.epoch() < b.block.epoch())
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
            let key = (e.clone(), path.clone());
            if self.paths.contains_key(&key) {
                continue;
            }
            if self.paths.values().any(|v| v.index() == b.block.index()) {
                // Indexed elsewhere (or newer): refused, insertion stops.
                return true;
            }
            self.paths.insert(key, b.block);
        }
        false
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

    fn namespaces(&self) -> usize {
        let mut ns: Vec<&ExtraKeys> = self.paths.keys().map(|(e, _)| e).collect();
        ns.sort_by(|a, b| a.namespace.cmp(&b.namespace));
        ns.dedup();
        ns.len()
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
    /// Insert a sequence whose first new block reuses a handle the index
    /// already holds elsewhere (must be refused).
    Alias {
        ns: u8,
        parts: Vec<u8>,
        pick: usize,
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
        (0u8..2, prop::collection::vec(0u8..4, 1..6), any::<usize>())
            .prop_map(|(ns, parts, pick)| Op::Alias { ns, parts, pick }),
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
                    let (c, r) = (chain.insert(&t, &e, &blocks).unwrap(), radix.insert(&t, &e, &blocks).unwrap());
                    prop_assert_eq!(c, r);
                    prop_assert!(!model.insert(&t, &e, &blocks));
                }
                Op::Alias { ns, parts, pick } => {
                    let e = ExtraKeys::namespace(format!("ns{ns}"));
                    let t = tokens_of(&parts);
                    let held: Vec<BlockId> = model.paths.values().copied().collect();
                    if held.is_empty() || t.len() < bs {
                        continue;
                    }
                    let hit = model.match_prefix(&t, &e);
                    let alias = held[pick % held.len()];
                    if hit.blocks.iter().any(|h| h.block == alias) {
                        continue;
                    }
                    epoch += 1;
                    let mut avoid = hit.blocks.clone();
                    avoid.push(BlockRef::new(alias, 1));
                    let mut fresh = layout_blocks(t.len() - hit.tokens, bs, true, 140, epoch, &avoid);
                    let Some(first) = fresh.first_mut() else { continue };
                    first.block = alias;
                    let mut blocks = hit.blocks.clone();
                    blocks.extend(fresh);
                    let (c, r) = (chain.insert(&t, &e, &blocks).unwrap(), radix.insert(&t, &e, &blocks).unwrap());
                    prop_assert_eq!(c, r);
                    // Refused unless reusing a slot removed the alias first.
                    let refused = model.insert(&t, &e, &blocks);
                    prop_assert_eq!(c.already_indexed, usize::from(refused));
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
            prop_assert_eq!(chain.stats().cached_blocks as usize, model.paths.len());
            prop_assert_eq!(radix.stats().namespaces as usize, model.namespaces());
            prop_assert_eq!(chain.stats().namespaces as usize, model.namespaces());
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

// ----------------------------------------------------------------------------
// Safety against the true block contents, through a real pool.

/// One request of the content test.
#[derive(Clone, Debug)]
struct Request {
    ns: u8,
    parts: Vec<u8>,
    seal: bool,
    /// Forget a random indexed block too (as if freed for good).
    forget: Option<usize>,
}

fn request() -> impl Strategy<Value = Request> {
    (
        0u8..4,
        prop::collection::vec(0u8..4, 1..7),
        any::<bool>(),
        prop::option::weighted(0.1, any::<usize>()),
    )
        .prop_map(|(ns, parts, seal, forget)| Request {
            ns,
            parts,
            seal,
            forget,
        })
}

/// Serves `reqs` through `idx` over a small pool, as an engine would:
/// acquire the cached prefix, allocate the rest, register, release. Every
/// acquired block must hold exactly the query's tokens at its place in the
/// query's namespace (its true content, tracked here per handle). With
/// `strict`, reclaimed blocks are forwarded to `forget`; without, the index
/// learns of them only through `acquire_prefix` (stale epochs).
/// Returns the tokens reused per request.
fn serve(idx: &mut dyn PrefixMatcher, reqs: &[Request], strict: bool) -> Vec<usize> {
    let bs = idx.block_size();
    let pool = pool(12);
    let mut truth: HashMap<BlockId, (u8, Vec<u32>)> = HashMap::new();
    let mut indexed: Vec<BlockId> = Vec::new();
    let mut reused = Vec::new();
    for r in reqs {
        let e = ExtraKeys::namespace(format!("ns{}", r.ns));
        let t = tokens_of(&r.parts);
        let m = acquire_prefix(idx, &pool, &t, &e).unwrap();
        let mut end = 0;
        for b in &m.blocks {
            end += b.len as usize;
            let want = (r.ns, t[..end].to_vec());
            assert_eq!(
                truth.get(&b.block),
                Some(&want),
                "wrong KV for {:?}",
                b.block
            );
        }
        let mut lens = vec![bs; (t.len() - m.tokens) / bs];
        if r.seal && (t.len() - m.tokens) % bs > 0 {
            lens.push((t.len() - m.tokens) % bs);
        }
        let mut held: Vec<BlockId> = m.blocks.iter().map(|b| b.block).collect();
        let Some(a) = pool.allocate(lens.len()) else {
            pool.release_sequence(&held).unwrap();
            reused.push(0);
            continue;
        };
        if strict {
            idx.forget_all(&a.reclaimed);
        }
        let mut blocks = m.blocks.clone();
        for (&b, &len) in a.blocks.iter().zip(&lens) {
            end += len;
            truth.insert(b, (r.ns, t[..end].to_vec()));
            blocks.push(BlockRef::new(b, len as u32));
        }
        idx.insert(&t, &e, &blocks).unwrap();
        held.extend(&a.blocks);
        for &b in &held {
            pool.mark_cached(b).unwrap();
        }
        indexed.extend(&a.blocks);
        if let (Some(k), false) = (r.forget, indexed.is_empty()) {
            idx.forget(indexed[k % indexed.len()]);
        }
        pool.release_sequence(&held).unwrap();
        reused.push(m.tokens);
    }
    assert_eq!(pool.stats().in_use, 0, "every reference was given back");
    reused
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn no_wrong_kv_and_both_indexes_agree(
        bs in 1usize..5,
        strict in any::<bool>(),
        reqs in prop::collection::vec(request(), 1..50),
    ) {
        let mut chain = HashChainIndex::with_seed(bs, 9).unwrap();
        let mut radix = RadixIndex::new(bs).unwrap();
        let a = serve(&mut chain, &reqs, strict);
        let b = serve(&mut radix, &reqs, strict);
        prop_assert_eq!(a, b);
    }
}

/// An index shared by threads: every call takes the lock, so two
/// `acquire_prefix` calls run their retains at the same time.
struct Shared(std::sync::Arc<std::sync::Mutex<Box<dyn PrefixMatcher>>>);

impl PrefixMatcher for Shared {
    fn block_size(&self) -> usize {
        self.0.lock().unwrap().block_size()
    }
    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        self.0.lock().unwrap().match_prefix(tokens, extra)
    }
    fn peek_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        self.0.lock().unwrap().peek_prefix(tokens, extra)
    }
    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> kvforge_prefix::Result<kvforge_prefix::Inserted> {
        self.0.lock().unwrap().insert(tokens, extra, blocks)
    }
    fn forget(&mut self, block: BlockId) -> bool {
        self.0.lock().unwrap().forget(block)
    }
    fn relocate(&mut self, old: BlockId, new: BlockId) -> bool {
        self.0.lock().unwrap().relocate(old, new)
    }
    fn extend(
        &mut self,
        parent: BlockRef,
        end: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
    ) -> kvforge_prefix::Result<Option<kvforge_prefix::Inserted>> {
        self.0.lock().unwrap().extend(parent, end, tokens, blocks)
    }
    fn stats(&self) -> kvforge_prefix::MatchStats {
        self.0.lock().unwrap().stats()
    }
}

/// Two threads acquire and release the same cached prefix (a shared system
/// prompt) 20,000 times each, in a pool that holds just that prefix, so
/// their revivals of its free blocks overlap: every acquisition gets the
/// whole match, and nothing is forgotten from the index.
#[test]
fn concurrent_acquirers_of_one_prefix_both_get_it_whole() {
    use std::sync::{Arc, Mutex};
    for kind in ["chain", "radix"] {
        let idx: Box<dyn PrefixMatcher> = match kind {
            "chain" => Box::new(HashChainIndex::with_seed(4, 1).unwrap()),
            _ => Box::new(RadixIndex::new(4).unwrap()),
        };
        let idx = Arc::new(Mutex::new(idx));
        let p = pool(2);
        let e = ExtraKeys::default();
        let t: Vec<u32> = (0..8).collect();
        cache_sequence(&p, idx.lock().unwrap().as_mut(), &t, &e);
        let short: Vec<usize> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let (mut shared, p, e, t) = (Shared(idx.clone()), &p, &e, &t);
                    s.spawn(move || {
                        let mut short = 0;
                        for _ in 0..20_000 {
                            let m = acquire_prefix(&mut shared, p, t, e).unwrap();
                            short += usize::from(m.tokens != 8);
                            let held: Vec<BlockId> = m.blocks.iter().map(|b| b.block).collect();
                            p.release_sequence(&held).unwrap();
                        }
                        short
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(short, vec![0, 0], "{kind}: acquisitions cut short");
        let s = idx.lock().unwrap().stats();
        assert_eq!((s.cached_blocks, s.forgotten_blocks), (2, 0), "{kind}");
        assert_eq!(p.stats().in_use, 0);
    }
}
