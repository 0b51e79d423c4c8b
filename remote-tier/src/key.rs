//! Keys: a [`Scope`] (everything a block's KV depends on besides its
//! tokens) mixed into the root of a chain of block hashes over the tokens.

use kvforge_prefix::{BlockHash, ExtraKeys, Xxh3Hasher, block_key, root_key};
use xxhash_rust::xxh3::xxh3_128;

use crate::secret::Secret;

/// A block's key in the store: 128 bits covering the scope, the namespace
/// and every token up to the end of the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey(pub u128);

impl RemoteKey {
    /// The store's key text: `kvforge:v1:` and 32 hex digits.
    pub fn text(&self) -> String {
        format!("kvforge:v1:{:032x}", self.0)
    }
}

/// A block's place in its chain: its key and its parent's (the scope's
/// root for the first block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The block's key.
    pub key: RemoteKey,
    /// The key before it.
    pub parent: RemoteKey,
}

/// Everything a block's stored bytes depend on besides its tokens. Two
/// instances share blocks only when every field is equal; a field that
/// differs gives other keys (no hit), and a blob read back is checked
/// against all of them anyway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// The cluster-wide hash seed (configuration: a per-process random
    /// seed would give no hit across instances).
    pub seed: u64,
    /// The model's fingerprint (its weights' bytes and its tokenizer).
    pub model: u128,
    /// Layers of the model.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// The payload's format, e.g. `f16` or `int4-g32-kc` (the engine names
    /// it; any change of numerics must change the name).
    pub format: String,
    /// Bytes of one block's payload in that format.
    pub payload_bytes: u64,
}

impl Scope {
    /// A 128-bit digest of every field.
    pub fn digest(&self) -> u128 {
        let mut b = Vec::with_capacity(80 + self.format.len());
        b.extend_from_slice(b"kvforge/remote/scope/v1\0");
        b.extend_from_slice(&self.seed.to_le_bytes());
        b.extend_from_slice(&self.model.to_le_bytes());
        for x in [self.layers, self.kv_heads, self.head_dim, self.block_size] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b.extend_from_slice(&self.payload_bytes.to_le_bytes());
        b.extend_from_slice(&(self.format.len() as u64).to_le_bytes());
        b.extend_from_slice(self.format.as_bytes());
        xxh3_128(&b)
    }

    /// The key every chain of `extra`'s namespace starts from, in the key
    /// space of `secret`.
    pub fn root(&self, secret: &Secret, extra: &ExtraKeys) -> RemoteKey {
        let h = Xxh3Hasher::with_seed(self.seed);
        let ns = root_key(&h, extra);
        let mut scratch = Vec::new();
        let words: Vec<u32> = [self.digest(), secret.keyspace()]
            .iter()
            .flat_map(|d| (0..4).map(move |i| (d >> (32 * i)) as u32))
            .collect();
        RemoteKey(block_key(&h, ns, &words, &mut scratch).0)
    }

    /// The links of every full block of `tokens` (a trailing partial block
    /// has none: only full blocks are shared).
    pub fn chain(&self, secret: &Secret, tokens: &[u32], extra: &ExtraKeys) -> Vec<Link> {
        let h = Xxh3Hasher::with_seed(self.seed);
        let mut parent = self.root(secret, extra);
        let mut scratch = Vec::new();
        let bs = (self.block_size as usize).max(1);
        tokens
            .chunks_exact(bs)
            .map(|block| {
                let key = RemoteKey(block_key(&h, BlockHash(parent.0), block, &mut scratch).0);
                let link = Link { key, parent };
                parent = key;
                link
            })
            .collect()
    }
}
