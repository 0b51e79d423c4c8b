//! Unit tests of the mechanisms file and the registry.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use super::*;

fn parse(src: &str) -> Result<Mechanisms, String> {
    Mechanisms::from_toml(src, Path::new("m.toml"), 16, &Registry::builtin())
}

#[test]
fn a_file_sets_every_mechanism_of_an_engine_config() {
    let m = parse(
        "prefix = { index = \"radix\", tail = \"seal\", seed = 5 }\n\
         cold = { format = \"int4\", window = 64, sink = 16, keys = \"token\", rotate = true }\n\
         eviction = { policy = \"keydiff\", sink = 16, window = 128, budget_tokens = 256 }\n\
         share = { policy = \"exact\" }\n\
         lifecycle = { policy = \"rule\", protect = 2, delay = 1 }\n\
         budget_mib = 3\n",
    )
    .unwrap();
    let mut cfg = EngineConfig::default();
    let reuse = m.apply(&mut cfg, &Registry::builtin(), Some(9)).unwrap();
    assert!(reuse.enabled);
    assert_eq!(reuse.seed, Some(5), "the file's seed wins");
    let q = cfg.kv_quant.unwrap();
    assert_eq!((q.bits, q.window, q.sink, q.rotate), (4, 64, 16, true));
    assert_eq!(q.key_axis, kvforge_quant::Axis::PerToken);
    assert_eq!(cfg.kv_budget, 3 << 20);
    assert!(cfg.dedup.is_some() && cfg.lifecycle.is_some());
    let policy = (cfg.policies.eviction.unwrap())().unwrap();
    assert!(policy.name().contains("keydiff"), "{}", policy.name());
    assert_eq!(
        m.describe(16, &Registry::builtin()),
        format!(
            "prefix radix/seal, cold int4 w64 s16 rot, evict {}, share exact, lifecycle rule p2 k1, budget 3 MiB",
            policy.name()
        )
    );
    assert_eq!(
        Mechanisms::default().describe(16, &Registry::builtin()),
        "full cache"
    );
}

#[test]
fn what_cannot_work_is_one_line_naming_the_file() {
    let cases = [
        ("budget_mb = 1\n", "m.toml:1:1: unknown field `budget_mb`"),
        ("cold = { format = \"int3\", window = 16 }\n", "int3"),
        (
            "cold = { format = \"int4\", window = 20 }\n",
            "multiples of the block size 16",
        ),
        (
            "share = { policy = \"exact\" }\n",
            "share needs a cold tier",
        ),
        (
            "eviction = { sink = 4, window = 8 }\n",
            "missing field `policy`",
        ),
        ("eviction = { policy = 3 }\n", "policy must be a name"),
        (
            "eviction = { policy = \"nope\" }\n",
            "unknown eviction policy \"nope\"; known: h2o, hybrid, keydiff, lfu, sink-window, snapkv",
        ),
        (
            "eviction = { policy = \"lfu\", sink = 4, window = 8 }\n",
            "either budget_tokens or both high and low",
        ),
        (
            "cold = { format = \"int4\", window = 32 }\n\
             eviction = { policy = \"keydiff\", per_head = true, sink = 4, window = 64, budget_tokens = 96 }\n",
            "does not combine with a cold tier",
        ),
        (
            "cold = { format = \"int4\", window = 32 }\n\
             eviction = { policy = \"sink-window\", sink = 4, window = 16 }\n",
            "inside the cold tier's hot window",
        ),
        (
            "lifecycle = { policy = \"recent-turns\", keep = 0 }\n",
            "lifecycle.keep must be at least 1",
        ),
        ("block_size = 0\n", "block_size must be within 1..=4096"),
        // Found by the red team of the ablation's inputs: a budget that
        // wrapped to 0 bytes, unknown keys beside `policy = "exact"`.
        (
            "budget_mib = 17592186044416\n",
            "budget_mib = 17592186044416 is too large (at most 1073741824 MiB)",
        ),
        (
            "cold = { format = \"int4\", window = 32 }\n\
             share = { policy = \"exact\", anything = \"goes\" }\n",
            "unknown field `anything`",
        ),
        (
            "cold = { format = \"int4\", window = 32 }\n\
             share = { policy = \"exact\", threshold = 0.9 }\n",
            "unknown field `threshold`",
        ),
    ];
    for (src, want) in cases {
        let e = parse(src).unwrap_err();
        assert!(e.contains(want) && !e.contains('\n'), "{src:?}: {e}");
        assert!(e.starts_with("m.toml"), "{e}");
    }
}

