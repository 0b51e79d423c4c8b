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
use kvforge_pool::{Slot, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_remote::{RemoteCache, RemoteOptions, RemoteStats, RemoteTier, Scope};

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

pub(super) struct RemoteLink {
    pub(super) cache: RemoteCache,
    setup: RemoteSetup,
}

impl PagedKvCache {
    /// The scope of this cache's blocks under `setup`: model, seed,
    /// layout, and the format blocks travel in.
    fn remote_scope(&self, setup: &RemoteSetup) -> Result<Scope> {
        let (format, payload_bytes) = if setup.cold {
            let t = self.cold.as_ref().ok_or_else(|| {
                EngineError::Request("a remote tier of cold blocks needs a cold tier".into())
            })?;
            (
                format!("cold-{}", t.spec().content_name()),
                t.content_bytes(self.k.len()) as u64,
            )
        } else {
            let name = match self.hot_layout.format() {
                StorageFormat::F32 => "f32",
                StorageFormat::BF16 => "bf16",
                _ => "f16",
            };
            (name.to_string(), self.hot_layout.block_bytes())
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

    /// Shares this cache's blocks through `setup`'s store (`None`: stops).
    /// Set it after [`configure`](Self::configure): a reconfiguration that
    /// changes the blocks' format drops the link.
    pub fn set_remote(&mut self, setup: Option<RemoteSetup>) -> Result<()> {
        self.remote = match setup {
            Some(s) => Some(RemoteLink {
                cache: RemoteCache::new(s.store.clone(), self.remote_scope(&s)?, s.options),
                setup: s,
            }),
            None => None,
        };
        Ok(())
    }

    /// Keeps the remote link only if the blocks' scope is unchanged.
    pub(super) fn recheck_remote(&mut self) {
        if let Some(r) = self.remote.take() {
            if self.remote_scope(&r.setup).ok().as_ref() == Some(r.cache.scope()) {
                self.remote = Some(r);
            }
        }
    }

    /// The remote tier's counters (`None`: no remote tier).
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        self.remote.as_ref().map(|r| r.cache.stats())
    }

    /// Waits, at most `timeout`, until every block queued for the remote
    /// tier was written; whether it was (true without a remote tier).
    pub fn remote_flush(&self, timeout: Duration) -> bool {
        self.remote.as_ref().is_none_or(|r| r.cache.flush(timeout))
    }

    /// After `open`: the full blocks of `tokens[..len - 1]` after the local
    /// hit, from the remote tier, appended to `seq` (its length grows by
    /// their tokens). Anything that fails leaves `seq` as opened.
    pub(super) fn import_remote(&self, seq: &mut Sequence, tokens: &[u32], extra: &ExtraKeys) {
        let (Some(r), Some(id)) = (&self.remote, seq.id) else {
            return;
        };
        let bs = self.block_size;
        let full = tokens.len().saturating_sub(1) / bs;
        if seq.len % bs != 0 || seq.len / bs >= full {
            return;
        }
        let first = seq.len / bs;
        let links = r.cache.chain(&tokens[..full * bs], extra);
        let payloads = r
            .cache
            .fetch(&links[first..], &tokens[first * bs..full * bs]);
        if payloads.is_empty() {
            return;
        }
        let tier = if r.setup.cold { COLD } else { HOT };
        let Ok(blocks) = self.coordinator().import(id, tier, payloads.len()) else {
            return;
        };
        let filled = blocks.iter().zip(&payloads).try_for_each(|(&b, p)| {
            let slot = TieredPool::slot_of(b) as usize;
            match &self.cold {
                Some(t) if r.setup.cold => {
                    t.put(slot, Arc::new(t.block_of_content(self.k.len(), p)?))
                }
                _ => self.write_hot(slot, p),
            }
        });
        match filled {
            Ok(()) => seq.len += blocks.len() * bs,
            // Cut the imported blocks off again: close and reopen locally.
            Err(e) => {
                tracing::warn!("remote blocks not imported: {e}");
                if self.free(seq).is_ok() {
                    if let Ok(s) = self.coordinator().open(tokens, extra) {
                        *seq = Sequence {
                            id: Some(s.seq),
                            len: s.reused,
                        };
                    }
                }
            }
        }
    }

    /// After `register`: offers the first `covered` tokens' full blocks of
    /// `seq` that the remote tier does not hold yet (as far as it knows).
    pub(super) fn export_remote(
        &self,
        seq: &Sequence,
        tokens: &[u32],
        extra: &ExtraKeys,
        covered: usize,
    ) {
        let (Some(r), Some(id)) = (&self.remote, seq.id) else {
            return;
        };
        let Ok(table) = self.coordinator().table(id).cloned() else {
            return;
        };
        let bs = self.block_size;
        let full = table
            .entries()
            .iter()
            .take_while(|e| e.tokens() as usize == bs)
            .count()
            .min(covered / bs);
        let links = r.cache.chain(&tokens[..full * bs], extra);
        for (i, (e, link)) in table.entries().iter().zip(&links).enumerate() {
            if !r.cache.wants(link.key) {
                continue;
            }
            let payload = match (e.slot(), &self.cold) {
                (Slot::Hot(b), _) if !r.setup.cold => {
                    self.read_hot(TieredPool::slot_of(b) as usize)
                }
                (Slot::Hot(b), Some(t)) => {
                    let base = TieredPool::slot_of(b) as usize * bs;
                    t.quantize(&self.k, &self.v, base).map(|q| q.content())
                }
                (Slot::Cold(b), Some(t)) if r.setup.cold => t
                    .get(TieredPool::slot_of(b) as usize)
                    .map(|q| q.content())
                    .ok_or_else(|| EngineError::Request("a cold block without content".into())),
                _ => break,
            };
            match payload {
                Ok(p) => {
                    r.cache.offer(*link, &tokens[i * bs..(i + 1) * bs], &p);
                }
                Err(_) => break,
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
    /// block `slot`, which only the importing sequence holds.
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
            let src = Tensor::f_from_data_size(&bytes[i * per..(i + 1) * per], &dims, t.kind())?
                .f_to_device(t.device())?;
            t.f_narrow(0, slot as i64 * bs, bs)?.f_copy_(&src)?;
        }
        Ok(())
    }
}
