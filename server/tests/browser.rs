//! The dashboard in a real browser: headless Chromium (Debian's, installed
//! by `cargo xtask setup`), driven through the DevTools protocol, loads
//! `/dashboard` from a live server whose small cache demotes and evicts;
//! requests run, and the page's own state (`window.kv`) must show the
//! bytes curve risen, eviction and demotion markers, a running request's
//! block table with hot, cold and dropped entries, the last requests'
//! table, a quality probe plotted, and the prefix hit rate moved. A screenshot of that state goes to
//! `target/dashboard/dashboard.png` (the one in the server's README came
//! from this test).
//!
//! The browser: `$KVFORGE_CHROMIUM`, else `chromium` on `PATH`; without one
//! the test says so and passes, unless `KVFORGE_REQUIRE_CHROMIUM` is set
//! (as `cargo xtask ci` sets it).

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{TestServer, chat, tiny_engine};
use kvforge_engine::{Axis, EngineConfig, KvQuant, Registry};
use kvforge_server::client;
use kvforge_server::sched::ProbeConfig;
use kvforge_server::{SchedConfig, ServerConfig};
use serde_json::{Value, json};
use tungstenite::{Message, WebSocket};

const PATIENCE: Duration = Duration::from_secs(90);

fn chromium() -> Option<PathBuf> {
    let p = std::env::var_os("KVFORGE_CHROMIUM")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join("chromium"))
                    .find(|p| p.is_file())
            })
        });
    if p.is_none() {
        assert!(
            std::env::var_os("KVFORGE_REQUIRE_CHROMIUM").is_none(),
            "no chromium: run `cargo xtask setup` as root (it installs Debian's), or set KVFORGE_CHROMIUM"
        );
        eprintln!("skipped: no chromium (cargo xtask setup installs Debian's as root)");
    }
    p
}

/// Stops the browser when the test ends, however it ends.
struct Browser(Child);

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One page's DevTools connection.
struct Page {
    ws: WebSocket<TcpStream>,
    next: u64,
}

impl Page {
    /// Sends `method` and returns its result (events before it skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let msg = json!({"id": id, "method": method, "params": params});
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let m = self.ws.read().unwrap();
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// A JavaScript expression's value (JSON-serializable).
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true}),
        );
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }
}

