//! `/dashboard` and its stream: the page is served whole (nothing fetched
//! from elsewhere), and the snapshots carry the tiers' bytes and the
//! budget, and mark a demotion when a request sends blocks to the cold
//! tier.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TIMEOUT, TestServer, chat, tiny_engine};
use kvforge_engine::{Axis, EngineConfig, KvQuant};
use std::time::Duration;

use kvforge_server::client;
use kvforge_server::sched::ProbeConfig;
use kvforge_server::{SchedConfig, ServerConfig};
use serde_json::Value;

#[test]
fn the_page_is_self_contained() {
    let s = TestServer::tiny(ServerConfig::default());
    let r = s.get("/dashboard");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/html"));
    let page = String::from_utf8(r.bytes().unwrap()).unwrap();
    assert!(page.contains("new EventSource(\"dashboard/stream\")"));
    // Offline: no script, style or font from another host.
    for outside in ["http://", "https://", "//cdn"] {
        assert!(!page.contains(outside), "the page names {outside}");
    }
}

#[test]
fn snapshots_carry_the_tiers_and_mark_a_demotion() {
    let cfg = EngineConfig {
        block_size: 4,
        kv_quant: Some(KvQuant {
            bits: 4,
            group_size: 8,
            window: 8,
            rotate: false,
            key_axis: Axis::PerChannel,
            sink: 0,
        }),
        ..EngineConfig::default()
    };
    let s = TestServer::start(tiny_engine(&cfg, 1024), ServerConfig::default());
    let r = client::request(&s.addr, "GET", "/dashboard/stream", &[], b"", TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    let mut ev = r.events();
    let mut next = || -> Value { serde_json::from_str(&ev.next().unwrap().unwrap()).unwrap() };
    let first = next();
    let tiers: Vec<&str> = first["cache"]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tier"].as_str().unwrap())
        .collect();
    assert_eq!(tiers.len(), 2, "{first}");
    assert_eq!(tiers[0], "hot");
    assert!(first["cache"]["budget_bytes"].as_u64().unwrap() > 0);
    assert!(first["marks"].as_array().unwrap().is_empty());
    // A prompt longer than the hot window: its older blocks go cold.
    let r = s.post("/v1/chat/completions", &chat(&"word ".repeat(60), 4));
    assert_eq!(r.status, 200);
    // Bounded: the marker, and the finished request's timings, come
    // with the next snapshots (those taken while the request ran come
    // first); bounded by time, not by a count a slow machine could exceed.
    let mut marked = false;
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        let snap = next();
        assert!(snap["sequences"].is_array());
        let marks = snap["marks"].as_array().unwrap();
        if let Some(m) = marks.iter().find(|m| m["kind"] == "demotion") {
            assert!(m["count"].as_u64().unwrap() > 0);
            let demoted = &snap["cache"]["policies"]["demoted_blocks"];
            assert!(demoted.as_u64().unwrap() > 0);
            marked = true;
        }
        let recent = snap["recent"].as_array().unwrap();
        if marked && !recent.is_empty() {
            assert_eq!(recent.len(), 1, "{snap}");
            assert_eq!(recent[0]["tokens"], 4);
            let (ttft, all) = (recent[0]["ttft"].as_f64(), recent[0]["seconds"].as_f64());
            assert!(ttft.unwrap() <= all.unwrap());
            return;
        }
    }
    panic!("no demotion marker and finished request in a minute of snapshots");
}

/// A slice of the real tokenizer's ids (the tiny model reads them).
fn slice(n: usize) -> Vec<u32> {
    let tok = tiny_engine(&EngineConfig::default(), 256)
        .tokenizer()
        .clone();
    let text = "The cache keeps the keys and values of every token it has read. ".repeat(40);
    let mut ids = tok.encode_text(&text).unwrap();
    ids.truncate(n);
    assert_eq!(ids.len(), n);
    ids
}

#[test]
fn the_probe_through_a_plain_cache_matches_the_full_cache() {
    let probe = ProbeConfig {
        tokens: slice(96),
        every: Duration::from_millis(500),
    };
    let cfg = ServerConfig {
        sched: SchedConfig {
            probe: Some(probe),
            ..SchedConfig::default()
        },
        ..ServerConfig::default()
    };
    let s = TestServer::tiny(cfg);
    let r = client::request(&s.addr, "GET", "/dashboard/stream", &[], b"", TIMEOUT).unwrap();
    let mut ev = r.events();
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        let snap: Value = serde_json::from_str(&ev.next().unwrap().unwrap()).unwrap();
        let p = &snap["probe"];
        let full = p["full_cache"].as_f64().unwrap();
        assert!(full > 1.0, "{p}");
        if let Some(live) = p["last"]["ppl"].as_f64() {
            // Streamed in chunks of 16 through f16 pages against one pass
            // over f32 KV: 9.5e-5 apart in the engine's test; 1e-3 here.
            assert!((live / full - 1.0).abs() < 1e-3, "{p}");
            assert!(p["error"].is_null());
            assert!(p["last"]["kv_bytes"].as_u64().unwrap() > 0);
            return;
        }
    }
    panic!("no probe in a minute of snapshots");
}

#[test]
fn a_probe_too_short_or_never_due_is_refused_at_start() {
    for (tokens, every, want) in [
        (slice(40), Duration::from_secs(1), "at least 48"),
        (slice(64), Duration::ZERO, "--probe-every"),
    ] {
        let cfg = ServerConfig {
            sched: SchedConfig {
                probe: Some(ProbeConfig { tokens, every }),
                ..SchedConfig::default()
            },
            ..ServerConfig::default()
        };
        let engine = tiny_engine(&EngineConfig::default(), 256);
        let e = kvforge_server::Server::start(engine, cfg).err().unwrap();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn a_watermark_policy_s_fractions_reach_the_page() {
    let mut cfg = EngineConfig::default();
    let params = serde_json::json!({"sink": 4, "window": 16, "high": 0.9, "low": 0.7});
    cfg.evict_with(&kvforge_engine::Registry::builtin(), "h2o", params)
        .unwrap();
    for (engine, want) in [
        (tiny_engine(&cfg, 1024), serde_json::json!([0.9, 0.7])),
        (tiny_engine(&EngineConfig::default(), 1024), Value::Null),
    ] {
        let s = TestServer::start(engine, ServerConfig::default());
        let r = client::request(&s.addr, "GET", "/dashboard/stream", &[], b"", TIMEOUT).unwrap();
        let first: Value = serde_json::from_str(&r.events().next().unwrap().unwrap()).unwrap();
        assert_eq!(first["cache"]["watermark"], want);
    }
}
