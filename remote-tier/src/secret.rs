//! [`Secret`]: what the instances sharing a store know and the store does
//! not. Every blob carries a keyed MAC under a key derived from it, every
//! chain of keys starts from a root it is mixed into, and tenants'
//! namespaces are keyed hashes of their credentials under a third key
//! derived from it. The secret itself never leaves the process.

use std::fmt;
use std::path::Path;

/// The environment variable a secret is read from when no file is named.
pub const SECRET_ENV: &str = "KVFORGE_REMOTE_SECRET";

/// Fewest bytes a secret may have.
pub const MIN_SECRET_BYTES: usize = 16;

/// A cluster's shared secret, as the keys derived from it.
#[derive(Clone)]
pub struct Secret {
    mac: [u8; 32],
    tenant: [u8; 32],
    /// Mixed into every chain's root: a store shared under two secrets
    /// holds two disjoint key spaces.
    keyspace: u128,
}

/// Why a secret cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Neither a file nor the environment variable gives one.
    #[error(
        "no secret for the remote tier: set {SECRET_ENV} or remote.secret_file (the same on every instance sharing the store, at least {MIN_SECRET_BYTES} bytes)"
    )]
    Missing,
    /// Shorter than [`MIN_SECRET_BYTES`] (surrounding whitespace aside).
    #[error(
        "the remote tier's secret ({from}) is {len} bytes; it needs at least {MIN_SECRET_BYTES}"
    )]
    Short {
        /// Where it came from.
        from: String,
        /// Its length.
        len: usize,
    },
    /// The file cannot be read.
    #[error("cannot read the remote tier's secret file {path}: {why}")]
    File {
        /// The file.
        path: String,
        /// The operating system's words.
        why: String,
    },
}

impl Secret {
    /// A secret from its bytes (surrounding ASCII whitespace, such as a
    /// file's final newline, is not part of it).
    pub fn new(bytes: &[u8]) -> Result<Self, SecretError> {
        Self::named(bytes, "given")
    }

    fn named(bytes: &[u8], from: &str) -> Result<Self, SecretError> {
        let b = bytes.trim_ascii();
        if b.len() < MIN_SECRET_BYTES {
            return Err(SecretError::Short {
                from: from.into(),
                len: b.len(),
            });
        }
        let key = |context: &str| blake3::derive_key(context, b);
        let space = key("kvforge 2026-12 remote tier keyspace");
        let mut first = [0u8; 16];
        first.copy_from_slice(&space[..16]);
        Ok(Secret {
            mac: key("kvforge 2026-12 remote tier blob mac"),
            tenant: key("kvforge 2026-12 tenant namespace"),
            keyspace: u128::from_le_bytes(first),
        })
    }

    /// The secret in `file` if one is named, else in [`SECRET_ENV`].
    pub fn from_file_or_env(file: Option<&Path>) -> Result<Self, SecretError> {
        match file {
            Some(p) => {
                let bytes = std::fs::read(p).map_err(|e| SecretError::File {
                    path: p.display().to_string(),
                    why: e.to_string(),
                })?;
                Self::named(&bytes, &p.display().to_string())
            }
            None => match std::env::var_os(SECRET_ENV) {
                Some(v) => Self::named(v.as_encoded_bytes(), SECRET_ENV),
                None => Err(SecretError::Missing),
            },
        }
    }

    /// A fresh random secret: for one process that shares nothing (its
    /// tenants' namespaces), and for tests.
    pub fn random() -> Self {
        let mut b = [0u8; 32];
        // The OS's generator; should it fail, the time and the process id
        // still give a namespace no other process predicts by position.
        if getrandom::fill(&mut b).is_err() {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            b[..16].copy_from_slice(&t.to_le_bytes());
            b[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        }
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        match Self::new(hex.as_bytes()) {
            Ok(s) => s,
            Err(_) => unreachable!("64 hex digits are long enough"),
        }
    }

    /// The MAC of `data` (a blob's header and payload).
    pub(crate) fn mac(&self, data: &[u8]) -> blake3::Hash {
        blake3::keyed_hash(&self.mac, data)
    }

    /// What every chain's root mixes in.
    pub(crate) fn keyspace(&self) -> u128 {
        self.keyspace
    }

    /// The prefix-cache namespace of the tenant holding `credential` (an
    /// API key): a keyed hash, so it names no key in clear, depends on the
    /// credential and not on where it is listed, and is the same on every
    /// instance with this secret.
    pub fn tenant(&self, credential: &str) -> String {
        let h = blake3::keyed_hash(&self.tenant, credential.as_bytes());
        let hex: String = h.as_bytes()[..16]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        format!("tenant-{hex}")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(keyspace {:08x}…)", self.keyspace >> 96)
    }
}

impl PartialEq for Secret {
    /// Two secrets are equal when they derive the same keys.
    fn eq(&self, other: &Self) -> bool {
        blake3::Hash::from(self.mac) == blake3::Hash::from(other.mac)
    }
}

impl Eq for Secret {}
