//! The servers under load, as child processes on loopback ports:
//! `kvforge-serve`, and llama.cpp's `llama-server` for the side-by-side.
//! Each is stopped (SIGTERM, then a kill) when its handle drops.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvforge_server::client;

/// A server started by the load generator.
pub struct Spawned {
    /// `kvforge` or `llama-server`.
    pub name: &'static str,
    /// `host:port`.
    pub addr: String,
    /// The model id requests name.
    pub model_id: String,
    child: Child,
}

/// How to start kvforge-serve.
#[derive(Clone, Debug)]
pub struct KvforgeSpec {
    /// The `kvforge-serve` binary.
    pub bin: PathBuf,
    /// The GGUF file.
    pub model: PathBuf,
    /// More flags (`--config`, `--kv-tokens` …).
    pub args: Vec<String>,
}

/// How to start llama-server.
#[derive(Clone, Debug)]
pub struct LlamaSpec {
    /// The `llama-server` binary.
    pub bin: PathBuf,
    /// The GGUF file.
    pub model: PathBuf,
    /// CPU threads.
    pub threads: usize,
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Polls `GET /health` until it answers 200 (bounded).
fn wait_healthy(addr: &str, child: &mut Child, limit: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait()? {
            bail!("the server exited while starting: {s}");
        }
        let ok = client::request(addr, "GET", "/health", &[], b"", Duration::from_secs(5))
            .is_ok_and(|r| r.status == 200);
        if ok {
            return Ok(());
        }
        if start.elapsed() > limit {
            bail!("no healthy server on {addr} after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts `cmd` with `--host 127.0.0.1 --port P` (a free port; both
/// servers take these flags), stderr to `log`, and waits until it is
/// healthy.
fn spawn(mut cmd: Command, log: &Path, name: &'static str, model_id: String) -> Result<Spawned> {
    let port = free_port()?;
    let logf = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    let what = format!("starting {}", cmd.get_program().to_string_lossy());
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .context(what)?;
    let addr = format!("127.0.0.1:{port}");
    wait_healthy(&addr, &mut child, Duration::from_secs(120))?;
    Ok(Spawned {
        name,
        addr,
        model_id,
        child,
    })
}

impl KvforgeSpec {
    /// Starts it on a free port; its stderr goes to `log`.
    pub fn start(&self, log: &Path) -> Result<Spawned> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--model").arg(&self.model).args(&self.args);
        let model_id = self
            .model
            .file_stem()
            .map_or_else(|| "kvforge".into(), |s| s.to_string_lossy().into_owned());
        spawn(cmd, log, "kvforge", model_id)
    }
}

impl LlamaSpec {
    /// Starts it with `slots` parallel slots over `ctx` tokens in all (its
    /// prompt cache on, as by default), on a free port.
    pub fn start(&self, slots: usize, ctx: usize, log: &Path) -> Result<Spawned> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("-m")
            .arg(&self.model)
            .args(["-np", &slots.to_string(), "-c", &ctx.to_string()])
            .args(["-t", &self.threads.to_string(), "--cache-reuse", "16"]);
        spawn(cmd, log, "llama-server", "model".into())
    }
}

impl Spawned {
    /// The server's resident set in bytes (Linux `/proc`).
    pub fn rss_bytes(&self) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Its Prometheus text (kvforge only; empty otherwise).
    pub fn metrics(&self) -> String {
        client::request(
            &self.addr,
            "GET",
            "/metrics",
            &[],
            b"",
            Duration::from_secs(10),
        )
        .and_then(|r| r.bytes())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
    }

    /// SIGTERM, then a kill after 30 s; whether it exited 0.
    pub fn stop(mut self) -> bool {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        false
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The first line of `path` that contains `what` (a server's log).
pub fn log_line(path: &Path, what: &str) -> Option<String> {
    let f = std::fs::File::open(path).ok()?;
    BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains(what))
}
