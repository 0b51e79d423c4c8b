//! What the engine feeds the policies: attention mass and key novelty for
//! eviction, quantized blocks for sharing.

use kvforge_lsh::Content;
use kvforge_pool::{BlockAllocator, BlockId, Retained, Slot};

use crate::error::{CoordError, Result};
use crate::plan::{Grain, Wants};

use super::{Coordinator, SeqId};

impl Coordinator {
    /// What a step's [`Plan`](crate::Plan) asks the engine to observe
    /// ([`Plan::wants`](crate::Plan::wants)), the same for every step until
    /// a policy is replaced.
    pub fn wants(&self) -> Wants {
        let grain = if self.per_lane() {
            Grain::Lane
        } else if self.token_level() {
            Grain::Row
        } else {
            Grain::Entry
        };
        Wants {
            attention: self.wants_attention(),
            keys: self.wants_keys(),
            window: self.observation_window(),
            grain,
            share: self.dedup.is_some(),
            share_vectors: self.share_wants_vectors(),
        }
    }

    /// Whether the deduplicator compares dequantized vectors (fill
    /// [`Content::vector`] for [`share`](Self::share)).
    fn share_wants_vectors(&self) -> bool {
        self.dedup.as_ref().is_some_and(|d| d.wants_vectors())
    }

    /// Offers a cold block this step quantized to the deduplicator, which
    /// reads candidates' contents through `stored` (`None`: gone). When it
    /// names a canonical block, the entry becomes an alias of it and the
    /// new block is freed at commit. Returns the canonical block, if any.
    pub fn share(
        &mut self,
        seq: SeqId,
        cold: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>> {
        let r = self.share_call(seq, cold, content, stored);
        self.checked(r)
    }

    fn share_call(
        &mut self,
        seq: SeqId,
        cold: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>> {
        let Some(d) = self.dedup.as_mut() else {
            return Ok(None);
        };
        let s = self.seqs.get_mut(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let Some(p) = s.pending.as_mut().filter(|p| p.fresh_cold.contains(&cold)) else {
            return Err(CoordError::Order {
                seq,
                what: "shared a block this step did not quantize",
            });
        };
        // Its content is written (it is offered): others may read it now.
        p.written.retain(|&(b, _)| b != cold);
        let Some(canonical) = d.offer(cold, content, stored)? else {
            return Ok(None);
        };
        match self.tiers.retain(canonical) {
            Ok(Retained::Held(_)) => {}
            _ => {
                d.forget(canonical);
                return Ok(None);
            }
        }
        let Some(i) = p
            .next
            .entries()
            .iter()
            .position(|e| e.slot() == Slot::Cold(cold))
        else {
            let _ = self.tiers.release(canonical);
            return Ok(None);
        };
        p.next.set_slot(i, Slot::Alias { canonical })?;
        p.taken.push(canonical);
        p.release.push(cold);
        // The entry reads another block's content now (a near duplicate
        // under SimHash): neither the index nor a second holder of the hot
        // block may take the canonical for this block's copy.
        p.demoted.retain(|d| d.1 != cold);
        Ok(Some(canonical))
    }

    /// Feeds the attention mass each entry of [`view`](Self::view) received
    /// in the step to the eviction policy (if it wants it); for a per-lane
    /// policy one value per entry and lane, as for
    /// [`observe_keys`](Self::observe_keys).
    pub fn observe(&mut self, seq: SeqId, mass: &[f32]) -> Result<()> {
        self.feed_policy(seq, mass, false)
    }

    /// Feeds each entry's key novelty (`1 − cos(key, mean key)`, averaged
    /// over its keys, heads and layers) in the step to the eviction policy
    /// (if it wants it). For a per-lane policy ([`per_lane`](Self::per_lane)):
    /// one value per entry and lane, entry after entry, lane `layer ×
    /// kv_heads + head`, averaged over the entry's keys only.
    pub fn observe_keys(&mut self, seq: SeqId, novelty: &[f32]) -> Result<()> {
        self.feed_policy(seq, novelty, true)
    }

    /// [`observe`](Self::observe), or with `keys`
    /// [`observe_keys`](Self::observe_keys): one value per entry of the
    /// step's table.
    fn feed_policy(&mut self, seq: SeqId, values: &[f32], keys: bool) -> Result<()> {
        let Some(ev) = self.evict.as_mut() else {
            return Ok(());
        };
        let s = self.seqs.get(&seq).ok_or(CoordError::UnknownSeq(seq))?;
        let t = s.pending.as_ref().map_or(&s.table, |p| &p.next);
        let per_entry = if ev.per_lane() {
            self.lanes
        } else if ev.token_level() {
            t.block_size() as usize
        } else {
            1
        };
        if values.len() != t.entries().len() * per_entry {
            let what = if keys {
                "key novelty for another number of entries"
            } else {
                "attention mass for another number of entries"
            };
            return Err(CoordError::Order { seq, what });
        }
        if keys {
            ev.observe_keys(seq, t, values);
        } else {
            ev.observe(seq, t, values);
        }
        Ok(())
    }

    /// Whether the eviction policy wants key novelty.
    fn wants_keys(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.wants_keys())
    }

    /// Whether the eviction policy ranks pages per lane (one layer's one
    /// KV head): it then wants key novelty per entry and lane.
    fn per_lane(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.per_lane())
    }

    /// Whether the eviction policy names single tokens: it then wants its
    /// signals per row of the table (`entries × block_size`).
    fn token_level(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.token_level())
    }

    /// Whether the eviction policy wants attention mass (per entry and
    /// lane for a [`per_lane`](Self::per_lane) policy).
    fn wants_attention(&self) -> bool {
        self.evict.as_ref().is_some_and(|e| e.wants_attention())
    }

    /// How many of a step's last queries the attention mass should come
    /// from (SnapKV's observation window); 0 for all of them.
    fn observation_window(&self) -> usize {
        self.evict.as_ref().map_or(0, |e| e.observation_window())
    }
}
