//! KV storage: the paged cache (tensors for the coordinator's blocks), and
//! a contiguous cache kept only as a test oracle.
//!
//! The paged cache owns one K and one V tensor per layer for the hot tier,
//! shaped `[hot_blocks * block_size, kv_heads, head_dim]` (slot
//! `b * block_size + o` holds offset `o` of hot block `b`), and the cold
//! tier's quantized blocks. Everything else — which blocks a sequence
//! holds, what goes cold, what is dropped, what is shared — is decided by
//! the tensor-free [`Coordinator`]: each forward step asks it for a plan,
//! carries the plan out with tensors, attends through an
//! [`AttentionBackend`], and commits (or, when anything failed, aborts).

use std::sync::{Mutex, MutexGuard};

use kvforge_coordinator::{ColdConfig, Coordinator, CoordinatorConfig, SeqId, TierStats};
use kvforge_pool::{KvLayout, StorageFormat};
use kvforge_quant::BlockShape;
use tch::{Device, Kind, Tensor};

use crate::attention::{AttentionBackend, KvTensors};
use crate::error::{EngineError, Result};
use crate::fused::FusedBackend;
use crate::kv::KvDims;
use crate::policies::Policies;
use crate::tier::{ColdTier, KvQuant};

mod import;
mod policies;
mod remote;
mod rewrite;
mod sequences;
mod step;

pub use import::{RemoteFetched, RemoteLookup};
pub use remote::RemoteSetup;
pub use step::PagedSeq;

/// A reading of a cache: what [`PagedKvCache::stats`] returns.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CacheStats {
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes all tiers may hold in use.
    pub budget_bytes: u64,
    /// Bytes held by blocks in use, all tiers.
    pub bytes_in_use: u64,
    /// Per-tier occupancy (hot first).
    pub tiers: Vec<TierStats>,
    /// The prefix index's counters, when reuse is on.
    pub index: Option<kvforge_coordinator::MatchStats>,
    /// The deduplicator's counters, when sharing is on.
    pub sharing: Option<kvforge_coordinator::ShareStats>,
    /// What the policies did.
    pub policies: kvforge_coordinator::Counters,
    /// The remote tier's counters, when there is one.
    pub remote: Option<kvforge_remote::RemoteStats>,
    /// The eviction policy's watermark (`high`, `low` fractions of the
    /// budget), when it evicts by one.
    pub watermark: Option<(f64, f64)>,
}
#[cfg(test)]
mod tests;

/// A sequence of a [`PagedKvCache`]: a handle on its block table in the
/// coordinator. Free it with [`PagedKvCache::free`].
#[derive(Debug, Default)]
pub struct Sequence {
    id: Option<SeqId>,
    len: usize,
}

impl Sequence {
    /// The position of the next token.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its id in the coordinator, once it holds anything.
    pub fn id(&self) -> Option<SeqId> {
        self.id
    }
}

/// Paged KV storage for one model: hot tensors, cold blocks, and the
/// coordinator that owns every block table.
pub struct PagedKvCache {
    coord: Mutex<Coordinator>,
    hot_layout: KvLayout,
    hot_blocks: usize,
    block_size: usize,
    shape: BlockShape,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    cold: Option<ColdTier>,
    backend: Box<dyn AttentionBackend>,
    /// A researcher's policy objects, installed in every coordinator the
    /// cache builds.
    policies: Policies,
    /// The shared remote tier, when there is one.
    remote: Option<remote::RemoteLink>,
}

// SAFETY: the tensors are only read concurrently, or written at slots of
// hot blocks that the coordinator handed to exactly one sequence for the
// step (a block with other holders is never written: the coordinator's
// invariant, checked by `kvforge_coordinator::testing::check_invariants`): concurrent steps
// touch disjoint memory, and libtorch's tensor handles count references
// atomically. Everything else is behind a mutex or a lock.
unsafe impl Sync for PagedKvCache {}

