//! A KV tier shared by many kvforge instances, on a store outside them
//! (Redis, Valkey, Redis Cluster, or anything that can get and
//! set-if-absent a value by key).
//!
//! A prefix one instance computed can be reused by another: each full,
//! immutable block of a prefix is stored once, under a key that covers
//! everything its KV depends on ([`Scope`]: a cluster-wide seed, the
//! model's fingerprint, the KV layout and storage format, the block size;
//! then the namespace and the whole chain of tokens before it), as one
//! self-describing [`blob`] that echoes that key and carries a checksum.
//!
//! * [`RemoteTier`] — the store: batched [`contains`](RemoteTier::contains),
//!   [`get_many`](RemoteTier::get_many) and set-if-absent
//!   [`put_many`](RemoteTier::put_many) by [`RemoteKey`]. No network here:
//!   [`MemoryTier`] is the in-memory implementation (tests, one process);
//!   `kvforge-remote-redis` is the Redis one. Every implementation runs
//!   [`testing::check_remote_tier`].
//! * [`RemoteCache`] — what an engine holds: it computes the chain of keys
//!   of a prompt, looks the blocks after a local prefix hit up in one
//!   round, **verifies** each blob (key, parent key, scope, shape, tokens,
//!   checksum) and hands back only the leading verified payloads; writes go
//!   through a bounded [`WriteBehind`] queue on its own thread, so a decode
//!   step never waits for the store.
//!
//! **Every remote error is a miss**: a store that is down, slow past its
//! deadline, full, or holding a corrupt, truncated or foreign value costs
//! a recomputation and a counter in [`RemoteStats`], never a failed
//! request and never wrong KV.

#![deny(missing_docs)]

pub mod blob;
mod cache;
mod key;
mod memory;
mod stats;
pub mod testing;
mod writer;

pub use blob::BlobError;
pub use cache::{Offer, RemoteCache, RemoteOptions};
pub use key::{Link, RemoteKey, Scope};
pub use kvforge_prefix::ExtraKeys;
pub use memory::MemoryTier;
pub use stats::{Histogram, RemoteStats};
pub use writer::WriteBehind;

/// What went wrong talking to a store (each is counted, and is a miss).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum ErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// Not connected: refused, dropped, unreachable.
    Connection,
    /// The store answered with an error (out of memory, wrong type, a
    /// cluster redirection it could not follow, …).
    Store,
}

/// A failed store call: its kind and the store's message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct RemoteError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// The store's own words.
    pub message: String,
}

impl RemoteError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        RemoteError {
            kind,
            message: message.into(),
        }
    }
}

/// A key-value store holding immutable block blobs.
///
/// Calls are batched (one round trip for a whole chain where the store
/// can), bounded by the implementation's own deadline, and never block
/// past it. Values are never overwritten: [`put_many`](Self::put_many)
/// writes a key only if it is absent, so two writers of the same block
/// cannot interleave; the first value stays (until the store expires or
/// evicts it). Run [`testing::check_remote_tier`] against any
/// implementation.
pub trait RemoteTier: Send + Sync {
    /// Whether the store holds each of `keys`, in order.
    fn contains(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError>;

    /// The value of each of `keys`, in order (`None`: absent).
    fn get_many(&self, keys: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError>;

    /// Writes each `(key, value)` whose key is absent (set-if-absent, with
    /// the store's expiry); a key given twice in one batch keeps the first.
    /// Returns how many keys were written.
    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<usize, RemoteError>;

    /// Where it stores (for logs): `memory`, `redis://127.0.0.1:6379`, ….
    fn describe(&self) -> String;
}

impl<T: RemoteTier + ?Sized> RemoteTier for std::sync::Arc<T> {
    fn contains(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        (**self).contains(keys)
    }
    fn get_many(&self, keys: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        (**self).get_many(keys)
    }
    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<usize, RemoteError> {
        (**self).put_many(items)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}
