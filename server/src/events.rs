//! KV events for routers (`--kv-events`): what enters and leaves the
//! prefix index, per namespace, as server-sent events on
//! `GET /v1/kv_events`.
//!
//! The engine loop's index is wrapped in a [`kvforge_prefix::Watched`]
//! whose sink is an [`EventLog`]: what the index reports is held as
//! pending, and the loop commits it ([`EventLog::commit`]) as one batch per
//! namespace when a request's KV has been registered (before its reply
//! ends) and at the end of each step (vLLM batches per engine step). A
//! tenant's (API key's) batches are numbered from 1 (`AllBlocksCleared`:
//! the instance's empty start) and kept in a ring of at most
//! `--kv-events-buffer` batches and [`MAX_RING_BYTES`] of JSON. A batch
//! belongs to one namespace — the key and the requests' `cache_salt` — and
//! a subscriber reads its own key's batches of one salt only (none, or the
//! `cache_salt` it names), so the token ids a batch carries never reach
//! another tenant, nor another salt of the same key.
//!
//! Batch ids are `EPOCH-SEQ`, the epoch drawn when the log is made: a
//! subscriber resuming with a `Last-Event-ID` of another epoch (the server
//! restarted) or beyond the last batch starts again from the oldest batch
//! kept; batches it asks for that left the ring are named in a `missed`
//! event (the subscription itself: `http/events.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use kvforge_prefix::{EventSink, KvEvent};
use serde_json::json;
use tokio::sync::Notify;

use crate::sched::lock;

/// Batches a tenant's ring keeps by default.
pub const DEFAULT_BUFFER: usize = 1024;

/// Bytes of JSON a tenant's ring keeps at most, whatever the batch count.
pub const MAX_RING_BYTES: usize = 16 << 20;

/// Batches one read hands a subscriber at most (what a subscriber that
/// stops reading holds besides its socket's buffer).
pub(crate) const READ_AHEAD: usize = 8;

/// One numbered batch, its `data` line ready.
#[derive(Clone)]
pub(crate) struct Stamped {
    pub(crate) seq: u64,
    /// The namespace's `cache_salt`, if any.
    salt: Option<Box<str>>,
    pub(crate) json: Arc<str>,
}

#[derive(Default)]
struct Ring {
    /// The number of the last batch (0 before any).
    last: u64,
    bytes: usize,
    batches: VecDeque<Stamped>,
}

#[derive(Default)]
struct State {
    tenants: HashMap<String, Ring>,
    /// This step's events by namespace, in order.
    pending: Vec<(String, Vec<KvEvent>)>,
}

/// Every tenant's recent batches.
pub struct EventLog {
    cap: usize,
    epoch: u64,
    state: Mutex<State>,
    pub(crate) notify: Notify,
}

/// What a subscriber reads after its cursor.
pub(crate) struct Read {
    /// Batches numbered after the cursor that left the ring.
    pub(crate) missed: Option<(u64, u64)>,
    /// Its salt's batches, at most [`READ_AHEAD`].
    pub(crate) batches: Vec<Stamped>,
    /// The cursor after this read (past other salts' batches too).
    pub(crate) upto: u64,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A namespace's tenant and salt (`cache_salt` follows a NUL).
fn split(namespace: &str) -> (&str, Option<&str>) {
    match namespace.split_once('\0') {
        Some((t, s)) => (t, Some(s)),
        None => (namespace, None),
    }
}

impl EventLog {
    /// A log keeping `cap` (at least 1) batches per tenant.
    pub fn new(cap: usize) -> Arc<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Arc::new(EventLog {
            cap: cap.max(1),
            epoch: nanos ^ u64::from(std::process::id()).rotate_left(32),
            state: Mutex::new(State::default()),
            notify: Notify::new(),
        })
    }

    /// The id of batch `seq`.
    pub(crate) fn id(&self, seq: u64) -> String {
        format!("{:016x}-{seq}", self.epoch)
    }

    /// The cursor a `Last-Event-ID` asks for: 0 (from the start) for
    /// another epoch's id; an error for one that is not an id.
    pub(crate) fn cursor(&self, id: &str) -> Result<u64, String> {
        let bad =
            || format!("Last-Event-ID must be an id this stream sent (EPOCH-SEQ), not {id:?}");
        let (epoch, seq) = id.trim().split_once('-').ok_or_else(bad)?;
        let epoch = u64::from_str_radix(epoch, 16).map_err(|_| bad())?;
        let seq = seq.parse::<u64>().map_err(|_| bad())?;
        Ok(if epoch == self.epoch { seq } else { 0 })
    }

    /// Appends one batch of `salt`'s events to `ring`, dropping the oldest
    /// beyond the caps.
    fn append(&self, ring: &mut Ring, salt: Option<&str>, events: &[KvEvent]) {
        ring.last += 1;
        let data = json!({
            "epoch": format!("{:016x}", self.epoch),
            "seq": ring.last,
            "ts": now(),
            "events": events,
        });
        let json: Arc<str> = data.to_string().into();
        ring.bytes += json.len();
        ring.batches.push_back(Stamped {
            seq: ring.last,
            salt: salt.map(Into::into),
            json,
        });
        while ring.batches.len() > self.cap
            || (ring.bytes > MAX_RING_BYTES && ring.batches.len() > 1)
        {
            if let Some(b) = ring.batches.pop_front() {
                ring.bytes -= b.json.len();
            }
        }
    }