impl PagedKvCache {
    /// Storage for `max_tokens` tokens of hot KV (rounded up to whole
    /// blocks) on `device` in `kind`, with every cache mechanism off.
    /// Memory is reserved up front; the coordinator hands out blocks.
    pub fn new(
        dims: impl Into<KvDims>,
        block_size: usize,
        max_tokens: usize,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let cfg = dims.into();
        if block_size == 0 || max_tokens == 0 {
            return Err(EngineError::Request(
                "block size and KV capacity must be positive".into(),
            ));
        }
        let format = match kind {
            Kind::Float => StorageFormat::F32,
            Kind::BFloat16 => StorageFormat::BF16,
            _ => StorageFormat::F16,
        };
        let layout = KvLayout::new(
            cfg.layers as u32,
            cfg.kv_heads as u32,
            cfg.head_dim as u32,
            u32::try_from(block_size)
                .map_err(|_| EngineError::Request("block size too large".into()))?,
            format,
        )?;
        let blocks = max_tokens.div_ceil(block_size);
        if device == Device::Cpu {
            let need = layout.bytes_for_blocks(blocks as u64)?;
            if let Some(have) = available_memory() {
                if need > have {
                    return Err(EngineError::Request(format!(
                        "a KV cache of {max_tokens} tokens needs {} MiB, more than the {} MiB of memory available",
                        need >> 20,
                        have >> 20
                    )));
                }
            }
        }
        let coord = Coordinator::new(CoordinatorConfig::new(layout, blocks))?;
        let slots = (blocks * block_size) as i64;
        let shape = [slots, cfg.kv_heads as i64, cfg.head_dim as i64];
        let zeros = || Tensor::f_zeros(shape, (kind, device));
        let k = (0..cfg.layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let v = (0..cfg.layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(PagedKvCache {
            coord: Mutex::new(coord),
            hot_layout: layout,
            hot_blocks: blocks,
            block_size,
            shape: BlockShape {
                tokens: block_size,
                heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
            },
            k,
            v,
            cold: None,
            backend: Box::new(FusedBackend::default()),
            policies: Policies::default(),
            remote: None,
        })
    }

    /// A configuration for this cache's hot tier with every mechanism off,
    /// to fill in and pass to [`configure`](Self::configure).
    pub fn base_config(&self) -> CoordinatorConfig {
        CoordinatorConfig::new(self.hot_layout, self.hot_blocks)
    }

    /// The coordinator's configuration now.
    pub fn config(&self) -> CoordinatorConfig {
        self.coordinator().config().clone()
    }

    /// Rebuilds the coordinator from `cfg` (prefix reuse, eviction,
    /// sharing, lifecycle, budget) and installs the cold tier `quant` (its
    /// formats fill `cfg.cold`). Errors, changing nothing, while any
    /// sequence lives or blocks are in use, or when `cfg` cannot work.
    pub fn configure(&mut self, mut cfg: CoordinatorConfig, quant: Option<KvQuant>) -> Result<()> {
        let mut tier = quant.map(|s| ColdTier::new(s, self.shape)).transpose()?;
        // On a GPU the CUDA kernel reads cold blocks from a copy there.
        if let (Some(t), Some(k)) = (tier.as_mut(), self.k.first()) {
            if k.device().is_cuda() {
                t.mirror_on(k.device(), self.k.len());
            }
        }
        cfg.layout = self.hot_layout;
        cfg.hot_blocks = self.hot_blocks;
        cfg.cold = match (&tier, quant) {
            (Some(t), Some(q)) => {
                let (format, value_format) = t.formats();
                Some(ColdConfig {
                    format,
                    value_format,
                    window: q.window,
                    sink: q.sink,
                })
            }
            _ => None,
        };
        let mut coord = Coordinator::new(cfg)?;
        policies::install(&mut coord, &self.policies)?;
        let busy = {
            let c = self.coordinator();
            c.sequences() > 0 || c.bytes_in_use() > 0
        };
        if busy {
            return Err(EngineError::Request(
                "the cache cannot be reconfigured while sequences hold KV".into(),
            ));
        }
        *self.coord.get_mut().unwrap_or_else(|e| e.into_inner()) = coord;
        self.cold = tier;
        self.recheck_remote();
        Ok(())
    }

    /// Installs (or with `None` removes) the quantized cold tier, keeping
    /// the other settings. Errors, changing nothing, while any sequence
    /// holds blocks.
    pub fn set_cold_tier(&mut self, spec: Option<KvQuant>) -> Result<()> {
        let cfg = self.config();
        self.configure(cfg, spec)
    }

    /// Replaces the attention backend.
    pub fn set_backend(&mut self, backend: Box<dyn AttentionBackend>) {
        self.backend = backend;
    }

    /// The cold tier's configuration, if there is one.
    pub fn cold_tier(&self) -> Option<KvQuant> {
        self.cold.as_ref().map(ColdTier::spec)
    }

    /// Everything the cache holds and did, in one reading: per-tier
    /// occupancy, bytes, the index's and the sharing's counters, what the
    /// policies did (serializable: the metrics are derived from it).
    pub fn stats(&self) -> CacheStats {
        let c = self.coordinator();
        CacheStats {
            block_size: self.block_size,
            budget_bytes: c.budget(),
            bytes_in_use: c.bytes_in_use(),
            tiers: c.tier_stats(),
            index: c.index_stats(),
            sharing: c.share_stats(),
            policies: c.counters(),
            remote: self.remote_stats(),
            watermark: c.eviction_watermark(),
        }
    }

    /// Where the lifecycle's labels come from (`None`: no lifecycle).
    pub fn lifecycle_source(&self) -> Option<kvforge_coordinator::LabelSource> {
        self.coordinator().lifecycle_source()
    }

    /// Whether a sequence only ever grows in hot blocks (no cold tier, no
    /// eviction policy, configured or installed): then a request larger
    /// than the hot tier cannot fit.
    pub fn grows_only_hot(&self) -> bool {
        let c = self.coordinator();
        c.config().cold.is_none() && !c.evicts()
    }

    /// Checks every coordinator invariant after each of its calls (tests;
    /// see [`Coordinator::check_every_call`]).
    pub fn check_every_call(&self, on: bool) {
        self.coordinator().check_every_call(on);
    }

    /// Runs `f` on the coordinator, locked for the call (what the cache's
    /// own methods do not offer: its pools, its configuration).
    pub fn with_coordinator<T>(&self, f: impl FnOnce(&mut Coordinator) -> T) -> T {
        f(&mut self.coordinator())
    }

    /// The coordinator, locked (block tables, pools, index, policies).
    pub(crate) fn coordinator(&self) -> MutexGuard<'_, Coordinator> {
        self.coord.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks the hot tier holds at most.
    pub fn hot_blocks(&self) -> usize {
        self.hot_blocks
    }

    /// Per-tier occupancy (hot first).
    pub fn tier_stats(&self) -> Vec<TierStats> {
        self.coordinator().tier_stats()
    }

    /// KV bytes held by blocks in use, all tiers, each block once.
    pub fn bytes_in_use(&self) -> u64 {
        self.coordinator().bytes_in_use()
    }

    /// The most KV bytes in use inside any step since the last call (the
    /// blocks a step releases at its commit included), and a new
    /// measurement started.
    pub fn take_step_peak_bytes(&self) -> u64 {
        let mut c = self.coordinator();
        let peak = c.step_peak_bytes();
        c.reset_step_peak();
        peak
    }

    /// `(hot, cold)` bytes in use.
    pub fn tier_bytes(&self) -> (u64, u64) {
        let s = self.tier_stats();
        let hot = s.first().map_or(0, |t| t.pool.in_use_bytes);
        let cold = s.get(1).map_or(0, |t| t.pool.in_use_bytes);
        (hot, cold)
    }

    /// Bytes of quantized blocks stored now (held, cached, or shared).
    pub fn cold_stored_bytes(&self) -> u64 {
        self.cold.as_ref().map_or(0, ColdTier::stored_bytes)
    }

    /// A [`KvStore`] view of `seq` for one forward step.
    pub fn view<'a>(&'a self, seq: &'a mut Sequence) -> PagedSeq<'a> {
        PagedSeq {
            cache: self,
            seq,
            step: None,
        }
    }

    /// Keeps a copy of the cold tier on `device` whatever the cache's
    /// device (tests of the CUDA kernel's tables on the CPU).
    #[cfg(test)]
    pub(crate) fn mirror_cold_tier(&mut self, device: Device) -> bool {
        let layers = self.k.len();
        self.cold
            .as_mut()
            .is_some_and(|t| t.mirror_on(device, layers))
    }

    pub(crate) fn tensors(&self) -> KvTensors<'_> {
        KvTensors {
            k: &self.k,
            v: &self.v,
            cold: self.cold.as_ref(),
        }
    }
}

/// Memory the OS says is available (`MemAvailable` in `/proc/meminfo`), if
/// it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
