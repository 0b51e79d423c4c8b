//! One block as one immutable value: a header that echoes the block's full
//! key, its parent's key, the scope, the shape and the tokens, then the
//! payload, then a keyed MAC of all of it.
//!
//! ```text
//! "KVFB" | version u16 | 0u16
//! key u128 | parent u128 | scope digest u128
//! layers u32 | kv_heads u32 | head_dim u32 | block_size u32
//! format length u16 | format bytes
//! token count u32 | token ids u32…
//! payload length u64
//! payload
//! MAC: BLAKE3 keyed with the cluster's secret (32 bytes, of everything above)
//! ```
//!
//! All integers little-endian. [`open`] checks the MAC first (in constant
//! time), then every field against what the reader expects; anything else
//! is a [`BlobError`], which the reader counts as a miss. Without the
//! secret no one can make a blob an instance accepts: not by changing a
//! payload, nor by moving a valid blob to another key (the key, the
//! parent's key and the scope are under the MAC, and the key covers the
//! tenant's namespace).

use crate::key::{Link, Scope};
use crate::secret::Secret;

const MAGIC: &[u8; 4] = b"KVFB";
const VERSION: u16 = 2;
const MAC_BYTES: usize = 32;

/// Why a stored value is not the block asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    /// Shorter than its header or its stated payload.
    #[error("truncated")]
    Truncated,
    /// Not a kvforge block, or a version this reader does not know.
    #[error("not a kvforge block blob")]
    Magic,
    /// The MAC does not match: written under another secret, or forged.
    #[error("not authenticated (another secret, or forged)")]
    Mac,
    /// Written under another key (or a different parent).
    #[error("written under another key")]
    Foreign,
    /// Another model, seed, layout or format.
    #[error("another scope (model, seed, layout or format)")]
    Scope,
    /// Other tokens than the block's (a key collision).
    #[error("other tokens")]
    Tokens,
    /// The payload's length is not the scope's.
    #[error("payload of another length")]
    Payload,
}

/// The blob of one block: `payload` (its KV in `scope.format`) for the
/// block at `link` holding `tokens`, authenticated under `secret`.
pub fn seal(secret: &Secret, scope: &Scope, link: Link, tokens: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut b =
        Vec::with_capacity(120 + scope.format.len() + 4 * tokens.len() + payload.len() + MAC_BYTES);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    for x in [link.key.0, link.parent.0, scope.digest()] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    for x in [
        scope.layers,
        scope.kv_heads,
        scope.head_dim,
        scope.block_size,
    ] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    let name = scope.format.as_bytes();
    let name = &name[..name.len().min(u16::MAX as usize)];
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(name);
    b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    b.extend_from_slice(payload);
    let mac = secret.mac(&b);
    b.extend_from_slice(mac.as_bytes());
    b
}

/// A cursor over a blob's header.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BlobError> {
        let end = self.at.checked_add(n).ok_or(BlobError::Truncated)?;
        let s = self.b.get(self.at..end).ok_or(BlobError::Truncated)?;
        self.at = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], BlobError> {
        self.take(N)?.try_into().map_err(|_| BlobError::Truncated)
    }
    fn u16(&mut self) -> Result<u16, BlobError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, BlobError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, BlobError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn u128(&mut self) -> Result<u128, BlobError> {
        Ok(u128::from_le_bytes(self.array()?))
    }
}

/// The payload of `blob` if it is the block at `link` holding `tokens`
/// in `scope`, sealed under `secret`: the MAC, every header field and the
/// payload's length (`scope.payload_bytes`) checked.
pub fn open<'a>(
    blob: &'a [u8],
    secret: &Secret,
    scope: &Scope,
    link: Link,
    tokens: &[u32],
) -> Result<&'a [u8], BlobError> {
    if blob.get(..4) != Some(MAGIC.as_slice()) || blob.get(4..6) != Some(&VERSION.to_le_bytes()) {
        return Err(BlobError::Magic);
    }
    let body = blob
        .len()
        .checked_sub(MAC_BYTES)
        .ok_or(BlobError::Truncated)?;
    let mut mac = [0u8; MAC_BYTES];
    mac.copy_from_slice(&blob[body..]);
    // blake3::Hash compares in constant time.
    if secret.mac(&blob[..body]) != blake3::Hash::from(mac) {
        return Err(BlobError::Mac);
    }
    let blob = &blob[..body];
    let mut r = Reader { b: blob, at: 0 };
    if r.take(4)? != MAGIC || r.u16()? != VERSION || r.u16()? != 0 {
        return Err(BlobError::Magic);
    }
    let (key, parent, digest) = (r.u128()?, r.u128()?, r.u128()?);
    let dims = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
    let name_len = r.u16()? as usize;
    let name = r.take(name_len)?;
    let count = r.u32()? as usize;
    let ids = r.take(count.checked_mul(4).ok_or(BlobError::Truncated)?)?;
    let len = r.u64()?;
    if key != link.key.0 || parent != link.parent.0 {
        return Err(BlobError::Foreign);
    }
    let want = [
        scope.layers,
        scope.kv_heads,
        scope.head_dim,
        scope.block_size,
    ];
    if digest != scope.digest() || dims != want || name != scope.format.as_bytes() {
        return Err(BlobError::Scope);
    }
    let same = count == tokens.len()
        && ids
            .chunks_exact(4)
            .zip(tokens)
            .all(|(c, t)| c == t.to_le_bytes());
    if !same {
        return Err(BlobError::Tokens);
    }
    let payload = &blob[r.at..];
    if len != scope.payload_bytes || payload.len() as u64 != len {
        return Err(if (payload.len() as u64) < len {
            BlobError::Truncated
        } else {
            BlobError::Payload
        });
    }
    Ok(payload)
}