/// Starts headless Chromium on `url`; returns it and its page.
fn open(bin: &PathBuf, url: &str, dir: &std::path::Path) -> (Browser, Page) {
    let child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,1120",
            "--remote-debugging-port=0",
        ])
        .arg(format!("--user-data-dir={}", dir.display()))
        .arg(url)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let mut browser = Browser(child);
    // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/…"
    let stderr = browser.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(ws) = line.strip_prefix("DevTools listening on ") {
                let _ = tx.send(ws.to_string());
            }
        }
    });
    let ws = rx
        .recv_timeout(PATIENCE)
        .expect("chromium printed no DevTools address");
    let host = ws
        .trim_start_matches("ws://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let t = Instant::now();
    let page_ws = loop {
        let r = client::request(&host, "GET", "/json/list", &[], b"", PATIENCE).unwrap();
        let list = r.json().unwrap();
        let found =
            list.as_array().unwrap().iter().find(|t| {
                t["type"] == "page" && t["url"].as_str().is_some_and(|u| u.starts_with(url))
            });
        if let Some(p) = found {
            break p["webSocketDebuggerUrl"].as_str().unwrap().to_string();
        }
        assert!(t.elapsed() < PATIENCE, "no page for {url}: {list}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let stream = TcpStream::connect(&host).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let (ws, _) = tungstenite::client(page_ws.as_str(), stream).unwrap();
    (browser, Page { ws, next: 0 })
}

/// A small cache: 96 tokens of hot KV, an INT4 cold tier behind an
/// 8-token hot window, and sink-window eviction beyond 16 tokens.
fn small_cache() -> EngineConfig {
    let mut cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 96,
        kv_quant: Some(KvQuant {
            bits: 4,
            group_size: 8,
            window: 8,
            rotate: false,
            key_axis: Axis::PerChannel,
            sink: 4,
        }),
        ..EngineConfig::default()
    };
    let params = json!({"sink": 4, "window": 16});
    cfg.evict_with(&Registry::builtin(), "sink-window", params)
        .unwrap();
    cfg
}

#[test]
fn the_dashboard_draws_the_cache_live_in_chromium() {
    let Some(bin) = chromium() else {
        return;
    };
    let engine = tiny_engine(&small_cache(), 4096);
    let text = "The cache keeps the keys and values of every token it has read. ".repeat(20);
    let mut tokens = engine.tokenizer().encode_text(&text).unwrap();
    tokens.truncate(96);
    let probe = ProbeConfig {
        tokens,
        every: Duration::from_secs(1),
    };
    let cfg = ServerConfig {
        sched: SchedConfig {
            probe: Some(probe),
            ..SchedConfig::default()
        },
        ..ServerConfig::default()
    };
    let s = TestServer::start(engine, cfg);
    let dir = std::env::temp_dir().join(format!("kvforge-chromium-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("http://{}/dashboard", s.addr);
    let (_browser, mut page) = open(&bin, &url, &dir);
    let t = Instant::now();
    while page.eval("window.kv ? kv.snapshots.length : 0") == json!(0) {
        assert!(t.elapsed() < PATIENCE, "the page drew no snapshot");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A long generation holds KV across snapshots; a repeated prompt hits
    // the prefix cache (its sink block stays registered).
    let addr = s.addr.clone();
    let long = std::thread::spawn(move || {
        let mut body = chat(&"word ".repeat(40), 3000);
        body["ignore_eos"] = json!(true);
        client::post_json(&addr, "/v1/chat/completions", &[], &body, PATIENCE)
            .unwrap()
            .status
    });
    let state = "JSON.stringify({
        n: kv.snapshots.length,
        peak: Math.max(...kv.snapshots.map(s => s.cache ? s.cache.bytes_in_use : 0)),
        kinds: [...new Set(kv.marks.map(m => m.kind))],
        hit: kv.series.hit.filter(p => p.v !== null && p.v > 0).length,
        entries: [...new Set(kv.snapshots.flatMap(s => (s.sequences || []).flatMap(q => [...q.entries])))],
        recent: document.querySelectorAll('#recent tr').length,
        ppl: kv.series.ppl.length,
        status: document.getElementById('status').textContent,
        rows: document.querySelectorAll('#now tr').length })";
    let t = Instant::now();
    let last = loop {
        let prompt = "Tell me about the cache, the cache and the cache.";
        assert_eq!(s.post("/v1/chat/completions", &chat(prompt, 4)).status, 200);
        let v: Value = serde_json::from_str(page.eval(state).as_str().unwrap()).unwrap();
        let kinds = v["kinds"].as_array().unwrap();
        let has = |k: &str| kinds.iter().any(|x| x == k);
        let entries = v["entries"].as_array().unwrap();
        let seen = |e: &str| entries.iter().any(|x| x == e);
        let strips = seen("h") && seen("c") && seen("d");
        let marks = has("eviction") && has("demotion");
        let probed = v["ppl"].as_u64().unwrap() > 0;
        let hit = v["hit"].as_u64().unwrap() > 0;
        if v["peak"].as_u64().unwrap() > 0 && marks && strips && hit && probed {
            break v;
        }
        assert!(t.elapsed() < PATIENCE, "the page never showed it all: {v}");
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(last["status"], "live");
    assert!(last["rows"].as_u64().unwrap() >= 8, "{last}");
    assert!(last["recent"].as_u64().unwrap() >= 2, "{last}");
    // The picture a few snapshots on, the long request still running
    // (3000 tokens), then its end.
    std::thread::sleep(Duration::from_millis(2500));
    let shot = page.call("Page.captureScreenshot", json!({"format": "png"}));
    let png = data_encoding::BASE64
        .decode(shot["data"].as_str().unwrap().as_bytes())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("dashboard.png"), png).unwrap();
    assert_eq!(long.join().unwrap(), 200);
    let _ = std::fs::remove_dir_all(&dir);
}