#[test]
fn a_registered_policy_is_named_like_a_builtin_and_checked_the_same() {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct P {
        window: usize,
    }
    let registry = Registry::builtin().with_eviction("mine", |p| {
        let P { window } = p.parse()?;
        let policy = kvforge_evict::SinkWindow::new(0, window).map_err(|e| e.to_string())?;
        Ok(Box::new(policy))
    });
    let src = "eviction = { policy = \"mine\", window = 32 }\n";
    let m = Mechanisms::from_toml(src, Path::new("m.toml"), 16, &registry).unwrap();
    let mut cfg = EngineConfig::default();
    m.apply(&mut cfg, &registry, None).unwrap();
    assert_eq!(
        (cfg.policies.eviction.unwrap())().unwrap().name(),
        "sink0-window32"
    );
    let bad = "eviction = { policy = \"mine\", window = 0 }\n";
    let e = Mechanisms::from_toml(bad, Path::new("m.toml"), 16, &registry).unwrap_err();
    assert!(
        e.contains("eviction mine:") && e.contains("at least one token"),
        "{e}"
    );
    assert!(
        parse(src)
            .unwrap_err()
            .contains("unknown eviction policy \"mine\"")
    );
}

#[test]
fn a_remote_tier_is_read_checked_and_refused_outside_the_server() {
    let m = parse(
        "prefix = {}\ncold = { format = \"int4\", window = 64, sink = 16 }\n\
         remote = { url = \"redis://127.0.0.1:6379\", seed = 42 }\n",
    )
    .unwrap();
    let r = m.remote.clone().unwrap();
    assert_eq!(
        (r.ttl_s, r.deadline_ms, r.queue_blocks, r.cluster),
        (3600, 250, 1024, false)
    );
    assert!(
        r.cold_blocks(true),
        "cold blocks by default with a cold tier"
    );
    assert!(
        m.describe(16, &Registry::builtin())
            .ends_with("remote cold")
    );
    let e = m
        .apply(&mut EngineConfig::default(), &Registry::builtin(), None)
        .unwrap_err();
    assert!(e.contains("kvforge serve"), "{e}");
    for (src, want) in [
        (
            "prefix = {}\nremote = { url = \"redis://h:1\" }",
            "missing field `seed`",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://h:1\", seed = 1, bogus = 2 }",
            "unknown field `bogus`",
        ),
        (
            "prefix = {}\nremote = { url = \"http://h:1\", seed = 1 }",
            "must be redis://",
        ),
        (
            "prefix = {}\nremote = { url = \"rediss://h:1\", seed = 1 }",
            "TLS",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://a:1,redis://b:2\", seed = 1 }",
            "cluster = true",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://h:1\", seed = 1, deadline_ms = 0 }",
            "deadline_ms",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://h:1\", seed = 1, queue_blocks = 0 }",
            "queue_blocks",
        ),
        (
            "remote = { url = \"redis://h:1\", seed = 1 }",
            "needs prefix reuse",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://h:1\", seed = 1, blocks = \"cold\" }",
            "needs a cold tier",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://h:1\", seed = -1 }",
            "invalid value",
        ),
    ] {
        let e = parse(src).unwrap_err();
        assert!(e.contains(want), "{src}: {e}");
        assert!(!e.contains('\n'), "{e}");
    }
}

#[test]
fn the_ablations_own_keys_are_refused_by_the_engine() {
    for src in [
        "eviction = { policy = \"sink-window\", sink = 16, window = 64 }\ntarget_kv = 0.5",
        "workloads = [\"chat\"]",
    ] {
        let m = parse(src).unwrap();
        let e = m
            .apply(&mut EngineConfig::default(), &Registry::builtin(), None)
            .unwrap_err();
        assert!(e.contains("cargo xtask ablate"), "{e}");
    }
}

#[test]
fn a_resolver_builds_names_no_registry_holds_and_says_what_a_colon_name_is() {
    // A registry with a resolver of `rust-test:` names; the builtin one,
    // without it, does not reach them (nothing is process-wide).
    let registry = Registry::builtin().with_resolver(std::sync::Arc::new(|name: &str| {
        let window: usize = name.strip_prefix("rust-test:window")?.parse().ok()?;
        let b: EvictionBuilder = std::sync::Arc::new(move |_p| {
            Ok(Box::new(
                kvforge_evict::SinkWindow::new(0, window).map_err(|e| e.to_string())?,
            ))
        });
        Some(b)
    }));
    let src = "eviction = { policy = \"rust-test:window64\" }";
    let m = Mechanisms::from_toml(src, Path::new("m.toml"), 16, &registry).unwrap();
    let mut cfg = EngineConfig::default();
    m.apply(&mut cfg, &registry, None).unwrap();
    let built = (cfg.policies.eviction.unwrap())().unwrap();
    assert_eq!(built.name(), "sink0-window64");
    let e = parse(src).unwrap_err();
    assert!(
        e.contains("unknown eviction policy \"rust-test:window64\""),
        "{e}"
    );
    let e = parse("eviction = { policy = \"mymod:Mine\" }").unwrap_err();
    assert!(e.contains("unknown eviction policy \"mymod:Mine\""), "{e}");
    assert!(e.contains("written in Python"), "{e}");
    let e = parse("eviction = { policy = \"nope\" }").unwrap_err();
    assert!(!e.contains("Python"), "{e}");
}

