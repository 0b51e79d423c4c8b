//! kvforge's shared KV tier on Redis, Valkey or Redis Cluster.
//!
//! [`RedisTier`] implements [`kvforge_remote::RemoteTier`] with the `redis`
//! crate: one node through [`ConnectionManager`]s (multiplexed, and
//! reconnecting by themselves after a failure), or a cluster through its
//! cluster client (each key routed to its slot's node). Lookups and writes
//! go over two connections, so a lookup never waits behind a pipeline of
//! megabyte-sized blobs being written. A batch is one pipeline on one
//! node, or one command per key sent together on a cluster. Writes are
//! `SET key value NX PX ttl`: set-if-absent, so two instances writing the
//! same block cannot interleave, and every key expires; reads are plain
//! `GET`s, and only the keys that verified are renewed (`PEXPIRE`, by the
//! reader's write-behind thread), so a corrupt value or a fragment after a
//! missing head is not kept alive; a value that did not verify is deleted
//! (`DEL`). A key the store refuses alone (a value of another type, out of
//! memory) is refused alone: the other keys of the batch keep their
//! answers.
//!
//! Every call is bounded by the configured deadline: a store that is
//! down, paused or slow answers [`ErrorKind::Timeout`] or
//! [`ErrorKind::Connection`] within it, which the
//! [`RemoteCache`](kvforge_remote::RemoteCache) above counts as a miss. A
//! call that meets a dropped connection (the store restarted) is tried
//! once more on a fresh one within the same deadline. The tier runs its
//! own small tokio runtime, so it can be called from any thread, inside
//! another runtime or not.
//!
//! Feature `launcher` (off by default; tests and benchmarks turn it on):
//! `RedisServer` / `RedisCluster`, a `redis-server` process of one's own
//! on a loopback port, killed when dropped.
//!
//! [`ConnectionManager`]: redis::aio::ConnectionManager

mod conn;
#[cfg(feature = "launcher")]
mod server;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use kvforge_remote::{ErrorKind, Put, RemoteError, RemoteKey, RemoteTier};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::{RedisError, Value};
use tokio::sync::Mutex;

use crate::conn::{Conn, Item, batch, bytes, held, remote};

#[cfg(feature = "launcher")]
pub use server::{RedisCluster, RedisServer, redis_server_binary};

/// Where the store is and how long to wait for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://host:port[/db]` of the node, or of the cluster's seed
    /// nodes (at least one).
    pub urls: Vec<String>,
    /// Talk to a Redis Cluster.
    pub cluster: bool,
    /// Keys expire after this (`None`: never; the store's eviction
    /// policy then bounds its memory).
    pub ttl: Option<Duration>,
    /// Every call answers within this, or fails as a timeout.
    pub deadline: Duration,
}

/// A [`RemoteTier`] on Redis.
pub struct RedisTier {
    cfg: RedisConfig,
    /// Lookups.
    reads: Arc<Conn>,
    /// Writes, renewals, deletions.
    writes: Arc<Conn>,
    /// Connections found dropped (retried or not).
    reconnects: Arc<std::sync::atomic::AtomicU64>,
    rt: Option<tokio::runtime::Runtime>,
}

/// Which connection a call goes over.
#[derive(Clone, Copy)]
enum Lane {
    Read,
    Write,
}

impl RedisTier {
    /// A tier on the store `cfg` names. Nothing is connected yet (the
    /// first call connects, within its deadline): a store that is down at
    /// start is a miss per call, not an error here. Errors only on a bad
    /// configuration (an URL that does not parse, no URL, a zero
    /// deadline).
    pub fn new(cfg: RedisConfig) -> Result<Self, String> {
        if cfg.urls.is_empty() {
            return Err("remote: no url given".into());
        }
        if cfg.deadline.is_zero() {
            return Err("remote: deadline_ms must be positive".into());
        }
        if !cfg.cluster && cfg.urls.len() > 1 {
            return Err("remote: several urls need cluster = true".into());
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvforge-redis")
            .enable_all()
            .build()
            .map_err(|e| format!("remote: cannot start its runtime: {e}"))?;
        let connect = || -> Result<Conn, String> {
            let bad = |e: RedisError| format!("remote: {}: {e}", cfg.urls.join(","));
            if cfg.cluster {
                let client = ClusterClient::builder(cfg.urls.clone())
                    .connection_timeout(cfg.deadline)
                    .response_timeout(cfg.deadline)
                    .retries(1)
                    .build()
                    .map_err(bad)?;
                return Ok(Conn::Cluster {
                    client: Box::new(client),
                    conn: Mutex::new(None),
                });
            }
            let client = redis::Client::open(cfg.urls[0].as_str()).map_err(bad)?;
            let mc = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(cfg.deadline))
                .set_response_timeout(Some(cfg.deadline))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let _guard = rt.enter();
            Ok(Conn::Node(
                ConnectionManager::new_lazy_with_config(client, mc).map_err(bad)?,
            ))
        };
        let (reads, writes) = (Arc::new(connect()?), Arc::new(connect()?));
        Ok(RedisTier {
            cfg,
            reads,
            writes,
            reconnects: Arc::default(),
            rt: Some(rt),
        })
    }

