//! Construction: a [`Coordinator`] from its configuration, and the
//! setters that swap one policy for a researcher's own.

use std::collections::{BTreeMap, HashMap};

use kvforge_evict::{EvictionPolicy, Scored, SinkWindow};
use kvforge_lifecycle::{
    LabelSource, Lifecycle, LifecycleParams, LifecyclePolicy, ModelLabels, RecentTurns,
    RuleFallback,
};
use kvforge_lsh::{Deduplicator, ExactDedup, SimHashDedup};
use kvforge_pool::{MAX_TIER_BLOCKS, PoolConfig, TieredPool};
use kvforge_prefix::{HashChainIndex, PrefixMatcher, RadixIndex, Xxh3Hasher};
use kvforge_quant::{TierPlan, TierPolicy};

use crate::{
    CoordError, CoordinatorConfig, DedupConfig, EvictionConfig, IndexKind, LifecycleConfig, Result,
};

use super::Counters;
use super::{COLD, Coordinator};

/// The configured lifecycle.
pub(super) fn lifecycle_from(cfg: LifecycleConfig) -> Result<Lifecycle> {
    Ok(match cfg {
        LifecycleConfig::RecentTurns { keep } => Lifecycle::new(
            Box::new(RecentTurns::new(keep)?),
            LifecycleParams {
                delay: 0,
                min_match: 0,
                compress_min: None,
            },
        )?,
        LifecycleConfig::Labels {
            source,
            protect,
            delay,
            min_match,
            compress_min,
        } => {
            let rule = RuleFallback::new(protect, compress_min.unwrap_or(u64::MAX))?;
            let policy: Box<dyn LifecyclePolicy> = match source {
                LabelSource::Rule => Box::new(rule),
                s => Box::new(ModelLabels::new(s, rule)?),
            };
            Lifecycle::new(
                policy,
                LifecycleParams {
                    delay,
                    min_match,
                    compress_min,
                },
            )?
        }
    })
}

