//! Two `kvforge-serve` processes on the real model share prefixes through
//! a real `redis-server` (one node, then a three-node cluster), started on
//! loopback ports by the test: the second instance answers a prompt the
//! first one served with `cached_tokens` > 0 and the same greedy tokens as
//! the first one's own prefix hit; with Redis paused, it answers by
//! recompute within the deadline and hits again once Redis resumes, and a
//! stream running meanwhile is not held up by the stalled lookup. Tenants:
//! no hit crosses API keys, on one instance or several, whatever order
//! `--api-key` lists them in; the same key hits on every instance.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvforge_remote_redis::{RedisCluster, RedisServer};
use kvforge_server::client;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kvforge-serve");

/// A `kvforge-serve` child on a free port, killed when dropped.
struct Instance {
    child: Child,
    addr: String,
}

impl Instance {
    fn start(config: &Path) -> Instance {
        Self::with_args(config, &["--max-batch", "1"])
    }

    fn with_args(config: &Path, args: &[&str]) -> Instance {
        let mut child = Command::new(BIN)
            .args(["--port", "0", "--model"])
            .arg(common::model_path())
            .args(args)
            .arg("--config")
            .arg(config)
            .env_remove("KVFORGE_API_KEY")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the server exited before listening")
                .unwrap();
            if let Some(rest) = line.split("http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        std::thread::spawn(move || lines.for_each(drop));
        Instance { child, addr }
    }

    /// A greedy completion of `prompt`: its text and cached tokens.
    fn complete(&self, prompt: &str) -> (String, u64) {
        self.complete_as(None, prompt)
    }

    /// The same, with API key `key`.
    fn complete_as(&self, key: Option<&str>, prompt: &str) -> (String, u64) {
        let body = json!({
            "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt,
            "max_tokens": 12, "temperature": 0, "ignore_eos": true,
        });
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let r = client::post_json(
            &self.addr,
            "/v1/completions",
            &headers,
            &body,
            common::TIMEOUT,
        )
        .unwrap();
        assert_eq!(r.status, 200);
        let v: Value = r.json().unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            cached,
        )
    }

