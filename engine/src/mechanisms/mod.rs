//! One configuration of kvforge's mechanisms — prefix reuse, the cold
//! tier, eviction, sharing, the lifecycle, the byte budget — as a TOML
//! table (or any serde format), read the same way by the CLI
//! (`--config FILE`) and the ablation's experiment files:
//!
//! ```toml
//! prefix = { index = "hash-chain", tail = "copy" }
//! cold = { format = "int4", window = 128, sink = 32 }
//! eviction = { policy = "keydiff", sink = 32, window = 512, per_head = true, budget_tokens = 1024 }
//! share = { policy = "exact" }
//! lifecycle = { policy = "rule", protect = 2, delay = 2 }
//! budget_mib = 0
//! remote = { url = "redis://127.0.0.1:6379", seed = 42, ttl_s = 3600, deadline_ms = 250 }
//! ```
//!
//! Each mechanism is off when absent. An eviction policy is named: the
//! [`Registry`] builds it from its parameters (a researcher registers
//! their own with one line); a policy object can also be handed to an
//! engine directly ([`Policies`](crate::policies::Policies)). `tier = {
//! policy = "module:Class", … }` replaces the cold tier's window-and-sink
//! plan with a tier policy the registry's tier resolver builds (the
//! Python package's registry has one).

use std::ops::Range;
use std::path::Path;

use kvforge_coordinator::rules;
use serde::Deserialize;

use crate::engine::EngineConfig;
use crate::manager::ReuseConfig;
use crate::policies::Policies;
use crate::tier::KvQuant;

mod eviction;
mod registry;
mod specs;
#[cfg(test)]
mod tests;
mod tier_policy;

pub use registry::{EvictionBuilder, PolicyParams, Registry, Resolver, TierBuilder, TierResolver};
pub use specs::{
    BlockFormat, IndexName, KeyAxis, LifecycleSpec, PolicySpec, PrefixSpec, RemoteSpec, ShareSpec,
    TailName,
};

/// The largest `budget_mib`: 1 PiB (larger values would wrap in bytes).
pub const MAX_BUDGET_MIB: u64 = 1 << 30;

/// One configuration of the mechanisms (each absent = off).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mechanisms {
    /// A name (the ablation's row; optional elsewhere).
    pub name: Option<String>,
    /// Prefix reuse across requests and sessions.
    pub prefix: Option<PrefixSpec>,
    /// The quantized cold tier.
    #[serde(default, deserialize_with = "cold")]
    pub cold: Option<KvQuant>,
    /// Eviction: a policy of the [`Registry`] and its parameters.
    pub eviction: Option<PolicySpec>,
    /// Which hot blocks go cold, when not the cold tier's own window and
    /// sink: a tier policy [`Registry::tier`] resolves, and its parameters.
    pub tier: Option<PolicySpec>,
    /// Sharing of duplicate cold blocks.
    pub share: Option<ShareSpec>,
    /// Context lifecycle at turn ends.
    pub lifecycle: Option<LifecycleSpec>,
    /// Byte budget of all KV tiers, MiB (0 = the hot tier's capacity).
    #[serde(default)]
    pub budget_mib: u64,
    /// Tokens per KV block (absent: the engine's).
    pub block_size: Option<usize>,
    /// A remote tier shared across instances (used by `kvforge serve`).
    pub remote: Option<RemoteSpec>,
    /// A share of the full cache's KV bytes the ablation sizes this
    /// configuration to, item by item (`cargo xtask ablate` only).
    pub target_kv: Option<f64>,
    /// The ablation workloads this configuration runs (`cargo xtask
    /// ablate` only; absent: all).
    pub workloads: Option<Vec<String>>,
}

/// `cold = { format = "int4", … }` into a [`KvQuant`].
fn cold<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<KvQuant>, D::Error> {
    let spec = Option::<specs::ColdSpec>::deserialize(d)?;
    spec.map(KvQuant::try_from)
        .transpose()
        .map_err(serde::de::Error::custom)
}

