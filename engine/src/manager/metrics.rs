//! The manager's metrics snapshot: derived, field by field, from the
//! statistics the cache and the coordinator keep ([`CacheStats`], the
//! pools', the index's, the sharing's counters, [`Counters`]), so the JSON
//! and the Prometheus text cannot drift from them.

use kvforge_coordinator::{Counters, MatchStats, PoolStats, ShareStats, TierStats};
use serde::Serialize;

use crate::lifecycle::LifecycleReport;

use super::{CacheManager, lock};

/// What [`CacheManager::metrics`] serializes.
#[derive(Clone, Debug, Serialize)]
pub struct Metrics {
    /// Requests and session turns served.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Of those, the tokens whose KV was reused.
    pub reused_tokens: u64,
    /// `reused_tokens / prompt_tokens`.
    pub reuse_rate: f64,
    /// Sessions open now.
    pub sessions_open: usize,
    /// Bytes held by blocks in use, all tiers.
    pub kv_bytes_in_use: u64,
    /// Bytes all tiers may hold in use.
    pub kv_budget_bytes: u64,
    /// The hot tier.
    pub pool: HotPool,
    /// Every tier, hot first.
    pub tiers: Vec<TierStats>,
    /// The prefix index.
    pub index: IndexMetrics,
    /// The deduplicator, when sharing is on.
    pub sharing: Option<ShareStats>,
    /// What the policies did.
    pub policies: Counters,
    /// The last request or turn.
    pub last_turn: Option<LastTurn>,
}

/// The hot tier: its block size and pool.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct HotPool {
    /// Tokens per block.
    pub block_size: usize,
    /// Its pool's counters.
    #[serde(flatten)]
    pub stats: PoolStats,
}

/// The prefix index: which one, and its counters.
#[derive(Clone, Debug, Serialize)]
pub struct IndexMetrics {
    /// `HashChain` or `Radix`.
    pub kind: String,
    /// Whether reuse is on.
    pub enabled: bool,
    /// `hit_tokens / query_tokens`.
    pub hit_rate: f64,
    /// Its counters (zero when reuse is off).
    #[serde(flatten)]
    pub stats: MatchStats,
}

/// The last request or turn.
#[derive(Clone, Debug, Serialize)]
pub struct LastTurn {
    /// Prompt tokens (a session turn: the whole sequence so far).
    pub prompt_tokens: usize,
    /// Of those, reused.
    pub reused_tokens: usize,
    /// Of those, prefilled.
    pub prefilled_tokens: usize,
    /// Seconds to its first new token.
    pub ttft_secs: f64,
    /// Tokens it generated.
    pub new_tokens: usize,
    /// Its decode speed.
    pub decode_tok_s: f64,
    /// KV bytes held when it ended.
    pub kv_bytes_in_use: u64,
    /// What the lifecycle did at its end (sessions with a lifecycle).
    pub lifecycle: Option<LifecycleReport>,
}

impl CacheManager {
    /// The metrics snapshot (see [`Metrics`]).
    pub fn snapshot(&self) -> Metrics {
        let c = self.engine.cache.stats();
        let t = lock(&self.totals);
        let last_turn = t.last.as_ref().map(|r| LastTurn {
            prompt_tokens: r.prompt_tokens,
            reused_tokens: r.reused_tokens,
            prefilled_tokens: r.prefilled_tokens,
            ttft_secs: r.ttft_secs,
            new_tokens: r.generation.tokens.len(),
            decode_tok_s: r.generation.decode_tokens_per_sec(),
            kv_bytes_in_use: r.kv_bytes_in_use,
            lifecycle: r.lifecycle.clone(),
        });
        let index = c.index.unwrap_or_default();
        Metrics {
            requests: t.requests,
            prompt_tokens: t.prompt_tokens,
            reused_tokens: t.reused_tokens,
            reuse_rate: t.reused_tokens as f64 / t.prompt_tokens.max(1) as f64,
            sessions_open: lock(&self.sessions).len(),
            kv_bytes_in_use: c.bytes_in_use,
            kv_budget_bytes: c.budget_bytes,
            pool: HotPool {
                block_size: c.block_size,
                stats: c.tiers.first().map(|t| t.pool).unwrap_or_default(),
            },
            tiers: c.tiers,
            index: IndexMetrics {
                kind: format!("{:?}", self.cfg.index),
                enabled: self.cfg.enabled,
                hit_rate: index.hit_rate(),
                stats: index,
            },
            sharing: c.sharing,
            policies: c.policies,
            last_turn,
        }
    }

    /// Metrics as JSON: requests, reuse, per-tier occupancy and bytes,
    /// index and sharing counters, what the policies did, and the last
    /// turn ([`snapshot`](Self::snapshot), serialized). In Prometheus'
    /// text format: [`metrics::prometheus`](crate::metrics::prometheus).
    pub fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(self.snapshot()).unwrap_or_default()
    }
}
