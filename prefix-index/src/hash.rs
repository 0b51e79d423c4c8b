//! Chained block keys: `key(i) = H(seed, key(i-1) ‖ tokens_i as LE u32)`,
//! with the namespace and adapter mixed into the root (`key(-1)`).

use std::hash::{BuildHasher, Hasher};

use crate::ExtraKeys;

/// A 128-bit block key. It covers the block's tokens *and* everything before
/// them, so equal keys mean equal prefixes (up to hash collisions, which the
/// indexes rule out by comparing tokens).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A 128-bit hash function over bytes. Swap it to test collision handling.
pub trait BlockHasher: Send + Sync {
    /// Hashes `input`.
    fn hash(&self, input: &[u8]) -> u128;
}

impl<T: BlockHasher + ?Sized> BlockHasher for &T {
    fn hash(&self, input: &[u8]) -> u128 {
        (**self).hash(input)
    }
}

/// xxh3-128 with a seed: the default hasher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xxh3Hasher {
    seed: u64,
}

impl Xxh3Hasher {
    /// A fixed seed: reproducible keys across runs (research, tests).
    pub const fn with_seed(seed: u64) -> Self {
        Xxh3Hasher { seed }
    }

    /// A seed from the operating system's RNG, so keys cannot be predicted
    /// (or collided on purpose) by other tenants. Falls back to a seed mixed
    /// from the clock and process id if the OS RNG is unavailable.
    pub fn random() -> Self {
        let seed = getrandom::u64().unwrap_or_else(|_| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            let mut buf = [0u8; 20];
            buf[..16].copy_from_slice(&t.to_le_bytes());
            buf[16..].copy_from_slice(&std::process::id().to_le_bytes());
            xxhash_rust::xxh3::xxh3_64(&buf)
        });
        Xxh3Hasher { seed }
    }

    /// The seed in use (log it to reproduce a run).
    pub const fn seed(&self) -> u64 {
        self.seed
    }
}

impl BlockHasher for Xxh3Hasher {
    #[inline]
    fn hash(&self, input: &[u8]) -> u128 {
        xxhash_rust::xxh3::xxh3_128_with_seed(input, self.seed)
    }
}

/// Computes the key of one block given its parent's key. `scratch` is reused
/// between calls to avoid allocation.
#[inline]
pub fn block_key<H: BlockHasher + ?Sized>(
    hasher: &H,
    parent: BlockHash,
    tokens: &[u32],
    scratch: &mut Vec<u8>,
) -> BlockHash {
    scratch.clear();
    scratch.reserve(16 + 4 * tokens.len());
    scratch.extend_from_slice(&parent.0.to_le_bytes());
    #[cfg(target_endian = "little")]
    scratch.extend_from_slice(bytemuck::cast_slice(tokens));
    #[cfg(not(target_endian = "little"))]
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(hasher.hash(scratch))
}

/// The key every chain of a namespace starts from: the namespace salt and the
/// adapter id hashed with a domain tag, so two namespaces never share a key.
pub fn root_key<H: BlockHasher + ?Sized>(hasher: &H, extra: &ExtraKeys) -> BlockHash {
    let ns = extra.namespace.as_bytes();
    let mut buf = Vec::with_capacity(32 + ns.len());
    buf.extend_from_slice(b"kvforge/root/v1\0");
    buf.extend_from_slice(&(ns.len() as u64).to_le_bytes());
    buf.extend_from_slice(ns);
    match extra.adapter {
        Some(a) => {
            buf.push(1);
            buf.extend_from_slice(&a.to_le_bytes());
        }
        None => buf.push(0),
    }
    BlockHash(hasher.hash(&buf))
}

/// Hashes the index's own map keys cheaply, deterministically (no
/// `RandomState`): a [`BlockHash`] is already uniform, so it is folded to 64
/// bits (lookups do not hash twice); a block slot index (`u32`) takes one
/// multiplication (Fibonacci hashing). Slot maps are probed on every insert
/// and forget.
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct KeyHash;

impl BuildHasher for KeyHash {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for other key types; keep it correct anyway.
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (u64::from(v) ^ self.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64) ^ ((v >> 64) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_keys_depend_on_the_whole_prefix() {
        let h = Xxh3Hasher::with_seed(7);
        let mut s = Vec::new();
        let root = root_key(&h, &ExtraKeys::default());
        let a = block_key(&h, root, &[1, 2, 3], &mut s);
        let b = block_key(&h, root, &[1, 2, 4], &mut s);
        assert_ne!(a, b);
        let a2 = block_key(&h, a, &[5, 6, 7], &mut s);
        let b2 = block_key(&h, b, &[5, 6, 7], &mut s);
        assert_ne!(a2, b2, "same tokens after different prefixes");
        assert_eq!(a, block_key(&h, root, &[1, 2, 3], &mut s), "deterministic");
    }

    #[test]
    fn seed_namespace_and_adapter_change_the_root() {
        let (h1, h2) = (Xxh3Hasher::with_seed(1), Xxh3Hasher::with_seed(2));
        let e = ExtraKeys::default();
        assert_ne!(root_key(&h1, &e), root_key(&h2, &e));
        let t = ExtraKeys::namespace("tenant-a");
        assert_ne!(root_key(&h1, &e), root_key(&h1, &t));
        assert_ne!(root_key(&h1, &t), root_key(&h1, &t.clone().with_adapter(3)));
        // Length prefix: ("ab", None) and ("a", Some(..)) cannot alias.
        assert_ne!(
            root_key(&h1, &ExtraKeys::namespace("a")),
            root_key(&h1, &ExtraKeys::namespace("a\0"))
        );
    }

    #[test]
    fn random_seeds_differ() {
        assert_ne!(Xxh3Hasher::random().seed(), Xxh3Hasher::random().seed());
    }
}