impl Mechanisms {
    /// Its name (`""` when it has none).
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }

    /// Reads a mechanisms file (`path` for messages): a TOML syntax error,
    /// an unknown key or a bad value is one line naming the file, line and
    /// column; then [`check`](Self::check) with `block_size` (the engine's,
    /// unless the file names one).
    pub fn from_toml(
        src: &str,
        path: &Path,
        block_size: usize,
        registry: &Registry,
    ) -> Result<Self, String> {
        let m: Mechanisms =
            toml::from_str(src).map_err(|e| located(path, src, e.span(), e.message()))?;
        m.check(m.block_size.unwrap_or(block_size), registry)
            .map_err(|e| located(path, src, None, &e))?;
        Ok(m)
    }

    /// [`from_toml`](Self::from_toml) of a file.
    pub fn load(path: &Path, block_size: usize, registry: &Registry) -> Result<Self, String> {
        let src = crate::input::read_text(path, crate::input::MAX_CONFIG_BYTES)?;
        Self::from_toml(&src, path, block_size, registry)
    }

    /// What cannot work in this configuration with blocks of `block`
    /// tokens, found before anything runs (the engine checks the rest):
    /// windows off the block grid, sharing without a cold tier, a policy
    /// the registry does not know or refuses.
    pub fn check(&self, block: usize, registry: &Registry) -> Result<(), String> {
        self.validate(block, registry).map(|_| ())
    }

    /// [`check`](Self::check), returning the policy factories it built
    /// (each built and run once to check it), for [`apply`](Self::apply)
    /// to hand the engine: a policy is checked and built in one place.
    fn validate(&self, block: usize, registry: &Registry) -> Result<Policies, String> {
        if let Some(name) = &self.name {
            if name.is_empty() || name.contains([',', '\n', '|']) {
                return Err("a name must be non-empty, without commas or |".into());
            }
        }
        if !(1..=4096).contains(&block) {
            return Err(format!("block_size must be within 1..=4096, not {block}"));
        }
        if self.budget_bytes().is_none() {
            return Err(format!(
                "budget_mib = {} is too large (at most {} MiB)",
                self.budget_mib, MAX_BUDGET_MIB
            ));
        }
        if let Some(c) = &self.cold {
            if c.window % block != 0 || c.sink % block != 0 {
                return Err(format!(
                    "cold.window and cold.sink must be multiples of the block size {block}"
                ));
            }
        }
        let cold = self.cold.is_some();
        let mut built = Policies::default();
        if let Some(t) = &self.tier {
            // It decides which blocks go cold.
            rules::needs_cold_tier("tier", cold)?;
            built.tier = Some(registry.tier(t, block)?);
        }
        if self.share.is_some() {
            // It shares quantized blocks.
            rules::needs_cold_tier("share", cold)?;
        }
        if let Some(kvforge_coordinator::DedupConfig::SimHash(c)) =
            self.share.map(ShareSpec::config)
        {
            c.validate().map_err(|e| e.to_string())?;
        }
        if let Some(e) = &self.eviction {
            let tier_policy = self.tier.is_some();
            let f = eviction::checked(registry, e, block, self.cold.as_ref(), tier_policy)?;
            built.eviction = Some(f);
        }
        if let Some(msg) = self.lifecycle.and_then(LifecycleSpec::problem) {
            return Err(msg);
        }
        if let Some(r) = &self.remote {
            if let Some(msg) = r.problem(self.cold.is_some(), self.prefix.is_some()) {
                return Err(msg);
            }
        }
        Ok(built)
    }

    /// Sets `cfg`'s mechanisms (the block size too, when named), the
    /// eviction policy built by `registry`; returns the reuse to run with
    /// (hash seed: the file's, else `seed`). Refuses a `remote` tier, which
    /// only the server uses (it takes it out first).
    pub fn apply(
        &self,
        cfg: &mut EngineConfig,
        registry: &Registry,
        seed: Option<u64>,
    ) -> Result<ReuseConfig, String> {
        if let Some(b) = self.block_size {
            cfg.block_size = b;
        }
        let built = self.validate(cfg.block_size, registry)?;
        if self.remote.is_some() {
            // `kvforge serve` takes it out and connects; elsewhere it would
            // be silently ignored.
            return Err("remote = { … } is used by `kvforge serve` only".into());
        }
        if self.target_kv.is_some() || self.workloads.is_some() {
            // The ablation resolves them into budgets and item lists.
            return Err(
                "target_kv and workloads are keys of an ablation's [[config]] (`cargo xtask ablate`), not of the engine: give the budget itself".into(),
            );
        }
        cfg.kv_quant = self.cold;
        cfg.policies.eviction = built.eviction;
        cfg.policies.tier = built.tier;
        cfg.dedup = self.share.map(ShareSpec::config);
        cfg.lifecycle = self.lifecycle.map(LifecycleSpec::config);
        cfg.kv_budget = self.budget_bytes().unwrap_or(0);
        let p = self.prefix.unwrap_or_default();
        Ok(ReuseConfig {
            enabled: self.prefix.is_some(),
            index: p.index.into(),
            tail: p.tail.into(),
            seed: p.seed.or(seed),
        })
    }

    /// `budget_mib` in bytes; `None` above [`MAX_BUDGET_MIB`] (it would
    /// wrap, and 0 means "no budget").
    pub fn budget_bytes(&self) -> Option<u64> {
        (self.budget_mib <= MAX_BUDGET_MIB).then_some(self.budget_mib << 20)
    }

    /// The mechanisms in a few words (`full cache` when none is on), the
    /// eviction policy by its own name, for blocks of `block` tokens.
    pub fn describe(&self, block: usize, registry: &Registry) -> String {
        let mut parts = Vec::new();
        if let Some(p) = self.prefix {
            parts.push(format!("prefix {:?}/{:?}", p.index, p.tail).to_lowercase());
        }
        if let Some(c) = self.cold {
            let rot = if c.rotate { " rot" } else { "" };
            parts.push(match &self.tier {
                // Its window and sink are the tier policy's business.
                Some(_) => format!("cold int{}{rot}", c.bits),
                None => format!("cold int{} w{} s{}{rot}", c.bits, c.window, c.sink),
            });
        }
        if let Some(e) = &self.eviction {
            let built = registry
                .eviction(e, self.block_size.unwrap_or(block), self.cold.is_some())
                .and_then(|f| f());
            parts.push(match built {
                Ok(p) => format!("evict {}", p.name()),
                Err(_) => format!("evict {}", e.policy),
            });
        }
        if let Some(t) = &self.tier {
            let params = t.params.iter().map(|(k, v)| format!(" {k}={v}"));
            parts.push(format!("tier {}{}", t.policy, params.collect::<String>()));
        }
        if let Some(share) = self.share {
            parts.push(share.label());
        }
        if let Some(l) = self.lifecycle {
            parts.push(l.label());
        }
        if self.budget_mib > 0 {
            parts.push(format!("budget {} MiB", self.budget_mib));
        }
        if let Some(b) = self.block_size {
            parts.push(format!("block {b}"));
        }
        if let Some(r) = &self.remote {
            let blocks = if r.cold_blocks(self.cold.is_some()) {
                "cold"
            } else {
                "hot"
            };
            parts.push(format!("remote {blocks}"));
        }
        if parts.is_empty() {
            "full cache".into()
        } else {
            parts.join(", ")
        }
    }
}

/// `file:line:col: message (at `source line`)`, on one line: where `span`
/// (of `src`, read from `path`) starts; the file alone without a span.
pub fn located(path: &Path, src: &str, span: Option<Range<usize>>, msg: &str) -> String {
    let msg = msg.trim().replace('\n', " ");
    let Some(span) = span else {
        return format!("{}: {msg}", path.display());
    };
    let start = span.start.min(src.len());
    let before = &src[..start];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = src[line_start..start].chars().count() + 1;
    let text = src[line_start..]
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .chars()
        .take(60)
        .collect::<String>();
    format!("{}:{line}:{col}: {msg} (at `{text}`)", path.display())
}
