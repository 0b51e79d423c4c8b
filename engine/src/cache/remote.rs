//! The cache's link to a shared remote tier ([`kvforge_remote`]): after a
//! local prefix hit, the next full blocks of the prompt are asked for in
//! one round and imported (verified) into the sequence's own blocks; after
//! a request, the full blocks it registered are offered for writing behind.
//!
//! Blocks travel in one of two formats, part of every key: the hot tier's
//! dtype (`f16`, `f32`, `bf16`: each layer's K then V rows, `[block_size,
//! kv_heads, head_dim]`, native byte order), or the cold tier's quantized
//! bytes ([`ColdBlock::content`]; hot blocks are quantized to be written).
//! Every remote failure is a miss: the prompt is computed instead.

use std::sync::Arc;
use std::time::Duration;

use kvforge_coordinator::{COLD, HOT, TieredPool};
use kvforge_coordinator::{Coordinator, SeqId};
use kvforge_pool::{Slot, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_remote::{Link, RemoteCache, RemoteOptions, RemoteStats, RemoteTier, Scope};

use super::*;

/// How a cache shares its blocks through a remote tier.
#[derive(Clone)]
pub struct RemoteSetup {
    /// The store.
    pub store: Arc<dyn RemoteTier>,
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
    hot: Option<RemoteCache>,
    /// Blocks as the cold tier's bytes (cold mode).
    cold: Option<RemoteCache>,
    /// Blocks before this index travel hot.
    hot_blocks: usize,
    setup: RemoteSetup,
}

/// Blocks copied out for the remote tier: how each travels, its link,
/// the range of its tokens, its payload.
pub(super) type Outgoing = Vec<(Part, Link, std::ops::Range<usize>, Vec<u8>)>;

impl RemoteLink {
    fn cache(&self, part: Part) -> Option<&RemoteCache> {
        match part {
            Part::Hot => self.hot.as_ref(),
            Part::Cold => self.cold.as_ref(),
        }
    }

    fn caches(&self) -> impl Iterator<Item = &RemoteCache> {
        self.hot.iter().chain(&self.cold)
    }

    fn scopes(&self) -> Vec<Scope> {
        self.caches().map(|c| c.scope().clone()).collect()
    }

    /// Runs of consecutive blocks of `range` that travel alike.
    fn runs(&self, range: std::ops::Range<usize>) -> Vec<(Part, std::ops::Range<usize>)> {
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
        let cache = |part| -> Result<RemoteCache> {
            Ok(RemoteCache::new(
                s.store.clone(),
                self.remote_scope(&s, part)?,
                s.options,
            ))
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
        self.remote.as_ref().map(|r| {
            let mut st = RemoteStats::default();
            r.caches().for_each(|c| st.add(&c.stats()));
            st
        })
    }

    /// Waits, at most `timeout` each, until every block queued for the
    /// remote tier was written; whether it was (true without one).
    pub fn remote_flush(&self, timeout: Duration) -> bool {
        self.remote
            .as_ref()
            .is_none_or(|r| r.caches().all(|c| c.flush(timeout)))
    }

    /// After `open`: the full blocks of `tokens[..len - 1]` after the local
    /// hit, from the remote tier, appended to `seq` (its length grows by
    /// their tokens) — the leading ones that verify and fit the budget,
    /// asked for only as far as they fit. No store call runs under the
    /// coordinator's lock; the blocks are filled under it. Anything that
    /// fails leaves `seq` as opened.
    pub(super) fn import_remote(&self, seq: &mut Sequence, tokens: &[u32], extra: &ExtraKeys) {
        let (Some(r), Some(id)) = (&self.remote, seq.id) else {
            return;
        };
        let bs = self.block_size;
        let full = tokens.len().saturating_sub(1) / bs;
        if seq.len % bs != 0 || seq.len / bs >= full {
            return;
        }
        let mut added = 0;
        for (part, run) in r.runs(seq.len / bs..full) {
            let (Some(cache), tier) = (r.cache(part), if part == Part::Hot { HOT } else { COLD })
            else {
                break;
            };
            let room = self.coordinator().import_room(id, tier);
            let asked = run.start..run.end.min(run.start + room);
            let links = cache.chain(&tokens[..asked.end * bs], extra);
            let payloads = cache.fetch(
                &links[asked.clone()],
                &tokens[asked.start * bs..asked.end * bs],
            );
            match self.fill(id, part, asked.start * bs, &payloads) {
                // Fewer than the whole run (cut by room, a miss, a block
                // that did not verify, the budget): the blocks after it
                // would not follow on. The import ends here.
                Ok(n) if n < run.len() => {
                    added += n;
                    break;
                }
                Ok(n) => added += n,
                Err(e) => {
                    // Cut the imported blocks off again: close, reopen locally.
                    tracing::warn!("remote blocks not imported: {e}");
                    if self.free(seq).is_ok() {
                        if let Ok(s) = self.coordinator().open(tokens, extra) {
                            *seq = Sequence {
                                id: Some(s.seq),
                                len: s.reused,
                            };
                        }
                    }
                    return;
                }
            }
        }
        seq.len += added * bs;
    }

    /// Appends fresh blocks for `payloads` (the KV of positions `at..`) to
    /// `id` and writes them, all under the coordinator's lock (no other
    /// step can take them before they hold their KV). Returns how many the
    /// budget let in.
    fn fill(&self, id: SeqId, part: Part, at: usize, payloads: &[Vec<u8>]) -> Result<usize> {
        if payloads.is_empty() {
            return Ok(0);
        }
        let mut c = self.coordinator();
        let tier = if part == Part::Hot { HOT } else { COLD };
        let blocks = c.import(id, tier, at as u64, payloads.len())?;
        for (&b, p) in blocks.iter().zip(payloads) {
            match (&self.cold, part) {
                (Some(t), Part::Cold) => {
                    t.put(b, Arc::new(t.block_of_content(self.k.len(), p)?))?
                }
                _ => self.write_hot(TieredPool::slot_of(b) as usize, p)?,
            }
        }
        Ok(blocks.len())
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

    /// Writes `bytes` ([`read_hot`](Self::read_hot)'s layout) into hot
    /// block `slot`, which only the importing sequence holds; refuses
    /// values that are not finite (a verified blob's numbers are checked
    /// too: nothing non-finite reaches attention).
    fn write_hot(&self, slot: usize, bytes: &[u8]) -> Result<()> {
        let bs = self.block_size as i64;
        let per = self.hot_layout.block_bytes() as usize / (2 * self.k.len());
        let dims = [bs, self.shape.heads as i64, self.shape.head_dim as i64];
        for (i, t) in self
            .k
            .iter()
            .zip(&self.v)
            .flat_map(|(k, v)| [k, v])
            .enumerate()
        {
            let src = Tensor::f_from_data_size(&bytes[i * per..(i + 1) * per], &dims, t.kind())?;
            if src.f_isfinite()?.f_all()?.f_int64_value(&[])? == 0 {
                return Err(EngineError::Request(
                    "a remote block with values that are not finite".into(),
                ));
            }
            let src = src.f_to_device(t.device())?;
            t.f_narrow(0, slot as i64 * bs, bs)?.f_copy_(&src)?;
        }
        Ok(())
    }
}
