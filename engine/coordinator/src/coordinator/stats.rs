//! What a coordinator holds and did: per-tier occupancy, bytes, counters,
//! the index's and the deduplicator's statistics.

use kvforge_lifecycle::{LabelSource, Lifecycle};
use kvforge_lsh::ShareStats;
use kvforge_pool::{KvLayout, PoolStats, TieredPool};
use kvforge_prefix::{MatchStats, PrefixMatcher};

use crate::config::CoordinatorConfig;

use super::{COLD, Coordinator, HOT};

/// Occupancy of one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// `hot`, or the cold format.
    #[serde(rename = "tier")]
    pub name: &'static str,
    /// The pool's counters (blocks, in use, cached, bytes).
    #[serde(flatten)]
    pub pool: PoolStats,
}

/// What the policies did, counted over committed steps and ended turns
/// (the monitoring counters of the metrics snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Entries dropped by the eviction policy.
    pub evicted_entries: u64,
    /// Hot blocks moved to the cold tier (quantized, or another holder's
    /// cold copy reused).
    pub demoted_blocks: u64,
    /// Entries dropped by the lifecycle policy at turn ends (reclaimed
    /// segments and compressed ones).
    pub lifecycle_dropped_entries: u64,
    /// Segments the lifecycle put in its pending queue.
    pub lifecycle_queued: u64,
    /// Pending segments a later turn referred to: kept.
    pub lifecycle_revived: u64,
    /// Segments whose KV the lifecycle freed.
    pub lifecycle_reclaimed: u64,
    /// Segments replaced by a summary.
    pub lifecycle_compressed: u64,
    /// Turn ends whose model labels were missing or unusable, so the rule
    /// decided.
    pub lifecycle_fallbacks: u64,
    /// Blocks written by head-wise eviction's packing (pages copied in).
    pub packed_blocks: u64,
    /// Rows (tokens) token-level eviction marked invalid or dropped with
    /// their entry.
    pub evicted_tokens: u64,
    /// Blocks token-level eviction's compaction gave back (the live rows
    /// of holed blocks moved into fewer blocks).
    pub compacted_blocks: u64,
    /// Of the evicted entries, those taken from idle sequences to make room
    /// for another's step (the budget was full).
    pub evicted_idle_entries: u64,
    /// Steps committed.
    pub steps: u64,
    /// Cached blocks a sequence opened on, from the hot tier (prefix hits
    /// served at full precision).
    pub reused_hot_blocks: u64,
    /// Cached blocks a sequence opened on, from the cold tier (prefix hits
    /// served quantized).
    pub reused_cold_blocks: u64,
}

impl Coordinator {
    /// The configuration it was built from.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.cfg.layout.block_size() as usize
    }

    /// The pools.
    pub fn pools(&self) -> &TieredPool {
        &self.tiers
    }

    /// Layout of the cold tier, if there is one.
    pub fn cold_layout(&self) -> Option<KvLayout> {
        self.tiers.layout(COLD).ok().copied()
    }

    /// The byte budget across all tiers.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes held by blocks in use, all tiers (each block once, however
    /// many sequences share it).
    pub fn bytes_in_use(&self) -> u64 {
        self.tiers.in_use_bytes()
    }

    /// Per-tier occupancy.
    pub fn tier_stats(&self) -> Vec<TierStats> {
        (0..self.tiers.tiers())
            .filter_map(|t| {
                let pool = self.tiers.tier_stats(t).ok()?;
                let name = if t == HOT { "hot" } else { "cold" };
                Some(TierStats { name, pool })
            })
            .collect()
    }

    /// The most bytes in use at any moment since the last
    /// [`reset_step_peak`](Self::reset_step_peak): right after each plan,
    /// while the step holds both the blocks it will release at its commit
    /// (dropped, demoted, packed away) and the ones it took. Between steps
    /// [`bytes_in_use`](Self::bytes_in_use) is lower.
    pub fn step_peak_bytes(&self) -> u64 {
        self.step_peak.max(self.tiers.in_use_bytes())
    }

    /// Starts a new [`step_peak_bytes`](Self::step_peak_bytes) measurement.
    pub fn reset_step_peak(&mut self) {
        self.step_peak = 0;
    }

    /// What the policies did so far (evictions, demotions, lifecycle
    /// drops, steps).
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The prefix index's counters, when reuse is on.
    pub fn index_stats(&self) -> Option<MatchStats> {
        self.index.as_ref().map(|i| i.stats())
    }

    /// The deduplicator's counters, when sharing is on.
    pub fn share_stats(&self) -> Option<ShareStats> {
        self.dedup.as_ref().map(|d| d.stats())
    }

    /// Live sequences.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Whether prefix reuse is on.
    pub fn reuses_prefixes(&self) -> bool {
        self.index.is_some()
    }

    /// Where the lifecycle's labels come from (`None`: no lifecycle).
    pub fn lifecycle_source(&self) -> Option<LabelSource> {
        self.lifecycle.as_ref().map(Lifecycle::source)
    }

    /// Whether an eviction policy runs: the configured one, or one
    /// installed with [`set_eviction_policy`](Self::set_eviction_policy)
    /// (every policy a mechanisms file names).
    pub fn evicts(&self) -> bool {
        self.evict.is_some()
    }

    /// The eviction policy's watermark (`high`, `low` fractions of the
    /// budget), when it evicts by one.
    pub fn eviction_watermark(&self) -> Option<(f64, f64)> {
        self.evict.as_ref().and_then(|p| p.watermark())
    }
}