impl Coordinator {
    /// Builds pools and policies from `cfg`. Errors: a budget smaller than
    /// one hot block, no hot blocks, window/sink not whole blocks, sharing
    /// without a cold tier, a cold format the layout cannot hold, policy
    /// parameters that cannot work.
    pub fn new(cfg: CoordinatorConfig) -> Result<Self> {
        let hot = cfg.layout;
        let budget = cfg.budget();
        if cfg.hot_blocks == 0 {
            return Err(CoordError::Config(
                "the hot tier needs at least one block".into(),
            ));
        }
        if budget < hot.block_bytes() {
            return Err(CoordError::Config(format!(
                "a budget of {budget} bytes is smaller than one block ({} bytes)",
                hot.block_bytes()
            )));
        }
        let bs = hot.block_size() as usize;
        let hot_max = (cfg.hot_blocks as u64)
            .min(budget / hot.block_bytes())
            .min(MAX_TIER_BLOCKS as u64) as usize;
        let mut tiers = vec![(hot, PoolConfig::fixed(hot_max))];
        let mut tier_policy: Option<Box<dyn TierPolicy>> = None;
        if let Some(c) = cfg.cold {
            if c.format.group().is_none() || c.value_format.group().is_none() {
                return Err(CoordError::Config(format!(
                    "the cold tier needs a quantized format, not {:?}",
                    c.format
                )));
            }
            let layout = hot.with_kv_formats(c.format, c.value_format)?;
            let cold_max = (budget / layout.block_bytes()).min(MAX_TIER_BLOCKS as u64) as usize;
            // Cold blocks appear as hot ones leave: grow in small batches.
            let pool = PoolConfig::fixed(cold_max.min(64)).with_max_blocks(cold_max);
            tiers.push((layout, pool.with_growth_batch(64)));
            tier_policy = Some(Box::new(TierPlan::new(bs, c.window)?.with_sink(c.sink)?));
        }
        let index: Option<Box<dyn PrefixMatcher>> = match &cfg.prefix {
            None => None,
            Some(p) => {
                let hasher = p
                    .seed
                    .map_or_else(Xxh3Hasher::random, Xxh3Hasher::with_seed);
                Some(match p.index {
                    IndexKind::HashChain => Box::new(HashChainIndex::with_hasher(bs, hasher)?),
                    IndexKind::Radix => Box::new(RadixIndex::new(bs)?),
                })
            }
        };
        let evict: Option<Box<dyn EvictionPolicy>> = match cfg.eviction {
            None => None,
            Some(EvictionConfig::SinkWindow { sink, window }) => {
                Some(Box::new(SinkWindow::new(sink, window)?))
            }
            Some(EvictionConfig::Scored {
                score,
                trigger,
                sink,
                window,
                per_head,
                per_token,
            }) => {
                let p = Scored::new(score, trigger, sink, window)?;
                let bad = |m: &str| Err(CoordError::Config(m.into()));
                if per_head && per_token {
                    return bad("eviction is per head or per token, not both");
                }
                if (per_head || per_token) && cfg.cold.is_some() {
                    return bad(
                        "per-head and token-level eviction pack hot blocks; they do not combine with a cold tier yet",
                    );
                }
                if per_token && bs > kvforge_pool::MAX_HOLED_BLOCK as usize {
                    return bad("token-level eviction marks rows of blocks of at most 64 tokens");
                }
                Some(Box::new(match (per_head, per_token) {
                    (true, _) => p.per_head()?,
                    (_, true) => p.per_token()?,
                    _ => p,
                }))
            }
        };
        let dedup: Option<Box<dyn Deduplicator>> = match cfg.dedup {
            None => None,
            Some(_) if cfg.cold.is_none() => {
                return Err(CoordError::Config(
                    "sharing duplicate blocks works in the cold tier: configure a cold tier too"
                        .into(),
                ));
            }
            Some(DedupConfig::Exact) => Some(Box::new(ExactDedup::new())),
            Some(DedupConfig::SimHash(c)) => Some(Box::new(SimHashDedup::new(c)?)),
        };
        let lifecycle = cfg.lifecycle.map(lifecycle_from).transpose()?;
        if let (Some(c), Some(window)) = (cfg.cold, cfg.eviction.map(|e| e.window())) {
            if window < c.window {
                return Err(CoordError::Config(format!(
                    "an eviction window of {window} tokens inside the hot window of {} drops blocks before they could go cold: make it at least as long",
                    c.window
                )));
            }
        }
        Ok(Coordinator {
            budget,
            tiers: TieredPool::new(tiers)?,
            index,
            tier_policy,
            evict,
            dedup,
            lifecycle,
            seqs: BTreeMap::new(),
            next_seq: 1,
            demoted: HashMap::new(),
            cached: HashMap::new(),
            freed_cold: Vec::new(),
            lanes: (hot.layers() * hot.kv_heads()) as usize,
            step_peak: 0,
            counters: Counters::default(),
            check: false,
            cfg,
        })
    }

    /// Replaces the eviction policy (a researcher's own); `None` turns
    /// eviction off.
    pub fn set_eviction_policy(&mut self, p: Option<Box<dyn EvictionPolicy>>) {
        self.evict = p;
    }

    /// Replaces the tier policy (which hot entries go cold). Refused
    /// without a cold tier to put them in.
    pub fn set_tier_policy(&mut self, p: Box<dyn TierPolicy>) -> Result<()> {
        if self.tiers.tiers() <= COLD {
            return Err(CoordError::Config("no cold tier to demote into".into()));
        }
        self.tier_policy = Some(p);
        Ok(())
    }

    /// Replaces the deduplicator. Refused without a cold tier.
    pub fn set_deduplicator(&mut self, d: Option<Box<dyn Deduplicator>>) -> Result<()> {
        if d.is_some() && self.tiers.tiers() <= COLD {
            return Err(CoordError::Config("sharing needs a cold tier".into()));
        }
        self.dedup = d;
        Ok(())
    }

    /// Replaces the lifecycle policy (a researcher's own), acting under
    /// `params`; `None` turns the lifecycle off.
    pub fn set_lifecycle_policy(
        &mut self,
        p: Option<(Box<dyn LifecyclePolicy>, LifecycleParams)>,
    ) -> Result<()> {
        self.lifecycle = p.map(|(p, params)| Lifecycle::new(p, params)).transpose()?;
        Ok(())
    }
}
