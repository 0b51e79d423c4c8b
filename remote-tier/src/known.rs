//! [`Known`]: the keys a [`RemoteCache`](crate::RemoteCache) stored or
//! queued recently, so that a block offered again is not written again;
//! the write-behind worker forgets a key whose write failed.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::key::RemoteKey;

/// Keys stored or queued recently, oldest first (bounded). Removal is
/// lazy: `order` may hold entries `at` no longer has (or has newer).
pub(crate) struct Known {
    at: HashMap<RemoteKey, Instant>,
    order: VecDeque<(RemoteKey, Instant)>,
    cap: usize,
    ttl: Duration,
}

impl Known {
    /// At most `cap` keys, each for `ttl`.
    pub(crate) fn new(cap: usize, ttl: Duration) -> Self {
        Known {
            at: HashMap::new(),
            order: VecDeque::new(),
            cap,
            ttl,
        }
    }

    pub(crate) fn fresh(&self, key: RemoteKey, now: Instant) -> bool {
        self.at
            .get(&key)
            .is_some_and(|&t| now.saturating_duration_since(t) < self.ttl)
    }

    pub(crate) fn insert(&mut self, key: RemoteKey, now: Instant) {
        self.at.insert(key, now);
        self.order.push_back((key, now));
        while self.at.len() > self.cap || self.order.len() > 2 * self.cap.max(1) {
            let Some((k, t)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&k) == Some(&t) {
                self.at.remove(&k);
            }
        }
    }

    pub(crate) fn forget(&mut self, key: RemoteKey) {
        self.at.remove(&key);
    }

    /// Forgets every key (the store forgot them).
    pub(crate) fn clear(&mut self) {
        self.at.clear();
        self.order.clear();
    }
}
