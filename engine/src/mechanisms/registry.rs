//! [`Registry`]: every eviction policy a mechanisms file can name, built
//! from its parameters. The built-in ones are registered by
//! [`Registry::builtin`]; a researcher's policy is one more line:
//!
//! ```
//! # use kvforge_engine::mechanisms::Registry;
//! # use kvforge_evict::SinkWindow;
//! #[derive(serde::Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct Params { window: usize }
//! let registry = Registry::builtin().with_eviction("mine", |p| {
//!     let Params { window } = p.parse()?;
//!     Ok(Box::new(SinkWindow::new(0, window).map_err(|e| e.to_string())?))
//! });
//! assert!(registry.eviction_names().contains(&"mine"));
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use kvforge_coordinator::rules;
use kvforge_evict::{EvictionPolicy, Score, Scored, SinkWindow, Trigger};
use kvforge_quant::TierPolicy;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::policies::EvictionFactory;

use super::specs::PolicySpec;

/// What a policy builder is given: the parameters of its table and the
/// cache it serves.
pub struct PolicyParams<'a> {
    params: &'a serde_json::Map<String, serde_json::Value>,
    /// Tokens per block of the cache.
    pub block_size: usize,
    /// Whether the cache has a cold tier.
    pub cold_tier: bool,
}

impl<'a> PolicyParams<'a> {
    pub(crate) fn new(
        params: &'a serde_json::Map<String, serde_json::Value>,
        block_size: usize,
        cold_tier: bool,
    ) -> Self {
        PolicyParams {
            params,
            block_size,
            cold_tier,
        }
    }

    /// The parameters read into `T`: a serde struct (deny unknown fields
    /// in it, and a misspelt parameter is an error).
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, String> {
        serde_json::from_value(serde_json::Value::Object(self.params.clone()))
            .map_err(|e| e.to_string())
    }
}

/// Scored eviction over whole entries (neither per head nor per token).
const PAGE: (bool, bool) = (false, false);

