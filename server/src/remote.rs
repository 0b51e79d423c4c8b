//! The remote tier a mechanisms file names (`remote = { url, seed, … }`),
//! connected: a [`RedisTier`] on the store, the engine's fingerprint, the
//! format blocks travel in.

use std::sync::Arc;
use std::time::Duration;

use kvforge_engine::Engine;
use kvforge_engine::cache::RemoteSetup;
use kvforge_engine::mechanisms::RemoteSpec;
use kvforge_remote::{RemoteOptions, Secret};
use kvforge_remote_redis::{RedisConfig, RedisTier};

/// What `engine` shares through the store `spec` names. Nothing connects
/// yet (a store that is down is a miss per request, not a failed start);
/// errors on a URL that does not parse, a model that cannot be read, or
/// no usable secret (`remote.secret_file`, else `KVFORGE_REMOTE_SECRET`).
pub fn connect(spec: &RemoteSpec, engine: &Engine) -> Result<RemoteSetup, String> {
    let ttl = (spec.ttl_s > 0).then(|| Duration::from_secs(spec.ttl_s));
    let tier = RedisTier::new(RedisConfig {
        urls: spec.url.split(',').map(|u| u.trim().to_string()).collect(),
        cluster: spec.cluster,
        ttl,
        deadline: Duration::from_millis(spec.deadline_ms),
    })?;
    let secret = Secret::from_file_or_env(spec.secret_file.as_deref())
        .map_err(|e| format!("remote: {e}"))?;
    let model = engine
        .fingerprint()
        .map_err(|e| format!("remote: fingerprinting the model: {e}"))?;
    Ok(RemoteSetup {
        store: Arc::new(tier),
        secret,
        seed: spec.seed,
        model,
        cold: spec.cold_blocks(engine.cache().cold_tier().is_some()),
        options: RemoteOptions {
            queue_blocks: spec.queue_blocks,
            // Written again (set-if-absent) once the store may have let
            // the key expire.
            remember_for: ttl.map_or(Duration::from_secs(3600), |t| t / 2),
            ..RemoteOptions::default()
        },
    })
}