    /// Sends `cmds` in one round over `lane`'s connection on the tier's
    /// runtime, waiting at most the deadline, from any thread. A dropped
    /// connection (a restarted store) is tried once more, on the fresh
    /// connection, within the same deadline.
    fn call(&self, lane: Lane, cmds: Vec<redis::Cmd>) -> Result<Vec<Item>, RemoteError> {
        let Some(rt) = &self.rt else {
            return Err(RemoteError::new(ErrorKind::Connection, "closed"));
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let deadline = self.cfg.deadline;
        let conn = match lane {
            Lane::Read => self.reads.clone(),
            Lane::Write => self.writes.clone(),
        };
        let reconnects = self.reconnects.clone();
        rt.spawn(async move {
            let once = async {
                match batch(conn.clone(), cmds.clone()).await {
                    Err(e) if remote(&e).kind == ErrorKind::Connection => {
                        reconnects.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        batch(conn, cmds).await
                    }
                    r => r,
                }
            };
            let r = tokio::time::timeout(deadline, once).await;
            let _ = tx.send(r);
        });
        let late = || RemoteError::new(ErrorKind::Timeout, format!("no answer in {deadline:?}"));
        match rx.recv_timeout(deadline + Duration::from_millis(50)) {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(remote(&e)),
            Ok(Err(_)) | Err(_) => Err(late()),
        }
    }

    fn ttl_ms(&self) -> Option<u64> {
        self.cfg
            .ttl
            .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1))
    }

    fn texts(keys: &[RemoteKey]) -> Vec<String> {
        keys.iter().map(RemoteKey::text).collect()
    }
}

impl Drop for RedisTier {
    fn drop(&mut self) {
        // A runtime may not be dropped inside another's async context.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl RemoteTier for RedisTier {
    fn contains(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let cmds = Self::texts(keys)
            .into_iter()
            .map(|k| redis::cmd("EXISTS").arg(k).clone())
            .collect();
        let v = self.call(Lane::Read, cmds)?;
        Ok(v.iter().map(held).collect())
    }

    /// Plain `GET`s: a read renews nothing (the reader renews what
    /// verified, with [`touch_many`](RemoteTier::touch_many)).
    fn get_many(&self, keys: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let cmds = Self::texts(keys)
            .into_iter()
            .map(|k| redis::cmd("GET").arg(k).clone())
            .collect();
        let v = self.call(Lane::Read, cmds)?;
        v.into_iter().map(bytes).collect()
    }

    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ttl = self.ttl_ms();
        let cmds = items
            .iter()
            .map(|(k, v)| {
                let mut c = redis::cmd("SET");
                c.arg(k.text()).arg(v.as_slice()).arg("NX");
                if let Some(ms) = ttl {
                    c.arg("PX").arg(ms);
                }
                c
            })
            .collect();
        let v = self.call(Lane::Write, cmds)?;
        Ok(v.iter()
            .map(|x| match x {
                Item::Value(Value::Okay) => Put::Written,
                Item::Value(Value::Nil) => Put::Held,
                // An error for this key alone (OOM under maxmemory), or an
                // answer `SET` does not give.
                _ => Put::Refused,
            })
            .collect())
    }

    /// `PEXPIRE key ttl` (with a TTL), else `EXISTS`.
    fn touch_many(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        let Some(ms) = self.ttl_ms() else {
            return self.contains(keys);
        };
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let cmds = Self::texts(keys)
            .into_iter()
            .map(|k| redis::cmd("PEXPIRE").arg(k).arg(ms).clone())
            .collect();
        let v = self.call(Lane::Write, cmds)?;
        Ok(v.iter().map(held).collect())
    }

    fn reconnects(&self) -> u64 {
        self.reconnects.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn remove_many(&self, keys: &[RemoteKey]) -> Result<usize, RemoteError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let cmds = Self::texts(keys)
            .into_iter()
            .map(|k| redis::cmd("DEL").arg(k).clone())
            .collect();
        let v = self.call(Lane::Write, cmds)?;
        Ok(v.iter().filter(|x| held(x)).count())
    }

    fn describe(&self) -> String {
        let kind = if self.cfg.cluster {
            "redis cluster "
        } else {
            ""
        };
        format!("{kind}{}", self.cfg.urls.join(","))
    }
}
