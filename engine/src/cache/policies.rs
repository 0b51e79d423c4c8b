//! A researcher's policy objects in the cache: installed in every
//! coordinator it builds.

use kvforge_coordinator::{Coordinator, CoordinatorConfig, rules};

use crate::error::{EngineError, Result};
use crate::policies::Policies;
use crate::tier::KvQuant;

use super::PagedKvCache;

impl PagedKvCache {
    /// Runs `policies`' objects in place of the configured ones, from now
    /// on and in every coordinator [`configure`](Self::configure) builds.
    /// Refused, changing nothing, while sequences hold KV, or when a
    /// policy cannot run here (a tier policy without a cold tier, a policy
    /// that packs hot blocks beside one).
    pub fn set_policies(&mut self, policies: Policies) -> Result<()> {
        self.configure_with(self.config(), self.cold_tier(), policies)
    }

    /// [`configure`](Self::configure) and [`set_policies`](Self::set_policies)
    /// at once: one coordinator built, with `policies` installed in it.
    /// Errors change nothing.
    pub fn configure_with(
        &mut self,
        cfg: CoordinatorConfig,
        quant: Option<KvQuant>,
        policies: Policies,
    ) -> Result<()> {
        let old = std::mem::replace(&mut self.policies, policies);
        let r = self.configure(cfg, quant);
        if r.is_err() {
            self.policies = old;
        }
        r
    }

    /// The policy objects it runs ([`set_policies`](Self::set_policies)).
    pub fn policies(&self) -> &Policies {
        &self.policies
    }
}

/// Installs `p`'s objects into `c` (freshly built, nothing in it).
pub(super) fn install(c: &mut Coordinator, p: &Policies) -> Result<()> {
    if let Some(f) = &p.eviction {
        let ev = f().map_err(EngineError::Request)?;
        let (bs, cold) = (c.config().layout.block_size(), c.config().cold.is_some());
        rules::eviction_fits(ev.as_ref(), bs, cold).map_err(EngineError::Request)?;
        c.set_eviction_policy(Some(ev));
    }
    if let Some(f) = &p.tier {
        c.set_tier_policy(f().map_err(EngineError::Request)?)?;
    }
    if let Some(f) = &p.lifecycle {
        let (policy, params) = f().map_err(EngineError::Request)?;
        c.set_lifecycle_policy(Some((policy, params)))?;
    }
    Ok(())
}