#[test]
fn a_tier_policy_is_named_through_the_tier_resolver_and_needs_a_cold_tier() {
    // A registry with a tier resolver of `rust-test:` names.
    let registry = Registry::builtin().with_tier_resolver(std::sync::Arc::new(|name: &str| {
        let window: usize = name.strip_prefix("rust-test:plan")?.parse().ok()?;
        let b: TierBuilder = std::sync::Arc::new(move |p| {
            let plan = kvforge_quant::TierPlan::new(p.block_size, window);
            Ok(Box::new(plan.map_err(|e| e.to_string())?))
        });
        Some(b)
    }));
    let parse = |src: &str| Mechanisms::from_toml(src, Path::new("m.toml"), 16, &registry);
    let cold = "cold = { format = \"int4\", window = 32 }\n";
    let src = format!("{cold}tier = {{ policy = \"rust-test:plan64\" }}");
    let m = parse(&src).unwrap();
    let mut cfg = EngineConfig::default();
    m.apply(&mut cfg, &registry, None).unwrap();
    assert!((cfg.policies.tier.unwrap())().is_ok());
    assert_eq!(
        m.describe(16, &registry),
        "cold int4, tier rust-test:plan64"
    );
    // The builtin registry has no tier resolver.
    let e = Mechanisms::from_toml(&src, Path::new("m.toml"), 16, &Registry::builtin());
    assert!(e.unwrap_err().contains("unknown tier policy"));
    // Its builder's refusal, an unknown name, no cold tier: one line each.
    for (src, want) in [
        (
            format!("{cold}tier = {{ policy = \"rust-test:plan20\" }}"),
            "tier rust-test:plan20: ",
        ),
        (
            format!("{cold}tier = {{ policy = \"mymod:Mine\" }}"),
            "unknown tier policy \"mymod:Mine\" (a \"module:Class\" name is a policy written in Python",
        ),
        (
            format!("{cold}tier = {{ policy = \"plan\" }}"),
            "unknown tier policy \"plan\" (kvforge's own plan is the cold tier's window and sink)",
        ),
        (
            "tier = { policy = \"rust-test:plan64\" }".to_string(),
            "tier needs a cold tier",
        ),
    ] {
        let e = parse(&src).unwrap_err();
        assert!(e.contains(want) && !e.contains('\n'), "{src:?}: {e}");
    }
}

/// A policy is built once between a checked file and the cache it runs
/// in: `apply` checks and builds it, and the cache's first coordinator
/// takes that object; only a later rebuild of the coordinator builds
/// another (a policy holds per-sequence state).
#[test]
fn apply_and_the_first_coordinator_build_a_policy_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::{Device, Kind, LlamaConfig, PagedKvCache};

    let builds = Arc::new(AtomicUsize::new(0));
    let counted = builds.clone();
    let registry = Registry::builtin().with_eviction("counted", move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(
            kvforge_evict::SinkWindow::new(0, 64).map_err(|e| e.to_string())?,
        ))
    });
    let m: Mechanisms = toml::from_str("eviction = { policy = \"counted\" }\n").unwrap();
    let mut cfg = EngineConfig::default();
    m.apply(&mut cfg, &registry, None).unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 1, "apply checks by building");
    let mc = LlamaConfig::tiny();
    let mut cache = PagedKvCache::new(&mc, 16, 256, Device::Cpu, Kind::Float).unwrap();
    let base = cache.base_config();
    cache.configure_with(base, None, cfg.policies).unwrap();
    assert_eq!(
        builds.load(Ordering::SeqCst),
        1,
        "the checked object serves"
    );
    cache.set_cold_tier(None).unwrap();
    assert_eq!(
        builds.load(Ordering::SeqCst),
        2,
        "a new coordinator, a fresh policy"
    );
}

/// `EngineConfig::evict_with` builds a registry policy with a table's
/// checks: an unknown name, a parameter that is not a table, a bad
/// parameter and a window inside the cold tier's hot window are errors
/// that leave the configuration without a policy.
#[test]
fn evict_with_builds_a_named_policy_with_the_tables_checks() {
    let r = Registry::builtin();
    let mut cfg = EngineConfig {
        block_size: 16,
        kv_quant: Some(crate::tier::KvQuant {
            bits: 4,
            group_size: 32,
            window: 64,
            rotate: false,
            key_axis: kvforge_quant::Axis::PerChannel,
            sink: 16,
        }),
        ..EngineConfig::default()
    };
    let bad = [
        (
            "lru",
            serde_json::json!({ "sink": 16, "window": 64 }),
            "unknown eviction policy",
        ),
        (
            "sink-window",
            serde_json::json!([16, 64]),
            "must be a table",
        ),
        ("sink-window", serde_json::json!({ "sink": 16 }), "window"),
        (
            "sink-window",
            serde_json::json!({ "sink": 16, "window": 32 }),
            "at least as long",
        ),
    ];
    for (name, params, want) in bad {
        let e = cfg.evict_with(&r, name, params).unwrap_err();
        assert!(e.contains(want), "{name}: {e}");
        assert!(cfg.policies.eviction.is_none());
    }
    cfg.evict_with(
        &r,
        "sink-window",
        serde_json::json!({ "sink": 16, "window": 64 }),
    )
    .unwrap();
    let policy = (cfg.policies.eviction.unwrap())().unwrap();
    assert!(policy.name().contains("sink"), "{}", policy.name());
}
