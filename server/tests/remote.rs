//! Two `kvforge-serve` processes on the real model share prefixes through
//! a real `redis-server` (one node, then a three-node cluster), started on
//! loopback ports by the test: the second instance answers a prompt the
//! first one served with `cached_tokens` > 0 and the same greedy tokens as
//! the first one's own prefix hit; with Redis paused, it answers by
//! recompute within the deadline and hits again once Redis resumes.
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
        let mut child = Command::new(BIN)
            .args(["--port", "0", "--max-batch", "1", "--model"])
            .arg(common::model_path())
            .arg("--config")
            .arg(config)
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
        let body = json!({
            "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt,
            "max_tokens": 12, "temperature": 0, "ignore_eos": true,
        });
        let r =
            client::post_json(&self.addr, "/v1/completions", &[], &body, common::TIMEOUT).unwrap();
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

fn config(dir: &Path, remote: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join("remote.toml");
    std::fs::write(
        &p,
        format!("prefix = {{}}\nremote = {{ {remote}, seed = 42, deadline_ms = 300 }}\n"),
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
