//! Tier policies a mechanisms file names: `tier = { policy = "…", … }`
//! replaces the cold tier's sink-and-window plan with another
//! [`TierPolicy`]. kvforge's own plan is `cold`'s, so no name is built in:
//! the names come from a process-wide resolver (the kvforge Python
//! package installs one at import that builds `"module:Class"` names).

use std::sync::{Arc, OnceLock};

use kvforge_quant::TierPolicy;

use crate::policies::TierFactory;

use super::registry::{PolicyParams, Registry};
use super::specs::PolicySpec;

/// Builds one tier policy from its parameters (or says why not).
pub type TierBuilder =
    Arc<dyn Fn(&PolicyParams<'_>) -> Result<Box<dyn TierPolicy>, String> + Send + Sync>;

/// Builds the tier policy a name stands for, or `None` when the name is
/// not its to build.
pub type TierResolver = Arc<dyn Fn(&str) -> Option<TierBuilder> + Send + Sync>;

static TIER_RESOLVER: OnceLock<TierResolver> = OnceLock::new();

impl Registry {
    /// Installs, once per process, where mechanisms files' tier policy
    /// names are looked up; `false` when one was installed before (it
    /// stays).
    pub fn install_tier_resolver(resolver: TierResolver) -> bool {
        TIER_RESOLVER.set(resolver).is_ok()
    }

    /// A factory of the tier policy `spec` names, checked by building one
    /// now: a name nothing resolves, or a bad parameter, is an error.
    pub fn tier(&self, spec: &PolicySpec, block_size: usize) -> Result<TierFactory, String> {
        let Some(build) = TIER_RESOLVER.get().and_then(|r| r(&spec.policy)) else {
            let python = if spec.policy.contains(':') {
                " (a \"module:Class\" name is a policy written in Python: it runs under the kvforge Python package, as `cargo xtask ablate` runs such a file)"
            } else {
                " (kvforge's own plan is the cold tier's window and sink)"
            };
            return Err(format!("unknown tier policy {:?}{python}", spec.policy));
        };
        let (params, name) = (spec.params.clone(), spec.policy.clone());
        let built = move || {
            build(&PolicyParams::new(&params, block_size, true))
                .map_err(|e| format!("tier {name}: {e}"))
        };
        let first = built()?;
        Ok(Arc::new(crate::policies::first_then(first, built)))
    }
}