    /// The tenant's ring, started with `AllBlocksCleared` when new.
    fn ring<'a>(&self, tenants: &'a mut HashMap<String, Ring>, tenant: &str) -> &'a mut Ring {
        tenants.entry(tenant.to_owned()).or_insert_with(|| {
            let mut ring = Ring::default();
            self.append(&mut ring, None, &[KvEvent::AllBlocksCleared]);
            ring
        })
    }

    /// Holds `namespace`'s events until the step's [`commit`](Self::commit).
    pub fn push(&self, namespace: &str, events: Vec<KvEvent>) {
        let mut st = lock(&self.state);
        match st.pending.last_mut() {
            Some((ns, e)) if ns == namespace => e.extend(events),
            _ => st.pending.push((namespace.to_owned(), events)),
        }
    }

    /// The step's events become one batch per namespace (in the order
    /// they came); the subscribers wake once.
    pub fn commit(&self) {
        let mut st = lock(&self.state);
        if st.pending.is_empty() {
            return;
        }
        let mut by_ns: Vec<(String, Vec<KvEvent>)> = Vec::new();
        for (ns, events) in std::mem::take(&mut st.pending) {
            match by_ns.iter_mut().find(|(n, _)| *n == ns) {
                Some((_, e)) => e.extend(events),
                None => by_ns.push((ns, events)),
            }
        }
        for (ns, events) in by_ns {
            let (tenant, salt) = split(&ns);
            let ring = self.ring(&mut st.tenants, tenant);
            self.append(ring, salt, &events);
        }
        drop(st);
        self.notify.notify_waiters();
    }

    /// `tenant`'s batches of `salt` numbered after `after` (from the
    /// start when `after` is past the last batch).
    pub(crate) fn read(&self, tenant: &str, salt: Option<&str>, after: u64) -> Read {
        let mut st = lock(&self.state);
        let ring = self.ring(&mut st.tenants, tenant);
        let after = if after > ring.last { 0 } else { after };
        let first = ring.batches.front().map_or(ring.last + 1, |b| b.seq);
        let missed = (after + 1 < first).then_some((after + 1, first - 1));
        let from = (after + 1).saturating_sub(first) as usize;
        let mut upto = after.max(first.saturating_sub(1));
        let mut batches = Vec::new();
        for b in ring.batches.iter().skip(from) {
            if batches.len() == READ_AHEAD {
                break;
            }
            upto = b.seq;
            // `AllBlocksCleared` (no salt) is every salt's.
            if b.salt.as_deref() == salt || b.seq == 1 {
                batches.push(b.clone());
            }
        }
        Read {
            missed,
            batches,
            upto,
        }
    }

    /// Batches kept, over all tenants (for tests of the bound).
    pub fn kept(&self) -> usize {
        lock(&self.state)
            .tenants
            .values()
            .map(|r| r.batches.len())
            .sum()
    }
}

/// The sink the watched index writes to.
pub struct LogSink(pub Arc<EventLog>);

impl EventSink for LogSink {
    fn publish(&mut self, namespace: &str, events: Vec<KvEvent>) {
        self.0.push(namespace, events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(log: &EventLog, ns: &str) {
        log.push(ns, vec![KvEvent::AllBlocksCleared]);
        log.commit();
    }

    #[test]
    fn each_tenant_keeps_its_last_batches_and_a_salt_reads_its_own() {
        let log = EventLog::new(4);
        for _ in 0..50 {
            batch(&log, "a");
            batch(&log, "a\0salt");
            batch(&log, "b");
        }
        assert_eq!(log.kept(), 8);
        // "a" numbered its start and 100 batches: 98..=101 kept, the
        // salted ones odd.
        let r = log.read("a", None, 0);
        assert_eq!(r.missed, Some((1, 97)));
        let seqs: Vec<u64> = r.batches.iter().map(|b| b.seq).collect();
        assert_eq!((seqs, r.upto), (vec![98, 100], 101));
        let r = log.read("a", Some("salt"), 0);
        let seqs: Vec<u64> = r.batches.iter().map(|b| b.seq).collect();
        assert_eq!(seqs, [99, 101]);
        let r = log.read("b", None, 50);
        assert_eq!((r.missed, r.batches.len()), (None, 1));
        // A tenant never published to starts with its empty state.
        let r = log.read("c", None, 0);
        assert_eq!((r.missed, r.batches.len()), (None, 1));
        assert!(r.batches[0].json.contains("AllBlocksCleared"));
    }

    #[test]
    fn a_step_is_one_batch_per_namespace_and_reads_are_bounded() {
        let log = EventLog::new(100);
        for _ in 0..3 {
            log.push("a", vec![KvEvent::AllBlocksCleared]);
            log.push("b", vec![KvEvent::AllBlocksCleared]);
        }
        log.commit();
        let r = log.read("a", None, 1);
        assert_eq!(r.batches.len(), 1);
        assert_eq!(r.batches[0].json.matches("AllBlocksCleared").count(), 3);
        for _ in 0..20 {
            batch(&log, "a");
        }
        let r = log.read("a", None, 0);
        assert_eq!((r.batches.len(), r.upto), (READ_AHEAD, 8));
    }

    #[test]
    fn ids_of_another_epoch_or_beyond_the_last_batch_start_again() {
        let log = EventLog::new(4);
        batch(&log, "a");
        let id = log.id(2);
        assert_eq!(log.cursor(&id), Ok(2));
        assert_eq!(log.cursor("0000000000000001-2"), Ok(0));
        for bad in ["2", "x-2", "0-", "0-2-3", ""] {
            assert!(
                log.cursor(bad).unwrap_err().contains("Last-Event-ID"),
                "{bad}"
            );
        }
        let r = log.read("a", None, u64::MAX);
        assert_eq!(r.batches.first().map(|b| b.seq), Some(1));
    }
}