/// Builds one eviction policy from its parameters (or says why not).
pub type EvictionBuilder =
    Arc<dyn Fn(&PolicyParams<'_>) -> Result<Box<dyn EvictionPolicy>, String> + Send + Sync>;

/// Builds the eviction policy a name the registry does not hold stands
/// for, or `None` when the name is not its to build.
pub type Resolver = Arc<dyn Fn(&str) -> Option<EvictionBuilder> + Send + Sync>;

/// Builds one tier policy from its parameters (or says why not).
pub type TierBuilder =
    Arc<dyn Fn(&PolicyParams<'_>) -> Result<Box<dyn TierPolicy>, String> + Send + Sync>;

/// Builds the tier policy a name stands for, or `None` when the name is
/// not its to build.
pub type TierResolver = Arc<dyn Fn(&str) -> Option<TierBuilder> + Send + Sync>;

/// The policies a mechanisms file can name: eviction policies by name,
/// and where names it does not hold are looked up (the kvforge Python
/// package's registry resolves `"module:Class"` names to Python classes).
#[derive(Clone)]
pub struct Registry {
    eviction: BTreeMap<String, EvictionBuilder>,
    /// Builds eviction policies for names `eviction` does not hold.
    pub(super) resolver: Option<Resolver>,
    /// Builds every tier policy (kvforge's own plan has no name).
    pub(super) tier_resolver: Option<TierResolver>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("eviction", &self.eviction_names())
            .field("resolver", &self.resolver.is_some())
            .field("tier_resolver", &self.tier_resolver.is_some())
            .finish()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Registry::builtin()
    }
}

impl Registry {
    /// No policy at all.
    pub fn empty() -> Self {
        Registry {
            eviction: BTreeMap::new(),
            resolver: None,
            tier_resolver: None,
        }
    }

    /// kvforge's own: `sink-window` (StreamingLLM), `h2o`, `lfu`,
    /// `keydiff`, `snapkv` (both also `per_head` or `per_token`) and
    /// `hybrid` (recency, attention and frequency weighted).
    pub fn builtin() -> Self {
        Registry::empty()
            .with_eviction("sink-window", |p| {
                let SinkWindowParams { sink, window } = p.parse()?;
                Ok(Box::new(
                    SinkWindow::new(sink, window).map_err(|e| e.to_string())?,
                ))
            })
            .with_eviction("h2o", |p| {
                let q: H2oParams = p.parse()?;
                let t = trigger(q.budget_tokens, q.high, q.low)?;
                scored(
                    Score::AttentionEma { decay: q.decay },
                    t,
                    q.sink,
                    q.window,
                    PAGE,
                )
            })
            .with_eviction("lfu", |p| {
                let q: LfuParams = p.parse()?;
                let t = trigger(q.budget_tokens, q.high, q.low)?;
                scored(Score::Lfu, t, q.sink, q.window, PAGE)
            })
            .with_eviction("keydiff", |p| {
                let q: KeyDiffParams = p.parse()?;
                let t = trigger(q.budget_tokens, q.high, q.low)?;
                let lanes = (q.per_head, q.per_token);
                scored(Score::KeyDiff, t, q.sink, q.window, lanes)
            })
            .with_eviction("snapkv", |p| {
                let q: SnapKvParams = p.parse()?;
                let t = trigger(q.budget_tokens, q.high, q.low)?;
                let lanes = (q.per_head, q.per_token);
                let score = Score::SnapKv { window: q.observe };
                scored(score, t, q.sink, q.window, lanes)
            })
            .with_eviction("hybrid", |p| {
                let q: HybridParams = p.parse()?;
                let t = trigger(q.budget_tokens, q.high, q.low)?;
                let score = Score::Hybrid {
                    alpha: q.alpha,
                    beta: q.beta,
                    gamma: q.gamma,
                };
                scored(score, t, q.sink, q.window, PAGE)
            })
    }

    /// The same with `name` building an eviction policy (replacing one of
    /// that name).
    pub fn with_eviction(
        mut self,
        name: &str,
        build: impl Fn(&PolicyParams<'_>) -> Result<Box<dyn EvictionPolicy>, String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.eviction.insert(name.to_string(), Arc::new(build));
        self
    }

    /// The same, looking up eviction policy names it does not hold in
    /// `resolver` (replacing an earlier one): the kvforge Python package's
    /// registry builds `"module:Class"` names from Python classes this
    /// way.
    pub fn with_resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// The eviction policies it knows.
    pub fn eviction_names(&self) -> Vec<&str> {
        self.eviction.keys().map(String::as_str).collect()
    }

    /// A factory of the eviction policy `spec` names, checked by building
    /// one now: an unknown name, a bad parameter, or a policy that packs
    /// hot blocks (per head, per token) beside a cold tier, is an error.
    pub fn eviction(
        &self,
        spec: &PolicySpec,
        block_size: usize,
        cold_tier: bool,
    ) -> Result<EvictionFactory, String> {
        let resolved = || self.resolver.as_ref().and_then(|r| r(&spec.policy));
        let build = self.eviction.get(&spec.policy).cloned().or_else(resolved);
        let Some(build) = build else {
            let python = if spec.policy.contains(':') {
                " (a \"module:Class\" name is a policy written in Python: it runs under the kvforge Python package, as `cargo xtask ablate` runs such a file)"
            } else {
                ""
            };
            return Err(format!(
                "unknown eviction policy {:?}; known: {}{python}",
                spec.policy,
                self.eviction_names().join(", ")
            ));
        };
        let (params, name) = (spec.params.clone(), spec.policy.clone());
        let built = move || {
            build(&PolicyParams::new(&params, block_size, cold_tier))
                .map_err(|e| format!("eviction {name}: {e}"))
        };
        let first = built()?;
        let bs = u32::try_from(block_size).unwrap_or(u32::MAX);
        rules::eviction_fits(first.as_ref(), bs, cold_tier)?;
        Ok(Arc::new(crate::policies::first_then(first, built)))
    }
}

/// A budget in tokens, or high and low watermarks over the byte budget.
fn trigger(budget: Option<usize>, high: Option<f64>, low: Option<f64>) -> Result<Trigger, String> {
    match (budget, high, low) {
        (Some(n), None, None) => Ok(Trigger::Tokens(n)),
        (None, Some(high), Some(low)) => Ok(Trigger::Watermark { high, low }),
        _ => Err("give either budget_tokens or both high and low".into()),
    }
}

/// Scored eviction over whole entries (`lanes` = (false, false)), each KV
/// head's pages or single tokens: the combination rules decide what may
/// run ([`rules::scored`], [`rules::eviction_fits`]).
fn scored(
    score: Score,
    trigger: Trigger,
    sink: usize,
    window: usize,
    (per_head, per_token): (bool, bool),
) -> Result<Box<dyn EvictionPolicy>, String> {
    let s = Scored::new(score, trigger, sink, window).map_err(|e| e.to_string())?;
    rules::scored(s, per_head, per_token)
}

fn default_decay() -> f32 {
    0.9
}

/// SnapKV's default observation window (the paper's 32 queries).
fn default_observe() -> usize {
    32
}

/// StreamingLLM: the first `sink` and the newest `window` tokens.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SinkWindowParams {
    sink: usize,
    window: usize,
}

/// H2O: entries between the sink and the window, lowest attention EMA
/// first, when the trigger fires.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct H2oParams {
    sink: usize,
    window: usize,
    #[serde(default = "default_decay")]
    decay: f32,
    budget_tokens: Option<usize>,
    high: Option<f64>,
    low: Option<f64>,
}

/// LFU: the entries that drew more than their share least often go.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LfuParams {
    sink: usize,
    window: usize,
    budget_tokens: Option<usize>,
    high: Option<f64>,
    low: Option<f64>,
}

/// KeyDiff: the entries whose keys stand closest to the mean key go.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyDiffParams {
    sink: usize,
    window: usize,
    #[serde(default)]
    per_head: bool,
    #[serde(default)]
    per_token: bool,
    budget_tokens: Option<usize>,
    high: Option<f64>,
    low: Option<f64>,
}

/// SnapKV: the attention of the latest step's last `observe` queries.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapKvParams {
    sink: usize,
    window: usize,
    #[serde(default = "default_observe")]
    observe: usize,
    #[serde(default)]
    per_head: bool,
    #[serde(default)]
    per_token: bool,
    budget_tokens: Option<usize>,
    high: Option<f64>,
    low: Option<f64>,
}

/// The hybrid priority `α(1−recency) + β(1−attention) + γ(1−frequency)`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HybridParams {
    sink: usize,
    window: usize,
    alpha: f32,
    beta: f32,
    gamma: f32,
    budget_tokens: Option<usize>,
    high: Option<f64>,
    low: Option<f64>,
}
