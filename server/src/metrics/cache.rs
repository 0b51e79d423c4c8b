//! The cache's series: the byte budget and its use, per tier; what the
//! policies did; the prefix index's hits and the tier that served them.

use kvforge_engine::cache::CacheStats;
use kvforge_engine::metrics::{Rows, label};

use super::{Series, n, one};

fn per_tier(cache: &CacheStats, f: impl Fn(&kvforge_pool::PoolStats) -> u64) -> Rows {
    cache
        .tiers
        .iter()
        .map(|t| (label("tier", t.name), f(&t.pool) as f64))
        .collect()
}

/// The cache's series, from the coordinator's counters.
pub(super) const SERIES: &[Series<CacheStats>] = &[
    (
        "kv_cache_usage_perc",
        "KV bytes in use over the byte budget (1 = full).",
        |c| {
            let used = c.bytes_in_use as f64 / c.budget_bytes as f64;
            one(if c.budget_bytes > 0 { used } else { 0.0 })
        },
    ),
    (
        "kv_budget_bytes",
        "Bytes all KV tiers may hold in use.",
        |c| n(c.budget_bytes),
    ),
    (
        "kv_bytes_in_use",
        "Bytes of KV blocks in use, per tier.",
        |c| per_tier(c, |t| t.in_use_bytes),
    ),
    ("kv_blocks_in_use", "KV blocks in use, per tier.", |c| {
        per_tier(c, |t| t.in_use as u64)
    }),
    (
        "kv_blocks_cached_free",
        "Free KV blocks still holding cached prefixes, per tier.",
        |c| per_tier(c, |t| t.cached_free as u64),
    ),
    (
        "evicted_entries_total",
        "KV entries dropped by the eviction policy.",
        |c| n(c.policies.evicted_entries),
    ),
    (
        "evicted_idle_entries_total",
        "Of those, entries taken from idle sequences for another's step.",
        |c| n(c.policies.evicted_idle_entries),
    ),
    (
        "evicted_tokens_total",
        "Tokens dropped by token-level eviction.",
        |c| n(c.policies.evicted_tokens),
    ),
    (
        "demoted_blocks_total",
        "Hot blocks moved to the quantized cold tier.",
        |c| n(c.policies.demoted_blocks),
    ),
    (
        "lifecycle_dropped_entries_total",
        "KV entries the context lifecycle dropped.",
        |c| n(c.policies.lifecycle_dropped_entries),
    ),
    (
        "shared_blocks_total",
        "Cold blocks stored once for several holders.",
        |c| n(c.sharing.map_or(0, |s| s.shared)),
    ),
    (
        "prefix_index_hit_blocks_total",
        "Blocks the prefix index returned.",
        |c| n(c.index.unwrap_or_default().hit_blocks),
    ),
    (
        "prefix_index_inserted_blocks_total",
        "Blocks registered in the prefix index.",
        |c| n(c.index.unwrap_or_default().inserted_blocks),
    ),
    (
        "prefix_reused_blocks_total",
        "Cached blocks requests opened on, by the tier that served them.",
        |c| {
            let p = &c.policies;
            vec![
                (label("tier", "hot"), p.reused_hot_blocks as f64),
                (label("tier", "cold"), p.reused_cold_blocks as f64),
            ]
        },
    ),
];
