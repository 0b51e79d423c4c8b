//! `/dashboard` and its stream: the page is served whole (nothing fetched
//! from elsewhere), and the snapshots carry the tiers' bytes and the
//! budget, and mark a demotion when a request sends blocks to the cold
//! tier.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TIMEOUT, TestServer, chat, tiny_engine};
use kvforge_engine::{Axis, EngineConfig, KvQuant};
use kvforge_server::ServerConfig;
use kvforge_server::client;
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
    // with the next snapshot or two (one taken while the request ran may
    // still be on its way).
    let mut marked = false;
    for _ in 0..5 {
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
    panic!("no demotion marker and finished request in five snapshots");
}
