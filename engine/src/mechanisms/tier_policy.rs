//! Tier policies a mechanisms file names: `tier = { policy = "…", … }`
//! replaces the cold tier's sink-and-window plan with another
//! [`TierPolicy`](kvforge_quant::TierPolicy). kvforge's own plan is `cold`'s, so no name is built in:
//! the names come from the registry's tier resolver (the kvforge Python
//! package's registry builds `"module:Class"` names).

use std::sync::Arc;

use crate::policies::TierFactory;

use super::registry::{PolicyParams, Registry, TierResolver};
use super::specs::PolicySpec;

impl Registry {
    /// The same, looking up tier policy names in `resolver` (replacing an
    /// earlier one).
    pub fn with_tier_resolver(mut self, resolver: TierResolver) -> Self {
        self.tier_resolver = Some(resolver);
        self
    }

    /// A factory of the tier policy `spec` names, checked by building one
    /// now: a name nothing resolves, or a bad parameter, is an error.
    pub fn tier(&self, spec: &PolicySpec, block_size: usize) -> Result<TierFactory, String> {
        let Some(build) = self.tier_resolver.as_ref().and_then(|r| r(&spec.policy)) else {
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
