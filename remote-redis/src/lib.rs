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

#[cfg(feature = "launcher")]
mod server;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use futures_util::future::join_all;
use kvforge_remote::{ErrorKind, Put, RemoteError, RemoteKey, RemoteTier};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};
use tokio::sync::Mutex;

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

enum Conn {
    Node(ConnectionManager),
    Cluster {
        client: Box<ClusterClient>,
        conn: Mutex<Option<ClusterConnection>>,
    },
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

/// What a call fails with: an error of the store, or none in time.
fn remote(e: &RedisError) -> RemoteError {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_io_error()
        || e.is_unrecoverable_error()
    {
        ErrorKind::Connection
    } else {
        ErrorKind::Store
    };
    RemoteError::new(kind, e.to_string())
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

/// One key's answer in a batch: its value, or the store refusing that
/// command alone (with its error code: `WRONGTYPE`, `OOM`, `BUSY`, …)
/// while the others were answered.
enum Item {
    Value(Value),
    Refused(String),
}

/// One command per key, all sent before any answer is awaited (routed per
/// key on a cluster; pipelined on one multiplexed node connection). A
/// store error for one key refuses that key only; a lost connection or a
/// timeout fails the batch.
async fn each<C: ConnectionLike + Clone + Send + 'static>(
    conn: C,
    cmds: Vec<redis::Cmd>,
) -> Result<Vec<Item>, RedisError> {
    let answers = join_all(cmds.into_iter().map(|cmd| {
        let mut c = conn.clone();
        async move { cmd.query_async::<Value>(&mut c).await }
    }))
    .await;
    answers
        .into_iter()
        .map(|a| match a {
            Ok(v) => Ok(Item::Value(v)),
            Err(e) if remote(&e).kind == ErrorKind::Store => {
                Ok(Item::Refused(e.code().unwrap_or("ERR").to_string()))
            }
            Err(e) => Err(e),
        })
        .collect()
}

/// `cmds` in one round: a pipeline on a node, one command per key on a
/// cluster (connected on first use).
async fn batch(conn: Arc<Conn>, cmds: Vec<redis::Cmd>) -> Result<Vec<Item>, RedisError> {
    match &*conn {
        Conn::Node(m) => {
            let mut p = redis::pipe();
            p.ignore_errors();
            for c in cmds {
                p.add_command(c);
            }
            let mut m = m.clone();
            let v = p.query_async::<Vec<Value>>(&mut m).await?;
            Ok(v.into_iter()
                .map(|x| match x {
                    Value::ServerError(e) => Item::Refused(e.code().to_string()),
                    x => Item::Value(x),
                })
                .collect())
        }
        Conn::Cluster { client, conn } => {
            let c = {
                let mut slot = conn.lock().await;
                match &*slot {
                    Some(c) => c.clone(),
                    None => {
                        let c = client.get_async_connection().await?;
                        *slot = Some(c.clone());
                        c
                    }
                }
            };
            each(c, cmds).await
        }
    }
}

/// Whether an `EXISTS`, `PEXPIRE` or `DEL` answer says the key was held.
fn held(item: &Item) -> bool {
    matches!(item, Item::Value(Value::Int(n)) if *n > 0)
}

/// A value as bytes: absent, a byte string, or — a value of another type
/// at the key — empty bytes, which no blob verifies (an invalid block, to
/// be deleted). Any other refusal (`BUSY`, `LOADING`, `MASTERDOWN`, …) says
/// nothing about the key: the lookup fails, a miss.
fn bytes(item: Item) -> Result<Option<Vec<u8>>, RemoteError> {
    match item {
        Item::Value(Value::Nil) => Ok(None),
        Item::Value(Value::BulkString(b)) => Ok(Some(b)),
        Item::Value(_) => Ok(Some(Vec::new())),
        Item::Refused(code) if code == "WRONGTYPE" => Ok(Some(Vec::new())),
        Item::Refused(code) => Err(RemoteError::new(
            ErrorKind::Store,
            format!("the store refused a read: {code}"),
        )),
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
