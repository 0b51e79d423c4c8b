//! API keys and tenants. Each accepted key is a tenant; its prefix-cache
//! namespace is a keyed hash of the key ([`Secret::tenant`]), so it
//! depends on the key alone — not on where `--api-key` lists it — names
//! no key in clear, and is the same on every instance sharing a remote
//! tier (whose secret keys the hash). A server without keys serves one
//! tenant of its own, [`ANONYMOUS`], which no key's namespace equals.

use axum::http::{HeaderMap, header};
use kvforge_remote::Secret;

use crate::error::ApiError;

/// The namespace of a server that asks for no key.
pub const ANONYMOUS: &str = "anonymous";

/// The accepted keys, as the namespaces they map to.
pub struct Auth {
    secret: Secret,
    /// One per accepted key (empty: no key needed).
    tenants: Vec<String>,
}

impl Auth {
    /// Accepts `keys` (surrounding whitespace trimmed; an empty key, or one
    /// with whitespace or control characters inside, which no
    /// `Authorization` header carries, is refused), their namespaces keyed
    /// by `secret`.
    pub fn new(keys: &[String], secret: Secret) -> Result<Self, String> {
        let mut tenants = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let k = k.trim();
            if k.is_empty() {
                return Err(format!(
                    "--api-key: key {} of {} is empty",
                    i + 1,
                    keys.len()
                ));
            }
            if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(format!(
                    "--api-key: key {} of {} holds whitespace or a control character",
                    i + 1,
                    keys.len()
                ));
            }
            tenants.push(secret.tenant(k));
        }
        tenants.sort();
        tenants.dedup();
        Ok(Auth { secret, tenants })
    }

    /// Whether a key is needed.
    pub fn required(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The namespace of the request's tenant, or 401. The key given is
    /// hashed first and compared with every accepted key's hash, so the
    /// time taken says nothing about how much of a key was right.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        if self.tenants.is_empty() {
            return Ok(ANONYMOUS.into());
        }
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.get(..7)
                    .filter(|p| p.eq_ignore_ascii_case("bearer "))
                    .map(|_| &v[7..])
            })
            .map(str::trim);
        let Some(k) = given else {
            return Err(ApiError::unauthorized(
                "no API key: send the header Authorization: Bearer KEY",
            ));
        };
        let ns = self.secret.tenant(k);
        let known = self
            .tenants
            .iter()
            .fold(false, |found, t| found | (t.as_bytes() == ns.as_bytes()));
        if known {
            Ok(ns)
        } else {
            Err(ApiError::unauthorized("incorrect API key provided"))
        }
    }
}
