//! [`RedisServer`]: a `redis-server` process of its own on a free
//! loopback port, for tests and benchmarks — started, waited for
//! (bounded), paused, killed, and stopped when dropped. A three-node
//! [`RedisCluster`] the same way.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `redis-server` binary: `$KVFORGE_REDIS_SERVER`, else the one on
/// `PATH` (`cargo xtask setup` installs Debian's `redis-server`).
pub fn redis_server_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("KVFORGE_REDIS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "redis-server not found: run `cargo xtask setup` (it installs Debian's redis-server) or set KVFORGE_REDIS_SERVER".into()
        })
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("binding a port: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("reading the port: {e}"))
}

/// A `redis-server` on `127.0.0.1`, killed when dropped.
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    running: bool,
}

impl RedisServer {
    /// Starts one with persistence off and `extra` arguments
    /// (`["--maxmemory", "1mb"]`), and waits (at most 10 s) until it
    /// answers.
    pub fn start(extra: &[&str]) -> Result<Self, String> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("kvforge-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let child = Self::spawn(port, &dir, &extra)?;
        let mut s = RedisServer {
            child,
            port,
            dir,
            extra,
            running: true,
        };
        s.wait_ready(Duration::from_secs(10))?;
        Ok(s)
    }

    fn spawn(port: u16, dir: &std::path::Path, extra: &[String]) -> Result<Child, String> {
        let bin = redis_server_binary()?;
        let mut cmd = Command::new(&bin);
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir);
        if !extra.iter().any(|a| a == "--appendonly") {
            cmd.args(["--appendonly", "no"]);
        }
        cmd.args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{}: {e}", bin.display()))
    }

    /// Starts it again after [`kill`](Self::kill), on the same port and
    /// folder (what it persisted, if anything, is loaded).
    pub fn restart(&mut self) -> Result<(), String> {
        if self.running {
            self.kill()?;
        }
        self.child = Self::spawn(self.port, &self.dir, &self.extra)?;
        self.running = true;
        self.wait_ready(Duration::from_secs(10))
    }

    fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!("redis-server exited at start: {st}"));
            }
            if self.command(&["PING"]).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "redis-server on port {} did not answer in {limit:?}",
            self.port
        ))
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs one command (a fresh connection, 2 s timeouts) and returns its
    /// answer.
    pub fn command(&self, args: &[&str]) -> Result<redis::Value, String> {
        self.command_bytes(&args.iter().map(|a| a.as_bytes()).collect::<Vec<_>>())
    }

    /// [`command`](Self::command) with binary arguments.
    pub fn command_bytes(&self, args: &[&[u8]]) -> Result<redis::Value, String> {
        let client = redis::Client::open(self.url()).map_err(|e| e.to_string())?;
        let t = Duration::from_secs(2);
        let mut c = client
            .get_connection_with_timeout(t)
            .map_err(|e| e.to_string())?;
        c.set_read_timeout(Some(t)).map_err(|e| e.to_string())?;
        let mut cmd = redis::cmd(std::str::from_utf8(args[0]).map_err(|e| e.to_string())?);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query::<redis::Value>(&mut c).map_err(|e| e.to_string())
    }

    /// The process id (to signal it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: &str) -> Result<(), String> {
        let st = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("kill: {e}"))?;
        st.success()
            .then_some(())
            .ok_or_else(|| format!("kill {sig} failed"))
    }

    /// Stops it (`SIGSTOP`): it holds its connections and answers nothing.
    pub fn pause(&self) -> Result<(), String> {
        self.signal("-STOP")
    }

    /// Lets it run again (`SIGCONT`).
    pub fn resume(&self) -> Result<(), String> {
        self.signal("-CONT")
    }

    /// Kills it at once (`SIGKILL`) and reaps it.
    pub fn kill(&mut self) -> Result<(), String> {
        self.signal("-KILL")?;
        self.child.wait().map_err(|e| e.to_string())?;
        self.running = false;
        Ok(())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.running {
            let _ = self.signal("-CONT");
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three `redis-server`s in cluster mode on loopback, their slots assigned
/// (`CLUSTER ADDSLOTS`, `CLUSTER MEET`) and waited for until the
/// cluster says `ok`.
pub struct RedisCluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three nodes and joins them (at most 20 s).
    pub fn start() -> Result<Self, String> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(RedisServer::start(&[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "2000",
            ])?);
            // Each node keeps its nodes.conf in its own folder.
        }
        let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
        for (n, (a, b)) in nodes.iter().zip(ranges) {
            // ADDSLOTS, not ADDSLOTSRANGE: that one needs Redis 7.
            let slots: Vec<String> = (a..=b).map(|s: u32| s.to_string()).collect();
            let mut args = vec!["CLUSTER", "ADDSLOTS"];
            args.extend(slots.iter().map(String::as_str));
            n.command(&args)?;
        }
        for n in &nodes[1..] {
            nodes[0].command(&["CLUSTER", "MEET", "127.0.0.1", &n.port().to_string()])?;
        }
        let t0 = Instant::now();
        loop {
            let ok = nodes.iter().all(|n| {
                matches!(n.command(&["CLUSTER", "INFO"]), Ok(redis::Value::BulkString(b))
                    if String::from_utf8_lossy(&b).contains("cluster_state:ok"))
            });
            if ok {
                return Ok(RedisCluster { nodes });
            }
            if t0.elapsed() > Duration::from_secs(20) {
                return Err("the three-node cluster did not become ok in 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}
