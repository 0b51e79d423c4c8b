//! Eviction by name: the one way a policy of the [`Registry`] reaches an
//! engine, from a mechanisms file's `[eviction]` table or from code
//! ([`EngineConfig::evict_with`]), with the same checks either way.

use kvforge_coordinator::rules;

use crate::engine::EngineConfig;
use crate::policies::EvictionFactory;
use crate::tier::KvQuant;

use super::registry::Registry;
use super::specs::PolicySpec;

/// The policy `spec` names, built by `registry` for blocks of `block`
/// tokens beside the cold tier `cold` (if any): the registry's checks, and
/// a protected recent `window` at least the cold tier's hot window (unless
/// a tier policy replaces its plan, `tier_policy`).
pub(super) fn checked(
    registry: &Registry,
    spec: &PolicySpec,
    block: usize,
    cold: Option<&KvQuant>,
    tier_policy: bool,
) -> Result<EvictionFactory, String> {
    let built = registry.eviction(spec, block, cold.is_some())?;
    // A protected recent window inside the hot window would drop blocks
    // before they could go cold.
    let window = spec
        .params
        .get("window")
        .and_then(serde_json::Value::as_u64);
    if let (Some(c), Some(w), false) = (cold, window, tier_policy) {
        rules::window_fits(usize::try_from(w).unwrap_or(usize::MAX), c.window)?;
    }
    Ok(built)
}

impl EngineConfig {
    /// Evicts with the policy `name` of `registry`, built from `params` (a
    /// JSON object: the keys of a mechanisms file's `[eviction]` table but
    /// `policy`) for this configuration's block size and cold tier, with
    /// that table's checks; set `block_size` and `kv_quant` first.
    pub fn evict_with(
        &mut self,
        registry: &Registry,
        name: &str,
        params: serde_json::Value,
    ) -> Result<(), String> {
        let serde_json::Value::Object(params) = params else {
            return Err(format!(
                "the parameters of {name:?} must be a table, not {params}"
            ));
        };
        let spec = PolicySpec {
            policy: name.to_string(),
            params,
        };
        let f = checked(
            registry,
            &spec,
            self.block_size,
            self.kv_quant.as_ref(),
            false,
        )?;
        self.policies.eviction = Some(f);
        Ok(())
    }
}
