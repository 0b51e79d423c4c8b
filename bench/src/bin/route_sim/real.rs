//! Instances that are real prefix caches — a `BlockPool` of `--capacity`
//! blocks whose cached blocks are reclaimed least recently used first, a
//! `HashChainIndex` watched for KV events — and the router that knows them
//! only from those events, as a KV-aware router (Dynamo, llm-d) knows
//! `kvforge serve --kv-events`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use kvforge_pool::{BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, StorageFormat};
use kvforge_prefix::{
    BlockRef, EventSink, ExtraKeys, HashChainIndex, KvEvent, PrefixMatcher, Watched, acquire_prefix,
};

/// Events an instance published and no router has read yet.
type Feed = Arc<Mutex<Vec<KvEvent>>>;

struct Sink(Feed);

impl EventSink for Sink {
    fn publish(&mut self, _namespace: &str, events: Vec<KvEvent>) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(events);
    }
}

/// One instance's prefix cache.
pub(crate) struct Instance {
    pool: BlockPool,
    index: Watched<HashChainIndex>,
    feed: Feed,
    bs: usize,
}

impl Instance {
    /// A cache of `capacity` blocks of `bs` tokens.
    pub(crate) fn new(capacity: usize, bs: usize) -> Result<Instance> {
        let layout = KvLayout::new(1, 1, 8, u32::try_from(bs)?, StorageFormat::F16)?;
        let pool = BlockPool::new(layout, PoolConfig::fixed(capacity))?;
        let feed = Feed::default();
        let index = HashChainIndex::with_seed(bs, 1)?;
        let index = Watched::new(index, Box::new(Sink(feed.clone())), 0);
        Ok(Instance {
            pool,
            index,
            feed,
            bs,
        })
    }

    /// Blocks of `tokens` (whole blocks) cached here now: what a router
    /// that reads the index itself would see.
    pub(crate) fn peek(&mut self, tokens: &[u32]) -> usize {
        self.index
            .peek_prefix(tokens, &ExtraKeys::default())
            .blocks
            .len()
    }

    /// Serves a prompt of `tokens` (whole blocks) as the engine does:
    /// takes the cached prefix, computes the rest into fresh blocks (the
    /// pool reclaiming cached ones, which the index forgets), registers
    /// them and releases the sequence. Returns the blocks it hit.
    pub(crate) fn serve(&mut self, tokens: &[u32]) -> Result<usize> {
        let ns = ExtraKeys::default();
        let m = acquire_prefix(&mut self.index, &self.pool, tokens, &ns)?;
        let hit = m.blocks.len();
        let st = self.pool.stats();
        let room = st.max_blocks.saturating_sub(st.in_use);
        let want = (tokens.len() / self.bs - hit).min(room);
        let fresh = self.pool.allocate(want).unwrap_or_default();
        self.index.forget_all(&fresh.reclaimed);
        let mut refs = m.blocks;
        let bs = self.bs as u32;
        refs.extend(fresh.blocks.iter().map(|&b| BlockRef::new(b, bs)));
        let covered = refs.len() * self.bs;
        let out = self.index.insert(&tokens[..covered], &ns, &refs)?;
        let first = out.already_cached;
        for r in &refs[first..first + out.new] {
            self.pool.mark_cached(r.block)?;
        }
        let ids: Vec<BlockId> = refs.iter().map(|r| r.block).collect();
        self.pool.release_sequence(&ids)?;
        Ok(hit)
    }

    /// The events published since the last call.
    pub(crate) fn drain(&self) -> Vec<KvEvent> {
        std::mem::take(&mut *self.feed.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// What the router knows of one instance: the blocks its events stored
/// and did not remove, by place (the parent's key and the block's tokens)
/// — so the router needs neither the instance's hash seed nor its
/// namespaces.
#[derive(Default)]
pub(crate) struct View {
    by_place: HashMap<(Option<u64>, Vec<u32>), u64>,
    by_key: HashMap<u64, (Option<u64>, Vec<u32>)>,
}

impl View {
    /// Replays `events` in order.
    pub(crate) fn apply(&mut self, events: Vec<KvEvent>) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                } => {
                    let mut parent = parent_block_hash;
                    for (k, toks) in block_hashes.iter().zip(token_ids.chunks(block_size)) {
                        let place = (parent, toks.to_vec());
                        self.by_place.insert(place.clone(), *k);
                        self.by_key.insert(*k, place);
                        parent = Some(*k);
                    }
                }
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for k in block_hashes {
                        if let Some(place) = self.by_key.remove(&k) {
                            self.by_place.remove(&place);
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.by_place.clear();
                    self.by_key.clear();
                }
            }
        }
    }

    /// Leading blocks of `tokens` the instance holds, as far as its events
    /// tell.
    pub(crate) fn lead(&self, tokens: &[u32], bs: usize) -> usize {
        let mut parent = None;
        let mut n = 0;
        for b in tokens.chunks_exact(bs) {
            match self.by_place.get(&(parent, b.to_vec())) {
                Some(&k) => parent = Some(k),
                None => break,
            }
            n += 1;
        }
        n
    }

    /// Blocks it knows of.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64: reproducible prompts.
    fn next(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[test]
    fn a_view_fed_by_events_sees_what_the_index_holds_under_reclaim() {
        let bs = 4;
        let mut inst = Instance::new(12, bs).unwrap();
        let mut view = View::default();
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        let mut removed = 0;
        for _ in 0..400 {
            // Prompts that share prefixes (a few first tokens) and diverge.
            let blocks = 1 + (next(&mut seed) % 6) as usize;
            let toks: Vec<u32> = (0..blocks * bs)
                .map(|p| {
                    if p < 6 {
                        (next(&mut seed) % 2) as u32
                    } else {
                        (next(&mut seed) % 50) as u32
                    }
                })
                .collect();
            inst.serve(&toks).unwrap();
            let events = inst.drain();
            removed += events
                .iter()
                .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
                .count();
            view.apply(events);
            for probe in [&toks[..], &toks[..bs]] {
                assert_eq!(view.lead(probe, bs), inst.peek(probe));
            }
            assert!(view.len() <= 12);
        }
        assert!(removed > 0, "the pool never reclaimed");
    }
}
