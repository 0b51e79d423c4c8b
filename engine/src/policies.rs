//! Slots for a researcher's own policy objects: an engine built with
//! [`Policies`] in its [`EngineConfig`](crate::engine::EngineConfig) runs
//! them instead of the configured ones, in every coordinator its cache
//! builds. Each slot holds a factory (a policy keeps per-sequence state,
//! and a cache rebuilds its coordinator when it is reconfigured).

use std::sync::Arc;

use kvforge_evict::EvictionPolicy;
use kvforge_lifecycle::{LifecycleParams, LifecyclePolicy};
use kvforge_quant::TierPolicy;

/// Builds a fresh eviction policy (or says why it cannot).
pub type EvictionFactory = Arc<dyn Fn() -> Result<Box<dyn EvictionPolicy>, String> + Send + Sync>;
/// Builds a fresh tier policy (which hot blocks go cold).
pub type TierFactory = Arc<dyn Fn() -> Result<Box<dyn TierPolicy>, String> + Send + Sync>;
/// Builds a fresh lifecycle policy and how it acts.
pub type LifecycleFactory =
    Arc<dyn Fn() -> Result<(Box<dyn LifecyclePolicy>, LifecycleParams), String> + Send + Sync>;

/// A factory whose first call hands out `first` (the object a check built
/// and ran, unused since) and whose later calls `build` fresh ones: a
/// policy checked when its file is read is not built again for the first
/// coordinator it serves.
pub(crate) fn first_then<T: Send + 'static>(
    first: T,
    build: impl Fn() -> Result<T, String> + Send + Sync + 'static,
) -> impl Fn() -> Result<T, String> + Send + Sync + 'static {
    let first = std::sync::Mutex::new(Some(first));
    move || {
        let kept = first.lock().unwrap_or_else(|e| e.into_inner()).take();
        kept.map_or_else(&build, Ok)
    }
}

/// The policy objects an engine runs in place of the configured ones.
#[derive(Clone, Default)]
pub struct Policies {
    /// Replaces `EngineConfig::eviction`.
    pub eviction: Option<EvictionFactory>,
    /// Replaces the cold tier's window plan (needs a cold tier).
    pub tier: Option<TierFactory>,
    /// Replaces `EngineConfig::lifecycle`.
    pub lifecycle: Option<LifecycleFactory>,
}

impl Policies {
    /// A slot set with only `eviction`.
    pub fn eviction(
        f: impl Fn() -> Result<Box<dyn EvictionPolicy>, String> + Send + Sync + 'static,
    ) -> Self {
        Policies {
            eviction: Some(Arc::new(f)),
            ..Policies::default()
        }
    }

    /// Whether any slot is filled.
    pub fn any(&self) -> bool {
        self.eviction.is_some() || self.tier.is_some() || self.lifecycle.is_some()
    }
}

impl std::fmt::Debug for Policies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = |set: bool| if set { "custom" } else { "-" };
        f.debug_struct("Policies")
            .field("eviction", &name(self.eviction.is_some()))
            .field("tier", &name(self.tier.is_some()))
            .field("lifecycle", &name(self.lifecycle.is_some()))
            .finish()
    }
}
