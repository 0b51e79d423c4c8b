//! The combination rules: which policies compose with which cache. Each is
//! written once, here. The coordinator checks them when it is built from
//! its configuration; the engine checks them when it installs a policy
//! object, and its registry checks a mechanisms file before any cache
//! exists, so every way in (a TOML file, a CLI flag, a policy object from
//! Python) gives the same answer in the same words.
//!
//! 1. An eviction policy that packs hot blocks (per KV head, or single
//!    tokens) does not combine with a cold tier ([`eviction_fits`]).
//! 2. Token-level eviction marks rows of blocks of at most
//!    [`MAX_HOLED_BLOCK`] tokens ([`eviction_fits`]).
//! 3. Scored eviction is per head or per token, not both ([`scored`]).
//! 4. A tier policy and sharing of duplicate blocks work in the cold tier:
//!    they need one ([`needs_cold_tier`]).
//! 5. An eviction policy's protected recent window is at least the cold
//!    tier's hot window: a shorter one drops blocks before they could go
//!    cold ([`window_fits`]).

use kvforge_evict::{EvictionPolicy, Scored};
use kvforge_pool::MAX_HOLED_BLOCK;

/// Whether eviction policy `p` can run in a cache of `block_size`-token
/// blocks, with or without a cold tier (rules 1 and 2).
pub fn eviction_fits(
    p: &dyn EvictionPolicy,
    block_size: u32,
    cold_tier: bool,
) -> Result<(), String> {
    if cold_tier && (p.per_lane() || p.token_level()) {
        return Err(format!(
            "eviction {}: it packs hot blocks (per head or per token); it does not combine with a cold tier yet",
            p.name()
        ));
    }
    if p.token_level() && block_size > MAX_HOLED_BLOCK {
        return Err(format!(
            "eviction {}: per_token marks rows of blocks of at most {MAX_HOLED_BLOCK} tokens, not {block_size}",
            p.name()
        ));
    }
    Ok(())
}

/// Scored eviction over whole entries, each KV head's pages, or single
/// tokens (rule 3).
pub fn scored(
    s: Scored,
    per_head: bool,
    per_token: bool,
) -> Result<Box<dyn EvictionPolicy>, String> {
    let e = |e: kvforge_evict::EvictError| e.to_string();
    Ok(match (per_head, per_token) {
        (true, true) => return Err("eviction is per_head or per_token, not both".into()),
        (true, false) => Box::new(s.per_head().map_err(e)?),
        (false, true) => Box::new(s.per_token().map_err(e)?),
        (false, false) => Box::new(s),
    })
}

/// `what` works in the cold tier: refused without one (rule 4).
pub fn needs_cold_tier(what: &str, cold_tier: bool) -> Result<(), String> {
    if cold_tier {
        Ok(())
    } else {
        Err(format!("{what} needs a cold tier"))
    }
}

/// An eviction window of `window` tokens beside a cold tier whose hot
/// window is `cold_window` tokens (rule 5).
pub fn window_fits(window: usize, cold_window: usize) -> Result<(), String> {
    if window < cold_window {
        return Err(format!(
            "an eviction window of {window} tokens inside the cold tier's hot window of {cold_window} drops blocks before they could go cold: make it at least as long"
        ));
    }
    Ok(())
}
