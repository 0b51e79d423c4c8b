//! [`MemoryTier`]: the store in one process's memory, for tests and for
//! one process that wants the write-behind path without a server. It can
//! be told to fail, to hold at most so many bytes (oldest evicted first,
//! like a store under `maxmemory`), to forget everything (`FLUSHALL`), and
//! lets a test read and overwrite raw values. It has no expiry: a touch
//! renews nothing and counts as a renewal of a held key.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::key::RemoteKey;
use crate::{ErrorKind, Put, RemoteError, RemoteTier};

#[derive(Default)]
struct Mem {
    map: HashMap<RemoteKey, Vec<u8>>,
    order: VecDeque<RemoteKey>,
    bytes: usize,
    capacity: Option<usize>,
    fail: Option<ErrorKind>,
    touched: u64,
}

/// A [`RemoteTier`] in memory.
#[derive(Default)]
pub struct MemoryTier {
    mem: Mutex<Mem>,
}

impl MemoryTier {
    /// An empty store without a size limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store holding at most `bytes` of values: a write past it
    /// evicts the oldest values first.
    pub fn with_capacity(bytes: usize) -> Self {
        let t = Self::default();
        t.lock().capacity = Some(bytes);
        t
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mem> {
        self.mem.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes every call fail with `kind` (`None`: work again).
    pub fn fail_with(&self, kind: Option<ErrorKind>) {
        self.lock().fail = kind;
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw value of `key` (tests).
    pub fn raw_get(&self, key: RemoteKey) -> Option<Vec<u8>> {
        self.lock().map.get(&key).cloned()
    }

    /// Overwrites (or removes, with `None`) the value of `key`, as a
    /// faulty or hostile writer could (tests).
    pub fn raw_set(&self, key: RemoteKey, value: Option<Vec<u8>>) {
        let mut m = self.lock();
        if let Some(old) = m.map.remove(&key) {
            m.bytes -= old.len();
            m.order.retain(|k| *k != key);
        }
        if let Some(v) = value {
            m.bytes += v.len();
            m.order.push_back(key);
            m.map.insert(key, v);
        }
    }

    /// Forgets every key, as `FLUSHALL` or a restart without persistence
    /// does.
    pub fn clear(&self) {
        let mut m = self.lock();
        m.map.clear();
        m.order.clear();
        m.bytes = 0;
    }

    /// Keys renewed by [`touch_many`](RemoteTier::touch_many) so far
    /// (held ones only).
    pub fn touched(&self) -> u64 {
        self.lock().touched
    }

    fn check(m: &Mem) -> Result<(), RemoteError> {
        match m.fail {
            Some(kind) => Err(RemoteError::new(kind, "injected failure")),
            None => Ok(()),
        }
    }
}

impl RemoteTier for MemoryTier {
    fn contains(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        let m = self.lock();
        Self::check(&m)?;
        Ok(keys.iter().map(|k| m.map.contains_key(k)).collect())
    }

    fn get_many(&self, keys: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        let m = self.lock();
        Self::check(&m)?;
        Ok(keys.iter().map(|k| m.map.get(k).cloned()).collect())
    }

    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
        let mut m = self.lock();
        Self::check(&m)?;
        let mut out = Vec::with_capacity(items.len());
        for (k, v) in items {
            if m.map.contains_key(k) {
                out.push(Put::Held);
                continue;
            }
            if let Some(cap) = m.capacity {
                if v.len() > cap {
                    // Like Redis' OOM answer to one command of a batch.
                    out.push(Put::Refused);
                    continue;
                }
                while m.bytes + v.len() > cap {
                    let Some(old) = m.order.pop_front() else {
                        break;
                    };
                    if let Some(val) = m.map.remove(&old) {
                        m.bytes -= val.len();
                    }
                }
            }
            m.bytes += v.len();
            m.order.push_back(*k);
            m.map.insert(*k, v.clone());
            out.push(Put::Written);
        }
        Ok(out)
    }

    fn touch_many(&self, keys: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        let mut m = self.lock();
        Self::check(&m)?;
        let held: Vec<bool> = keys.iter().map(|k| m.map.contains_key(k)).collect();
        m.touched += held.iter().filter(|h| **h).count() as u64;
        Ok(held)
    }

    fn remove_many(&self, keys: &[RemoteKey]) -> Result<usize, RemoteError> {
        let mut m = self.lock();
        Self::check(&m)?;
        let mut removed = 0;
        for k in keys {
            if let Some(v) = m.map.remove(k) {
                m.bytes -= v.len();
                m.order.retain(|x| x != k);
                removed += 1;
            }
        }
        Ok(removed)
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}
