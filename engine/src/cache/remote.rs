//! The cache's link to a shared remote tier ([`kvforge_remote`]): the
//! caches blocks travel through and their scopes; after a request, the
//! full blocks it registered are offered for writing behind. What comes
//! back in (a lookup after a local prefix hit, and its import) is
//! `import.rs`.
//!
//! Blocks travel in one of two formats, part of every key: the hot tier's
//! dtype (`f16`, `f32`, `bf16`: each layer's K then V rows, `[block_size,
//! kv_heads, head_dim]`, native byte order), or the cold tier's quantized
//! bytes ([`ColdBlock::content`]; hot blocks are quantized to be written).
//! Every remote failure is a miss: the prompt is computed instead.

use std::sync::Arc;
use std::time::Duration;

use kvforge_coordinator::TieredPool;
use kvforge_coordinator::{Coordinator, SeqId};
use kvforge_pool::{Slot, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_remote::{
    Link, RemoteCache, RemoteOptions, RemoteStats, RemoteTier, Scope, Secret, StatsSource,
};

use super::*;

/// How a cache shares its blocks through a remote tier.
#[derive(Clone)]
pub struct RemoteSetup {
    /// The store.
    pub store: Arc<dyn RemoteTier>,
    /// The cluster's secret (the same on every instance): blobs are
    /// authenticated under it and keys live in its key space.
    pub secret: Secret,
    /// The cluster-wide hash seed (the same on every instance).
    pub seed: u64,
    /// The model's fingerprint ([`Engine::fingerprint`](crate::Engine::fingerprint)).
    pub model: u128,
    /// Blocks travel as the cold tier's quantized bytes (else at the hot
    /// tier's dtype).
    pub cold: bool,
    /// Queue and lookup bounds.
    pub options: RemoteOptions,
}

/// Which cache a block travels through: the hot dtype, or the cold
/// tier's bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    Hot,
    Cold,
}

pub(super) struct RemoteLink {
    /// Blocks at the KV dtype: every block in hot mode; the cold tier's
    /// sink blocks (kept in full precision) in cold mode.
    hot: Option<Arc<RemoteCache>>,
    /// Blocks as the cold tier's bytes (cold mode).
    cold: Option<Arc<RemoteCache>>,
    /// Blocks before this index travel hot.
    hot_blocks: usize,
    setup: RemoteSetup,
}

/// Blocks copied out for the remote tier: how each travels, its link,
/// the range of its tokens, its payload.
pub(super) type Outgoing = Vec<(Part, Link, std::ops::Range<usize>, Vec<u8>)>;

impl RemoteLink {
    pub(super) fn cache(&self, part: Part) -> Option<&Arc<RemoteCache>> {
        match part {
            Part::Hot => self.hot.as_ref(),
            Part::Cold => self.cold.as_ref(),
        }
    }

    fn caches(&self) -> impl Iterator<Item = &Arc<RemoteCache>> {
        self.hot.iter().chain(&self.cold)
    }

    fn scopes(&self) -> Vec<Scope> {
        self.caches().map(|c| c.scope().clone()).collect()
    }

    /// Runs of consecutive blocks of `range` that travel alike.
    pub(super) fn runs(
        &self,
        range: std::ops::Range<usize>,
    ) -> Vec<(Part, std::ops::Range<usize>)> {
        let cut = self.hot_blocks.clamp(range.start, range.end);
        [(Part::Hot, range.start..cut), (Part::Cold, cut..range.end)]
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }
}

impl PagedKvCache {
    /// The scope of this cache's blocks travelling as `part` under `setup`.
    fn remote_scope(&self, setup: &RemoteSetup, part: Part) -> Result<Scope> {
        let (format, payload_bytes) = match part {
            Part::Cold => {
                let t = self.cold.as_ref().ok_or_else(|| {
                    EngineError::Request("a remote tier of cold blocks needs a cold tier".into())
                })?;
                let name = format!("cold-{}", t.spec().content_name());
                (name, t.content_bytes(self.k.len()) as u64)
            }
            Part::Hot => {
                let name = match self.hot_layout.format() {
                    StorageFormat::F32 => "f32",
                    StorageFormat::BF16 => "bf16",
                    StorageFormat::F16 => "f16",
                    other => {
                        return Err(EngineError::Request(format!(
                            "a hot tier in {other:?} cannot be shared"
                        )));
                    }
                };
                (name.to_string(), self.hot_layout.block_bytes())
            }
        };
        Ok(Scope {
            seed: setup.seed,
            model: setup.model,
            layers: self.k.len() as u32,
            kv_heads: self.shape.heads as u32,
            head_dim: self.shape.head_dim as u32,
            block_size: self.block_size as u32,
            format,
            payload_bytes,
        })
    }

    fn remote_link(&self, s: RemoteSetup) -> Result<RemoteLink> {
        let cache = |part| -> Result<Arc<RemoteCache>> {
            Ok(Arc::new(RemoteCache::new(
                s.store.clone(),
                self.remote_scope(&s, part)?,
                s.secret.clone(),
                s.options,
            )))
        };
        // In cold mode the sink stays in full precision: it travels hot.
        let sink = match (&self.cold, s.cold) {
            (Some(t), true) => t.spec().sink / self.block_size,
            _ => usize::MAX,
        };
        Ok(RemoteLink {
            hot: (sink > 0).then(|| cache(Part::Hot)).transpose()?,
            cold: s.cold.then(|| cache(Part::Cold)).transpose()?,
            hot_blocks: sink,
            setup: s,
        })
    }

