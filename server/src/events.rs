//! KV events for routers (`--kv-events`): what enters and leaves the
//! prefix index, per tenant, as server-sent events on `GET /v1/kv_events`.
//!
//! The engine loop's index is wrapped in a [`kvforge_prefix::Watched`]
//! whose sink is an [`EventLog`]: each index call's events become one
//! batch, numbered per tenant (`seq` 1 is `AllBlocksCleared`, the
//! instance's empty start), kept in a ring of `--kv-events-buffer` batches.
//! The subscription itself (`http/events.rs`): a subscriber sees its own
//! tenant's batches only (its API key's
//! namespace, whatever `cache_salt` its requests carried). It starts from
//! the oldest batch kept, or after its `Last-Event-ID`; when the batches it
//! asks for have left the ring, a `missed` event says which, so it knows
//! its view is incomplete. A subscriber that never reads holds one reply
//! chunk: batches are read from the ring when the connection can take
//! them, never queued per subscriber.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use kvforge_prefix::{EventSink, KvEvent};
use serde_json::json;
use tokio::sync::Notify;

use crate::sched::lock;

/// Batches a tenant's ring keeps by default.
pub const DEFAULT_BUFFER: usize = 1024;

/// One numbered batch, its `data` line ready.
#[derive(Clone)]
pub(crate) struct Stamped {
    pub(crate) seq: u64,
    pub(crate) json: Arc<str>,
}

#[derive(Default)]
struct Ring {
    /// The number the next batch gets.
    next: u64,
    batches: VecDeque<Stamped>,
}

/// Every tenant's recent batches.
pub struct EventLog {
    cap: usize,
    tenants: Mutex<HashMap<String, Ring>>,
    pub(crate) notify: Notify,
}

/// What a subscriber reads after its cursor.
pub(crate) struct Read {
    /// Batches numbered after the cursor that left the ring.
    pub(crate) missed: Option<(u64, u64)>,
    pub(crate) batches: Vec<Stamped>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The tenant a namespace belongs to (`cache_salt` appended after a NUL).
fn tenant_of(namespace: &str) -> &str {
    namespace.split('\0').next().unwrap_or(namespace)
}

impl EventLog {
    /// A log keeping `cap` (at least 1) batches per tenant.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(EventLog {
            cap: cap.max(1),
            tenants: Mutex::new(HashMap::new()),
            notify: Notify::new(),
        })
    }

    /// Appends one batch to `ring`, dropping the oldest beyond the cap.
    fn append(&self, ring: &mut Ring, events: &[KvEvent]) {
        ring.next += 1;
        let data = json!({"seq": ring.next, "ts": now(), "events": events});
        ring.batches.push_back(Stamped {
            seq: ring.next,
            json: data.to_string().into(),
        });
        while ring.batches.len() > self.cap {
            ring.batches.pop_front();
        }
    }

    /// The tenant's ring, started with `AllBlocksCleared` when new.
    fn ring<'a>(&self, tenants: &'a mut HashMap<String, Ring>, tenant: &str) -> &'a mut Ring {
        if !tenants.contains_key(tenant) {
            let mut ring = Ring::default();
            self.append(&mut ring, &[KvEvent::AllBlocksCleared]);
            tenants.insert(tenant.to_owned(), ring);
        }
        tenants.entry(tenant.to_owned()).or_default()
    }

    /// Records one batch of `namespace`'s events and wakes the subscribers.
    pub fn push(&self, namespace: &str, events: &[KvEvent]) {
        {
            let mut tenants = lock(&self.tenants);
            let ring = self.ring(&mut tenants, tenant_of(namespace));
            self.append(ring, events);
        }
        self.notify.notify_waiters();
    }

    /// The tenant's batches numbered after `after`.
    pub(crate) fn read(&self, tenant: &str, after: u64) -> Read {
        let mut tenants = lock(&self.tenants);
        let ring = self.ring(&mut tenants, tenant);
        let first = ring.batches.front().map_or(ring.next + 1, |b| b.seq);
        let missed = (after + 1 < first).then_some((after + 1, first - 1));
        let batches = ring
            .batches
            .iter()
            .filter(|b| b.seq > after)
            .cloned()
            .collect();
        Read { missed, batches }
    }

    /// Batches kept, over all tenants (for tests of the bound).
    pub fn kept(&self) -> usize {
        lock(&self.tenants).values().map(|r| r.batches.len()).sum()
    }
}

/// The sink the watched index writes to.
pub struct LogSink(pub Arc<EventLog>);

impl EventSink for LogSink {
    fn publish(&mut self, namespace: &str, events: Vec<KvEvent>) {
        self.0.push(namespace, &events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tenant_keeps_its_last_batches_and_a_salt_is_its_tenants() {
        let log = EventLog::new(4);
        for _ in 0..50 {
            log.push("a", &[KvEvent::AllBlocksCleared]);
            log.push("a\0salt", &[KvEvent::AllBlocksCleared]);
            log.push("b", &[KvEvent::AllBlocksCleared]);
        }
        assert_eq!(log.kept(), 8);
        // "a" numbered its start and 100 batches: 98..=101 kept.
        let r = log.read("a", 0);
        assert_eq!(r.missed, Some((1, 97)));
        let seqs: Vec<u64> = r.batches.iter().map(|b| b.seq).collect();
        assert_eq!(seqs, [98, 99, 100, 101]);
        let r = log.read("b", 50);
        assert_eq!((r.missed, r.batches.len()), (None, 1));
        // A tenant never published to starts with its empty state.
        let r = log.read("c", 0);
        assert_eq!((r.missed, r.batches.len()), (None, 1));
        assert!(r.batches[0].json.contains("AllBlocksCleared"));
    }
}
