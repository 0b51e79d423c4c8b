//! The connection a call goes over and one round of commands on it: a
//! pipeline on a node, one command per key on a cluster; each key's answer
//! or refusal, and what a call's failure means.

use std::sync::Arc;

use futures_util::future::join_all;
use kvforge_remote::{ErrorKind, RemoteError};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Value};
use tokio::sync::Mutex;

/// A connection to the store: one node's multiplexed manager, or a
/// cluster client connected on first use.
pub(crate) enum Conn {
    Node(ConnectionManager),
    Cluster {
        client: Box<ClusterClient>,
        conn: Mutex<Option<ClusterConnection>>,
    },
}

/// What a call fails with: an error of the store, or none in time.
pub(crate) fn remote(e: &RedisError) -> RemoteError {
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

/// One key's answer in a batch: its value, or the store refusing that
/// command alone (with its error code: `WRONGTYPE`, `OOM`, `BUSY`, …)
/// while the others were answered.
pub(crate) enum Item {
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
pub(crate) async fn batch(conn: Arc<Conn>, cmds: Vec<redis::Cmd>) -> Result<Vec<Item>, RedisError> {
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
pub(crate) fn held(item: &Item) -> bool {
    matches!(item, Item::Value(Value::Int(n)) if *n > 0)
}

/// A value as bytes: absent, a byte string, or — a value of another type
/// at the key — empty bytes, which no blob verifies (an invalid block, to
/// be deleted). Any other refusal (`BUSY`, `LOADING`, `MASTERDOWN`, …) says
/// nothing about the key: the lookup fails, a miss.
pub(crate) fn bytes(item: Item) -> Result<Option<Vec<u8>>, RemoteError> {
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