    /// Shares this cache's blocks through `setup`'s store (`None`: stops).
    /// Set it after [`configure`](Self::configure): a reconfiguration that
    /// changes the blocks' format drops the link.
    pub fn set_remote(&mut self, setup: Option<RemoteSetup>) -> Result<()> {
        self.remote = setup.map(|s| self.remote_link(s)).transpose()?;
        Ok(())
    }

    /// Keeps the remote link only if the blocks' scopes are unchanged.
    pub(super) fn recheck_remote(&mut self) {
        if let Some(r) = self.remote.take() {
            if let Ok(again) = self.remote_link(r.setup.clone()) {
                if again.scopes() == r.scopes() && again.hot_blocks == r.hot_blocks {
                    self.remote = Some(r);
                }
            }
        }
    }

    /// The remote tier's counters (`None`: no remote tier).
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        self.remote_stats_source().map(|s| s.read())
    }

    /// A handle on the remote tier's live counters, readable from another
    /// thread whenever it likes (`None`: no remote tier).
    pub fn remote_stats_source(&self) -> Option<StatsSource> {
        self.remote.as_ref().map(|r| {
            r.caches()
                .map(|c| c.stats_source())
                .fold(StatsSource::default(), StatsSource::join)
        })
    }

    /// Waits, at most `timeout` each, until every block queued for the
    /// remote tier was written; whether it was (true without one).
    pub fn remote_flush(&self, timeout: Duration) -> bool {
        self.remote
            .as_ref()
            .is_none_or(|r| r.caches().all(|c| c.flush(timeout)))
    }

    /// Under the lock of `register`: the blocks to offer — the first
    /// `covered` tokens' full blocks of `id` that the remote tier does not
    /// hold yet (as far as it knows), their content copied out while no
    /// other step can change them.
    pub(super) fn export_remote(
        &self,
        c: &Coordinator,
        id: SeqId,
        tokens: &[u32],
        extra: &ExtraKeys,
        covered: usize,
    ) -> Outgoing {
        let (Some(r), Ok(table)) = (&self.remote, c.table(id)) else {
            return Vec::new();
        };
        let bs = self.block_size;
        let full = table
            .entries()
            .iter()
            .take_while(|e| e.tokens() as usize == bs)
            .count()
            .min(covered / bs);
        let mut out = Vec::new();
        for (part, run) in r.runs(0..full) {
            let Some(cache) = r.cache(part) else { break };
            let links = cache.chain(&tokens[..run.end * bs], extra);
            for i in run {
                if !cache.wants(links[i].key) {
                    continue;
                }
                let e = &table.entries()[i];
                let payload = match (e.slot(), &self.cold, part) {
                    (Slot::Hot(b), _, Part::Hot) => self.read_hot(TieredPool::slot_of(b) as usize),
                    (Slot::Hot(b), Some(t), Part::Cold) => {
                        let base = TieredPool::slot_of(b) as usize * bs;
                        t.quantize(&self.k, &self.v, base).map(|q| q.content())
                    }
                    (Slot::Cold(b), Some(t), Part::Cold) => t
                        .get(TieredPool::slot_of(b) as usize)
                        .map(|q| q.content())
                        .ok_or_else(|| EngineError::Request("a cold block without content".into())),
                    // Not shareable in this format (a cold entry in hot
                    // mode): the chain's rest is not offered.
                    _ => return out,
                };
                match payload {
                    Ok(p) => out.push((part, links[i], i * bs..(i + 1) * bs, p)),
                    Err(_) => return out,
                }
            }
        }
        out
    }

    /// Offers what [`export_remote`](Self::export_remote) copied out, for
    /// writing behind (after the lock is released).
    pub(super) fn offer_remote(&self, tokens: &[u32], blocks: Outgoing) {
        let Some(r) = &self.remote else { return };
        for (part, link, range, payload) in blocks {
            if let Some(cache) = r.cache(part) {
                cache.offer(link, &tokens[range], &payload);
            }
        }
    }

    /// Hot block `slot`'s K and V rows of every layer, as bytes.
    fn read_hot(&self, slot: usize) -> Result<Vec<u8>> {
        let (bs, n) = (self.block_size as i64, self.shape.len());
        let per = self.hot_layout.block_bytes() as usize / (2 * self.k.len());
        let mut out = vec![0u8; per * 2 * self.k.len()];
        for (i, t) in self
            .k
            .iter()
            .zip(&self.v)
            .flat_map(|(k, v)| [k, v])
            .enumerate()
        {
            let rows = t
                .f_narrow(0, slot as i64 * bs, bs)?
                .f_to_device(Device::Cpu)?
                .f_contiguous()?;
            rows.f_copy_data_u8(&mut out[i * per..(i + 1) * per], n)?;
        }
        Ok(out)
    }
}
