//! Construction: a [`Coordinator`] from its configuration, and the
//! setters that swap one policy for a researcher's own.

use std::collections::{BTreeMap, HashMap};

use kvforge_evict::{EvictionPolicy, Scored, SinkWindow};
use kvforge_lifecycle::{
    LabelSource, Lifecycle, LifecycleParams, LifecyclePolicy, ModelLabels, RecentTurns,
    RuleFallback,
};
use kvforge_lsh::{Deduplicator, ExactDedup, SimHashDedup};
use kvforge_pool::{KvLayout, MAX_TIER_BLOCKS, PoolConfig, TieredPool};
use kvforge_prefix::{HashChainIndex, PrefixMatcher, RadixIndex, Xxh3Hasher};
use kvforge_quant::{TierPlan, TierPolicy};

use crate::config::{
    CoordinatorConfig, DedupConfig, EvictionConfig, IndexKind, LifecycleConfig, PrefixConfig,
};
use crate::error::{CoordError, Result};
use crate::rules;

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
        if let (Some(c), Some(window)) = (cfg.cold, cfg.eviction.map(|e| e.window())) {
            rules::window_fits(window, c.window).map_err(CoordError::Config)?;
        }
        let (tiers, tier_policy) = tiers_from(&cfg, budget)?;
        Ok(Coordinator {
            budget,
            tiers: TieredPool::new(tiers)?,
            index: cfg
                .prefix
                .as_ref()
                .map(|p| index_from(p, hot.block_size()))
                .transpose()?,
            index_watched: false,
            tier_policy,
            evict: eviction_from(&cfg)?,
            dedup: dedup_from(&cfg)?,
            lifecycle: cfg.lifecycle.map(lifecycle_from).transpose()?,
            seqs: BTreeMap::new(),
            next_seq: 1,
            demoted: HashMap::new(),
            cached: HashMap::new(),
            freed_cold: Vec::new(),
            lanes: (hot.layers() * hot.kv_heads()) as usize,
            step_peak: 0,
            counters: Counters::default(),
            check: false,
            fail_at: None,
            cfg,
        })
    }

    /// Replaces the eviction policy (a researcher's own); `None` turns
    /// eviction off. Failures the old policy left on idle sequences (to
    /// fail their next steps) are dropped with it.
    ///
    /// Any policy runs here, whatever the tiers: the coordinator keeps its
    /// tables right for packed hot blocks beside a cold tier too. An
    /// engine whose tensors cannot carry a combination out checks
    /// [`rules::eviction_fits`] first, as the configured policy is
    /// checked at [`new`](Self::new).
    pub fn set_eviction_policy(&mut self, p: Option<Box<dyn EvictionPolicy>>) {
        self.evict = p;
        // What the old policy could not answer is not the new one's.
        for s in self.seqs.values_mut() {
            s.policy_error = None;
        }
    }

    /// Replaces the tier policy (which hot entries go cold). Refused
    /// without a cold tier to put them in.
    pub fn set_tier_policy(&mut self, p: Box<dyn TierPolicy>) -> Result<()> {
        rules::needs_cold_tier("a tier policy", self.tiers.tiers() > COLD)
            .map_err(CoordError::Config)?;
        self.tier_policy = Some(p);
        Ok(())
    }

    /// Replaces the deduplicator. Refused without a cold tier.
    pub fn set_deduplicator(&mut self, d: Option<Box<dyn Deduplicator>>) -> Result<()> {
        if d.is_some() {
            rules::needs_cold_tier("sharing duplicate blocks", self.tiers.tiers() > COLD)
                .map_err(CoordError::Config)?;
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

/// The tiers' layouts and pools (hot; cold, when configured, with its
/// tier policy) under a byte budget of `budget`.
type Tiers = (Vec<(KvLayout, PoolConfig)>, Option<Box<dyn TierPolicy>>);

fn tiers_from(cfg: &CoordinatorConfig, budget: u64) -> Result<Tiers> {
    let hot = cfg.layout;
    let hot_max = (cfg.hot_blocks as u64)
        .min(budget / hot.block_bytes())
        .min(MAX_TIER_BLOCKS as u64) as usize;
    let mut tiers = vec![(hot, PoolConfig::fixed(hot_max))];
    let Some(c) = cfg.cold else {
        return Ok((tiers, None));
    };
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
    let bs = hot.block_size() as usize;
    let plan = TierPlan::new(bs, c.window)?.with_sink(c.sink)?;
    Ok((tiers, Some(Box::new(plan))))
}

/// The configured prefix index over blocks of `block_size` tokens.
fn index_from(p: &PrefixConfig, block_size: u32) -> Result<Box<dyn PrefixMatcher>> {
    let bs = block_size as usize;
    let hasher = p
        .seed
        .map_or_else(Xxh3Hasher::random, Xxh3Hasher::with_seed);
    Ok(match p.index {
        IndexKind::HashChain => Box::new(HashChainIndex::with_hasher(bs, hasher)?),
        IndexKind::Radix => Box::new(RadixIndex::new(bs)?),
    })
}

/// The configured eviction policy, if any.
fn eviction_from(cfg: &CoordinatorConfig) -> Result<Option<Box<dyn EvictionPolicy>>> {
    let bs = cfg.layout.block_size();
    let p: Box<dyn EvictionPolicy> = match cfg.eviction {
        None => return Ok(None),
        Some(EvictionConfig::SinkWindow { sink, window }) => {
            Box::new(SinkWindow::new(sink, window)?)
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
            rules::scored(p, per_head, per_token).map_err(CoordError::Config)?
        }
    };
    rules::eviction_fits(p.as_ref(), bs, cfg.cold.is_some()).map_err(CoordError::Config)?;
    Ok(Some(p))
}

/// The configured deduplicator, if any (it needs the cold tier).
fn dedup_from(cfg: &CoordinatorConfig) -> Result<Option<Box<dyn Deduplicator>>> {
    Ok(Some(match cfg.dedup {
        None => return Ok(None),
        Some(_) if cfg.cold.is_none() => {
            let no = rules::needs_cold_tier("sharing duplicate blocks", false);
            return no.map(|()| None).map_err(CoordError::Config);
        }
        Some(DedupConfig::Exact) => Box::new(ExactDedup::new()),
        Some(DedupConfig::SimHash(c)) => Box::new(SimHashDedup::new(c)?),
    }))
}
