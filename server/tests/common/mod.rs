//! A server on a loopback port over a tiny random-weight model with the
//! real tokenizer, started and stopped by each test; requests through the
//! crate's blocking client.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{Device, Engine, EngineConfig, Kind, Llama, LlamaConfig, Tokenizer};
use kvforge_server::client::{self, Response};
use kvforge_server::sched::Shared;
use kvforge_server::{Server, ServerConfig};
use serde_json::{Value, json};

pub const MODEL: &str = "tiny";
pub const TIMEOUT: Duration = Duration::from_secs(60);

pub fn model_path() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = root.join(kvforge_engine::DEFAULT_MODEL);
    assert!(
        p.exists(),
        "{} missing: run `cargo xtask setup`",
        p.display()
    );
    p
}

/// A random-weight model over the real tokenizer's vocabulary.
pub fn tiny_engine(cfg: &EngineConfig, max_ctx: usize) -> Engine {
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model_path()).unwrap()).unwrap();
    let mc = LlamaConfig {
        vocab: tok.vocab,
        max_ctx,
        ..LlamaConfig::tiny()
    };
    let model = Llama::random(mc, 11, Device::Cpu, Kind::Float).unwrap();
    Engine::new(model, tok, cfg).unwrap()
}

pub struct TestServer {
    pub addr: String,
    pub shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    pub fn start(engine: Engine, mut cfg: ServerConfig) -> TestServer {
        cfg.model_id = MODEL.into();
        // The coordinator's invariants after every call of every test.
        cfg.check_invariants = true;
        let server = Server::start(engine, cfg).unwrap();
        let shared = server.shared();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                addr_tx.send(l.local_addr()?.to_string()).unwrap();
                server
                    .serve(l, async move {
                        let _ = stopped.await;
                    })
                    .await
            })
        });
        let addr = addr_rx.recv_timeout(TIMEOUT).unwrap();
        TestServer {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The default: a tiny engine with a 4096-token context (room for a
    /// long stream that outlasts what a test does meanwhile).
    pub fn tiny(cfg: ServerConfig) -> TestServer {
        Self::start(tiny_engine(&EngineConfig::default(), 4096), cfg)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        client::post_json(&self.addr, path, &[], body, TIMEOUT).unwrap()
    }

    pub fn post_with(&self, path: &str, headers: &[(&str, &str)], body: &Value) -> Response {
        client::post_json(&self.addr, path, headers, body, TIMEOUT).unwrap()
    }

    pub fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
        client::request(&self.addr, method, path, headers, body, TIMEOUT).unwrap()
    }

    pub fn get(&self, path: &str) -> Response {
        self.raw("GET", path, &[], b"")
    }

    pub fn metrics(&self) -> String {
        String::from_utf8(self.get("/metrics").bytes().unwrap()).unwrap()
    }

    /// Waits (bounded) until `f` holds.
    pub fn until(&self, what: &str, mut f: impl FnMut(&TestServer) -> bool) {
        let t = Instant::now();
        while !f(self) {
            assert!(t.elapsed() < TIMEOUT, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the server the way SIGTERM does and returns what serve did.
    pub fn stop(mut self) -> std::io::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A metric's value in Prometheus text (the first series of that name).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

pub fn chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// The error body's fields, checked to be OpenAI's shape.
pub fn error_of(r: Response, status: u16) -> (String, Option<String>, Option<String>) {
    assert_eq!(r.status, status);
    let v = r.json().unwrap();
    let e = &v["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "no {k} in {v}");
    }
    let msg = e["message"].as_str().unwrap().to_string();
    assert!(!msg.contains('\n'), "one line: {msg}");
    (
        msg,
        e["param"].as_str().map(String::from),
        e["code"].as_str().map(String::from),
    )
}