    /// One series of `/metrics` (0 when absent).
    fn metric(&self, name: &str) -> f64 {
        let r = client::request(&self.addr, "GET", "/metrics", &[], b"", common::TIMEOUT).unwrap();
        let text = String::from_utf8(r.bytes().unwrap()).unwrap();
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits (at most 20 s) until `name` reaches `at_least`.
    fn wait_metric(&self, name: &str, at_least: f64) {
        let t0 = Instant::now();
        while self.metric(name) < at_least {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{name} stayed below {at_least}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A deadline no lookup of these tests' documents (about 7 MB each, a
/// debug build, other tests on the same 2 cores) comes near: one that
/// ran past it would count as a miss.
fn config(dir: &Path, remote: &str) -> PathBuf {
    config_with(dir, remote, 2000)
}

/// A mechanisms file with prefix reuse and the remote tier `remote`, its
/// secret in a file beside it.
fn config_with(dir: &Path, remote: &str, deadline_ms: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "the cluster secret of this test\n").unwrap();
    let p = dir.join("remote.toml");
    std::fs::write(
        &p,
        format!(
            "prefix = {{}}\nremote = {{ {remote}, seed = 42, deadline_ms = {deadline_ms}, secret_file = {:?} }}\n",
            secret.display().to_string()
        ),
    )
    .unwrap();
    p
}

fn document(topic: &str) -> String {
    let s = format!("The history of {topic} is long and full of surprising turns. ");
    format!(
        "{}\nSummarize the text above about {topic} in one sentence:",
        s.repeat(24)
    )
}

fn dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvforge-remote-{name}-{}", std::process::id()))
}

#[test]
fn a_second_instance_reuses_the_first_ones_prefix_through_redis() {
    let redis = RedisServer::start(&[]).unwrap();
    let d = dir("node");
    let cfg = config(&d, &format!("url = \"{}\"", redis.url()));
    let a = Instance::start(&cfg);
    let (doc1, doc2) = (document("bridges"), document("clocks"));
    let (first, cached) = a.complete(&doc1);
    assert_eq!(cached, 0);
    a.complete(&doc2);
    let (local, cached) = a.complete(&doc1);
    assert!(cached > 200, "a local prefix hit: {cached}");
    a.wait_metric(
        "kvforge:remote_put_blocks_total",
        2.0 * cached as f64 / 16.0,
    );
    let b = Instance::start(&cfg);
    // Redis paused: the lookup gives up within the deadline; recompute.
    redis.pause().unwrap();
    let t0 = Instant::now();
    let (paused, cached_paused) = b.complete(&doc2);
    let took = t0.elapsed();
    redis.resume().unwrap();
    // Past the tier's back-off after the timeout (1 s).
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(cached_paused, 0);
    assert!(b.metric("kvforge:remote_errors_total") >= 1.0);
    assert!(took < Duration::from_secs(30), "{took:?}");
    // Resumed: the other document comes from Redis.
    let (remote, cached_remote) = b.complete(&doc1);
    assert_eq!(
        cached_remote, cached,
        "every full block of the prompt from Redis"
    );
    assert_eq!(
        remote, local,
        "the same tokens as the first instance's own prefix hit"
    );
    assert!(b.metric("kvforge:remote_hit_tokens_total") >= cached as f64);
    eprintln!("recompute {first:?}; remote {remote:?}; paused answer {paused:?} in {took:?}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn two_instances_share_through_a_three_node_redis_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let d = dir("cluster");
    let urls = cluster.urls().join(",");
    let cfg = config(&d, &format!("url = \"{urls}\", cluster = true"));
    let a = Instance::start(&cfg);
    let doc = document("maps");
    a.complete(&doc);
    let (local, cached) = a.complete(&doc);
    assert!(cached > 200);
    a.wait_metric("kvforge:remote_put_blocks_total", cached as f64 / 16.0);
    let b = Instance::start(&cfg);
    let (remote, cached_remote) = b.complete(&doc);
    assert_eq!(cached_remote, cached);
    assert_eq!(remote, local);
    let _ = std::fs::remove_dir_all(&d);
}

/// S1 of the review of `d047843`: tenants never share KV through the
/// shared tier. X lists `alice, bob`, Y `bob, alice`, Z only `carol`, W
/// no key at all; alice's prompt served on X is found by alice on Y, and
/// by nobody else anywhere (bob asks first: by position, he would have
/// been alice on Y).
#[test]
fn no_hit_crosses_tenants_and_a_tenant_hits_on_every_instance() {
    let redis = RedisServer::start(&[]).unwrap();
    let d = dir("tenants");
    let cfg = config(&d, &format!("url = \"{}\"", redis.url()));
    let keys = |ks: &[&'static str]| -> Vec<&'static str> {
        ks.iter().flat_map(|k| ["--api-key", *k]).collect()
    };
    let x = Instance::with_args(&cfg, &keys(&["sk-alice", "sk-bob"]));
    let doc = document("lighthouses");
    let (_, cached) = x.complete_as(Some("sk-alice"), &doc);
    assert_eq!(cached, 0);
    let (local, hit) = x.complete_as(Some("sk-alice"), &doc);
    assert!(hit > 200, "{hit}");
    x.wait_metric("kvforge:remote_put_blocks_total", hit as f64 / 16.0);
    let y = Instance::with_args(&cfg, &keys(&["sk-bob", "sk-alice"]));
    let z = Instance::with_args(&cfg, &keys(&["sk-carol"]));
    let w = Instance::with_args(&cfg, &[]);
    assert_eq!(
        y.complete_as(Some("sk-bob"), &doc).1,
        0,
        "bob, listed first on Y"
    );
    assert_eq!(z.complete_as(Some("sk-carol"), &doc).1, 0, "carol");
    assert_eq!(w.complete_as(None, &doc).1, 0, "a keyless instance");
    let (remote, on_y) = y.complete_as(Some("sk-alice"), &doc);
    assert_eq!(on_y, hit, "alice's prefix from Redis on another instance");
    assert_eq!(remote, local);
    let _ = std::fs::remove_dir_all(&d);
}

/// The lookup runs while its request waits for admission: with one batch
/// slot and Redis paused, a request whose lookup stalls holds no slot, so
/// a short request sent after it (nothing to look up) is answered at once
/// rather than after the stall.
#[test]
fn a_stalled_lookup_holds_no_batch_slot() {
    let redis = RedisServer::start(&[]).unwrap();
    let d = dir("slot");
    let deadline = Duration::from_millis(3000);
    let cfg = config_with(
        &d,
        &format!("url = \"{}\"", redis.url()),
        deadline.as_millis() as u64,
    );
    let a = Instance::start(&cfg);
    let ask = |addr: String, prompt: String| {
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let body = json!({
                "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt,
                "max_tokens": 4, "temperature": 0, "ignore_eos": true,
            });
            let r =
                client::post_json(&addr, "/v1/completions", &[], &body, common::TIMEOUT).unwrap();
            (r.status, t0.elapsed())
        })
    };
    // Warm: the engine's first step is not what this measures.
    assert_eq!(ask(a.addr.clone(), "Hi".into()).join().unwrap().0, 200);
    redis.pause().unwrap();
    let t0 = Instant::now();
    let stalled = ask(a.addr.clone(), document("lanterns"));
    // The stalled request waits for its lookup before the short one is
    // sent.
    a.wait_metric("kvforge:num_requests_waiting", 1.0);
    let (status, short) = ask(a.addr.clone(), "Hi".into()).join().unwrap();
    let short_ended = t0.elapsed();
    let (stalled_status, took) = stalled.join().unwrap();
    redis.resume().unwrap();
    eprintln!("the short request took {short:?}; the stalled one {took:?}");
    assert_eq!((status, stalled_status), (200, 200));
    assert!(
        took >= deadline - Duration::from_millis(500),
        "the lookup did stall: {took:?}"
    );
    // Were the slot held, the short request could only end after the
    // stalled one; how fast it runs is the machine's business.
    assert!(
        short_ended < took,
        "the short request ended at {short_ended:?}, after the stalled one ({took:?})"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// S4: with Redis paused, a request's lookup waits for the deadline on a
/// thread of its own; a stream already running keeps its pace (its
/// largest gap between tokens stays far below the deadline).
#[test]
fn a_paused_redis_slows_only_the_request_that_asks_it() {
    let redis = RedisServer::start(&[]).unwrap();
    let d = dir("stall");
    let deadline = Duration::from_millis(3000);
    let cfg = config_with(
        &d,
        &format!("url = \"{}\"", redis.url()),
        deadline.as_millis() as u64,
    );
    let a = Instance::with_args(&cfg, &["--max-batch", "4"]);
    let body = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Count slowly:",
        "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let r = client::post_json(&a.addr, "/v1/completions", &[], &body, common::TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    let mut events = r.events();
    let mut stamps = Vec::new();
    // A few tokens first: the stream runs.
    for _ in 0..5 {
        events.next().unwrap().unwrap();
    }
    redis.pause().unwrap();
    let addr = a.addr.clone();
    let asking = std::thread::spawn(move || {
        let t0 = Instant::now();
        let body = json!({
            "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": document("kites"),
            "max_tokens": 2, "temperature": 0,
        });
        let r = client::post_json(&addr, "/v1/completions", &[], &body, common::TIMEOUT).unwrap();
        (r.status, t0.elapsed())
    });
    // While the lookup stalls (the asking request's own prefill comes
    // after it, and is not what this measures). The window's start and
    // end count as stamps, so a stream that stopped shows as one gap.
    let t0 = Instant::now();
    stamps.push(t0);
    // The window ends a second before the lookup gives up, so that the
    // asking request's own prefill, after it, falls outside any gap.
    while t0.elapsed() < deadline - Duration::from_millis(1000) {
        match events.next() {
            Some(Ok(e)) if e != "[DONE]" => stamps.push(Instant::now()),
            _ => break,
        }
    }
    stamps.push(Instant::now());
    redis.resume().unwrap();
    let (status, took) = asking.join().unwrap();
    events.close();
    assert_eq!(status, 200);
    assert!(
        took >= deadline - Duration::from_millis(500),
        "the lookup did stall: {took:?}"
    );
    let gaps: Vec<Duration> = stamps.windows(2).map(|w| w[1] - w[0]).collect();
    let worst = gaps.iter().max().copied().unwrap_or_default();
    let tokens = stamps.len() - 2;
    eprintln!(
        "{tokens} tokens during the stall, largest gap {worst:?}; the stalled request took {took:?}"
    );
    // How many tokens fit in the window is the machine's speed (a debug
    // build on CI's 2 cores made 20 in 2.7 s); that none waited for the
    // stall is the largest gap, the window's edges included.
    assert!(tokens >= 5, "the stream went on: {tokens} tokens");
    assert!(
        worst < deadline / 3,
        "a gap of {worst:?} during a {deadline:?} stall"
    );
    let _ = std::fs::remove_dir_all(&d);
}
