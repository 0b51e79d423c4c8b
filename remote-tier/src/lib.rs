//! A KV tier shared by many kvforge instances, on a store outside them
//! (Redis, Valkey, Redis Cluster, or anything that can get and
//! set-if-absent a value by key).
//!
//! A prefix one instance computed can be reused by another: each full,
//! immutable block of a prefix is stored once, under a key that covers
//! everything its KV depends on ([`Scope`]: a cluster-wide seed, the
//! model's fingerprint, the KV layout and storage format, the block size;
//! the key space of the cluster's [`Secret`]; then the namespace and the
//! whole chain of tokens before it), as one self-describing [`blob`] that
//! echoes that key and carries a MAC keyed with the secret.
//!
//! * [`RemoteTier`] — the store: batched [`contains`](RemoteTier::contains),
//!   [`get_many`](RemoteTier::get_many), set-if-absent
//!   [`put_many`](RemoteTier::put_many), [`touch_many`](RemoteTier::touch_many)
//!   (renew the expiry) and [`remove_many`](RemoteTier::remove_many) by
//!   [`RemoteKey`]. No network here: [`MemoryTier`] is the in-memory
//!   implementation (tests, one process); `kvforge-remote-redis` is the
//!   Redis one. Every implementation runs [`testing::check_remote_tier`].
//! * [`RemoteCache`] — what an engine holds: it computes the chain of keys
//!   of a prompt, looks the blocks after a local prefix hit up in one
//!   round, **verifies** each blob (MAC, key, parent key, scope, shape,
//!   tokens) and hands back only the leading verified payloads; writes,
//!   renewals of verified keys and deletions of invalid ones go through a
//!   bounded [`WriteBehind`] queue on its own thread, so a decode step
//!   never waits for the store.
//!
//! **Every remote error is a miss**: a store that is down, slow past its
//! deadline, full, or holding a corrupt, truncated or foreign value costs
//! a recomputation and a counter in [`RemoteStats`], never a failed
//! request and never wrong KV.

#![deny(missing_docs)]

pub mod blob;
mod cache;
mod clock;
mod key;
mod known;
mod memory;
mod secret;
mod stats;
pub mod testing;
mod writer;

pub use blob::BlobError;
pub use cache::{Offer, RemoteCache, RemoteOptions};
pub use clock::{Clock, ManualClock, SystemClock};
pub use key::{Link, RemoteKey, Scope};
pub use kvforge_prefix::ExtraKeys;
pub use memory::MemoryTier;
pub use secret::{MIN_SECRET_BYTES, SECRET_ENV, Secret, SecretError};
pub use stats::{Histogram, RemoteStats, StatsSource};
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

/// What became of one item of a [`RemoteTier::put_many`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The key was absent and now holds the value.
    Written,
    /// The key was held already (its value stays).
    Held,
    /// The store refused this key alone (out of memory, a wrong type):
    /// nothing was written.
    Refused,
}

/// A key-value store holding immutable block blobs.
///
/// Calls are batched (one round trip for a whole chain where the store
/// can), bounded by the implementation's own deadline, and never block
/// past it. Values are never overwritten: [`put_many`](Self::put_many)
/// writes a key only if it is absent, so two writers of the same block
/// cannot interleave; the first value stays (until the store expires or
/// evicts it, or a reader that found it invalid removes it). A read renews
/// nothing: only [`touch_many`](Self::touch_many) does, which readers call
/// for the keys that verified. Run [`testing::check_remote_tier`] against
/// any implementation.
pub trait RemoteTier: Send + Sync {
    /// Whether the store holds each of `keys`, in order.
    fn contains(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError>;

    /// The value of each of `keys`, in order (`None`: absent).
    fn get_many(&self, keys: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError>;

    /// Writes each `(key, value)` whose key is absent (set-if-absent, with
    /// the store's expiry); a key given twice in one batch keeps the first.
    /// Answers what became of each item, in order.
    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError>;

    /// Renews the expiry of each of `keys` as a fresh write would (a store
    /// without expiry renews nothing); whether each is held, in order.
    fn touch_many(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        self.contains(keys)
    }

    /// Deletes each of `keys`; how many were held.
    fn remove_many(&self, keys: &[RemoteKey]) -> Result<usize, RemoteError>;

    /// How many times the connection to the store was lost so far, retried
    /// calls included: a store that restarted may have lost what was
    /// written since its last snapshot, so a reader forgets what it
    /// believed stored whenever this changes. 0 for a store in process.
    fn reconnects(&self) -> u64 {
        0
    }

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
    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
        (**self).put_many(items)
    }
    fn touch_many(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        (**self).touch_many(keys)
    }
    fn remove_many(&self, keys: &[RemoteKey]) -> Result<usize, RemoteError> {
        (**self).remove_many(keys)
    }
    fn reconnects(&self) -> u64 {
        (**self).reconnects()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
}
