//! KV events on `/v1/kv_events`: a tenant's stream follows its own prefix
//! cache (blocks stored as requests end, removed as the pool reclaims
//! them), never another tenant's; a subscriber that fell behind the buffer
//! is told what it missed; bad subscriptions get their errors.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TIMEOUT, TestServer, chat, error_of, tiny_engine};
use kvforge_engine::EngineConfig;
use kvforge_server::ServerConfig;
use kvforge_server::client::{self, Events};
use serde_json::Value;

const CHAT: &str = "/v1/chat/completions";

fn subscribe(s: &TestServer, headers: &[(&str, &str)]) -> Events {
    let r = client::request(&s.addr, "GET", "/v1/kv_events", headers, b"", TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    r.events()
}

/// The next message's JSON.
fn next(ev: &mut Events) -> Value {
    serde_json::from_str(&ev.next().unwrap().unwrap()).unwrap()
}

/// Every event of a batch, with its type.
fn events_of(batch: &Value) -> Vec<Value> {
    batch["events"].as_array().unwrap().clone()
}

fn hashes(batch: &Value, kind: &str) -> Vec<u64> {
    events_of(batch)
        .iter()
        .filter(|e| e["type"] == kind)
        .flat_map(|e| e["block_hashes"].as_array().unwrap().clone())
        .map(|h| h.as_u64().unwrap())
        .collect()
}

fn keyed(keys: &[&str]) -> ServerConfig {
    ServerConfig {
        api_keys: keys.iter().map(|k| k.to_string()).collect(),
        kv_events: Some(64),
        ..ServerConfig::default()
    }
}

const PROMPT: &str = "A key-value cache keeps the attention keys and values of every token a model has read, so that the next token costs one step instead of the whole prompt again.";

#[test]
fn each_tenant_sees_its_own_blocks_stored_and_no_one_elses() {
    let s = TestServer::tiny(keyed(&["k1", "k2"]));
    let (k1, k2) = (
        [("Authorization", "Bearer k1")],
        [("Authorization", "Bearer k2")],
    );
    let mut e1 = subscribe(&s, &k1);
    let mut e2 = subscribe(&s, &k2);
    for e in [&mut e1, &mut e2] {
        let start = next(e);
        assert_eq!(start["seq"], 1);
        assert_eq!(events_of(&start)[0]["type"], "AllBlocksCleared");
    }
    assert_eq!(s.post_with(CHAT, &k1, &chat(PROMPT, 4)).status, 200);
    let b1 = next(&mut e1);
    assert_eq!(b1["seq"], 2);
    let stored = events_of(&b1);
    assert!(!stored.is_empty());
    for e in &stored {
        assert_eq!(e["type"], "BlockStored", "{e}");
        assert_eq!(e["block_size"], 16);
        assert_eq!(e["medium"], "hot");
        assert!(e["lora_id"].is_null());
        let n = e["token_ids"].as_array().unwrap().len();
        assert!((1..=16).contains(&n), "{e}");
    }
    // A chain: each block hangs below the one before.
    for w in stored.windows(2) {
        assert_eq!(w[1]["parent_block_hash"], w[0]["block_hashes"][0]);
    }
    assert!(stored[0]["parent_block_hash"].is_null());
    // The same prompt from the other tenant: its stream's next batch is
    // its own (had k1's leaked, it would have come first), with the same
    // tokens under other keys.
    assert_eq!(s.post_with(CHAT, &k2, &chat(PROMPT, 4)).status, 200);
    let b2 = next(&mut e2);
    assert_eq!(b2["seq"], 2);
    let tokens = |b: &Value| -> Vec<Value> {
        events_of(b)
            .iter()
            .map(|e| e["token_ids"].clone())
            .collect()
    };
    assert_eq!(tokens(&b1), tokens(&b2));
    let (h1, h2) = (hashes(&b1, "BlockStored"), hashes(&b2, "BlockStored"));
    assert!(h1.iter().all(|h| !h2.contains(h)), "{h1:?} {h2:?}");
    for (who, e) in [("none", None), ("a wrong key", Some("Bearer k3"))] {
        let h: Vec<(&str, &str)> = e.map(|v| ("Authorization", v)).into_iter().collect();
        let r = client::request(&s.addr, "GET", "/v1/kv_events", &h, b"", TIMEOUT).unwrap();
        let (msg, _, _) = error_of(r, 401);
        assert!(!msg.is_empty(), "{who}");
    }
}

const AUTH: [(&str, &str); 1] = [("Authorization", "Bearer k")];

#[test]
fn blocks_the_pool_reclaims_are_removed() {
    let cfg = EngineConfig {
        kv_tokens: 128,
        ..EngineConfig::default()
    };
    let s = TestServer::start(tiny_engine(&cfg, 4096), keyed(&["k"]));
    let mut ev = subscribe(&s, &AUTH);
    assert_eq!(next(&mut ev)["seq"], 1);
    let mut stored = Vec::new();
    // Distinct prompts fill the pool's 8 blocks; the next ones reclaim
    // cached blocks, which leave the index.
    for i in 0..12 {
        let prompt = format!("{i} {i} {i} {PROMPT}");
        assert_eq!(s.post_with(CHAT, &AUTH, &chat(&prompt, 2)).status, 200);
        let b = next(&mut ev);
        stored.extend(hashes(&b, "BlockStored"));
        let removed = hashes(&b, "BlockRemoved");
        if !removed.is_empty() {
            assert!(
                removed.iter().all(|h| stored.contains(h)),
                "removed what was never stored"
            );
            return;
        }
    }
    panic!("12 prompts through 8 blocks removed nothing");
}

fn salted(prompt: &str, salt: &str) -> Value {
    let mut b = chat(prompt, 2);
    b["cache_salt"] = salt.into();
    b
}

fn subscribe_at(s: &TestServer, path: &str) -> Events {
    let r = client::request(&s.addr, "GET", path, &AUTH, b"", TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    r.events()
}

#[test]
fn a_salt_reads_its_own_batches_only() {
    let s = TestServer::tiny(keyed(&["k"]));
    let mut u1 = subscribe_at(&s, "/v1/kv_events?cache_salt=u1");
    let mut plain = subscribe_at(&s, "/v1/kv_events");
    assert_eq!(next(&mut u1)["seq"], 1);
    assert_eq!(next(&mut plain)["seq"], 1);
    for (prompt, salt) in [("one", "u1"), ("two", "u2"), ("three", ""), ("four", "u1")] {
        let body = if salt.is_empty() {
            chat(&format!("{prompt} {PROMPT}"), 2)
        } else {
            salted(&format!("{prompt} {PROMPT}"), salt)
        };
        assert_eq!(s.post_with(CHAT, &AUTH, &body).status, 200);
    }
    // Batches 2 (u1), 3 (u2), 4 (no salt), 5 (u1): each reader its own.
    assert_eq!(next(&mut u1)["seq"], 2);
    assert_eq!(next(&mut u1)["seq"], 5);
    assert_eq!(next(&mut plain)["seq"], 4);
    let r = client::request(&s.addr, "GET", "/v1/kv_events?salt=u1", &AUTH, b"", TIMEOUT).unwrap();
    let (msg, _, _) = error_of(r, 400);
    assert!(msg.contains("cache_salt"), "{msg}");
}

/// The id of a batch, from its data.
fn id_of(batch: &Value) -> String {
    format!("{}-{}", batch["epoch"].as_str().unwrap(), batch["seq"])
}

#[test]
fn a_subscriber_behind_the_buffer_is_told_what_it_missed_and_resumes() {
    let s = TestServer::tiny(ServerConfig {
        kv_events: Some(2),
        ..keyed(&["k"])
    });
    for i in 0..4 {
        let prompt = format!("{i} {PROMPT}");
        assert_eq!(s.post_with(CHAT, &AUTH, &chat(&prompt, 2)).status, 200);
    }
    // Batches 1 (the start) to 5; the buffer keeps the last two.
    let mut ev = subscribe(&s, &AUTH);
    let m = next(&mut ev);
    assert_eq!(
        (m["missed"].as_u64(), m["from"].as_u64(), m["to"].as_u64()),
        (Some(3), Some(1), Some(3))
    );
    let four = next(&mut ev);
    assert_eq!(four["seq"], 4);
    assert_eq!(next(&mut ev)["seq"], 5);
    // Resuming after batch 4 replays batch 5 only.
    let id = id_of(&four);
    let mut again = subscribe(&s, &[AUTH[0], ("Last-Event-ID", &id)]);
    assert_eq!(next(&mut again)["seq"], 5);
    // Another epoch's id (the server restarted) or one past the last batch
    // starts again from the oldest kept, saying what is missing.
    let epoch = four["epoch"].as_str().unwrap();
    let beyond = format!("{epoch}-{}", u64::MAX);
    for id in ["0000000000000000-4", beyond.as_str()] {
        let mut from_start = subscribe(&s, &[AUTH[0], ("Last-Event-ID", id)]);
        assert_eq!(next(&mut from_start)["missed"], 3, "{id}");
        assert_eq!(next(&mut from_start)["seq"], 4, "{id}");
    }
    for bad in ["four", "4"] {
        let h = [AUTH[0], ("Last-Event-ID", bad)];
        let r = client::request(&s.addr, "GET", "/v1/kv_events", &h, b"", TIMEOUT).unwrap();
        let (msg, _, _) = error_of(r, 400);
        assert!(msg.contains("Last-Event-ID"), "{msg}");
    }
}

#[test]
fn events_are_off_unless_asked_for_and_need_api_keys() {
    let s = TestServer::tiny(ServerConfig::default());
    let (msg, _, _) = error_of(s.get("/v1/kv_events"), 404);
    assert!(msg.contains("--kv-events"), "{msg}");
    for (cfg, want) in [
        (
            ServerConfig {
                kv_events: Some(0),
                ..keyed(&["k"])
            },
            "--kv-events-buffer",
        ),
        (
            ServerConfig {
                kv_events: Some(8),
                ..ServerConfig::default()
            },
            "--api-key",
        ),
    ] {
        let engine = tiny_engine(&EngineConfig::default(), 256);
        let e = kvforge_server::Server::start(engine, cfg).err().unwrap();
        assert!(e.contains(want), "{e}");
    }
}
