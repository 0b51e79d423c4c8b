//! Prometheus as users run it: Debian's `prometheus` (installed by
//! `cargo xtask setup`) started on loopback scrapes a live server under a
//! short load, and every query of the Grafana dashboard in
//! `docs/grafana/kvforge.json` returns data from its HTTP API.
//!
//! The binary: `$KVFORGE_PROMETHEUS`, else `prometheus` on `PATH`; without
//! one the test says so and passes, unless `KVFORGE_REQUIRE_PROMETHEUS` is
//! set (as `cargo xtask ci` sets it).

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{TestServer, chat};
use kvforge_server::ServerConfig;
use kvforge_server::client;
use serde_json::Value;

/// Bounds every wait below.
const PATIENCE: Duration = Duration::from_secs(60);

fn prometheus() -> Option<PathBuf> {
    let p = std::env::var_os("KVFORGE_PROMETHEUS")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join("prometheus"))
                    .find(|p| p.is_file())
            })
        });
    if p.is_none() {
        assert!(
            std::env::var_os("KVFORGE_REQUIRE_PROMETHEUS").is_none(),
            "no prometheus binary: run `cargo xtask setup` as root (it installs Debian's), or set KVFORGE_PROMETHEUS"
        );
        eprintln!("skipped: no prometheus binary (cargo xtask setup installs Debian's as root)");
    }
    p
}

/// Stops the child when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query's result vector.
fn query(addr: &str, promql: &str) -> Vec<Value> {
    let path = format!("/api/v1/query?query={}", encode(promql));
    let r = client::request(addr, "GET", &path, &[], b"", PATIENCE).unwrap();
    let status = r.status;
    let v = r.json().unwrap();
    assert_eq!(status, 200, "{promql}: {v}");
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// Every panel query of the dashboard, its variables filled in.
fn dashboard_queries(model: &str) -> Vec<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana/kvforge.json");
    let d: Value = serde_json::from_str(&std::fs::read_to_string(root).unwrap()).unwrap();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let e = t["expr"].as_str().unwrap();
            out.push(
                e.replace("$model_name", model)
                    .replace("$__rate_interval", "30s"),
            );
        }
    }
    out
}

#[test]
fn prometheus_scrapes_the_server_and_every_dashboard_query_returns_data() {
    let Some(bin) = prometheus() else {
        return;
    };
    let s = TestServer::tiny(ServerConfig::default());
    let dir = std::env::temp_dir().join(format!("kvforge-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kvforge\n    static_configs:\n      - targets: ['{}']\n",
            s.addr
        ),
    )
    .unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new(&bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let _running = Running(child);
    let until = |what: &str, f: &mut dyn FnMut() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < PATIENCE,
                "timed out waiting for {what} (log in {})",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    until("prometheus to be ready", &mut || {
        client::request(&addr, "GET", "/-/ready", &[], b"", PATIENCE).is_ok_and(|r| r.status == 200)
    });
    // Its first scrape (discovery hands it the target a few seconds after
    // it is ready): the load below then falls across several scrapes.
    until("the first scrape", &mut || {
        !query(&addr, "up{job=\"kvforge\"}").is_empty()
    });
    // A short load, repeated prompts among it (prefix hits), spread over
    // several scrapes so that every rate has two samples that differ.
    let model = common::MODEL;
    let t = Instant::now();
    let mut sent = 0;
    while t.elapsed() < Duration::from_secs(4) || sent < 6 {
        let prompt = format!("Question {} about the KV cache.", sent % 3);
        assert_eq!(
            s.post("/v1/chat/completions", &chat(&prompt, 8)).status,
            200
        );
        sent += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
    until("the load in prometheus", &mut || {
        let q = format!("kvforge:request_success_total{{model_name=\"{model}\"}}");
        query(&addr, &q)
            .iter()
            .map(|r| r["value"][1].as_str().unwrap().parse::<f64>().unwrap())
            .sum::<f64>()
            >= sent as f64
    });
    let queries = dashboard_queries(model);
    assert!(queries.len() >= 9);
    for q in queries {
        let r = query(&addr, &q);
        assert!(!r.is_empty(), "the dashboard's query {q} returned no data");
    }
    let up = query(&addr, "up{job=\"kvforge\"}");
    assert_eq!(up[0]["value"][1], "1");
    let _ = std::fs::remove_dir_all(&dir);
}
