//! What the HTTP side and the engine loop share: the queue's count, the
//! closing flag, the counters and readings the loop publishes, and the
//! messages into the loop.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Instant;

use kvforge_engine::cache::CacheStats;

use super::job::Job;
use super::probe::ProbeReading;
use super::watch::Strip;
use crate::metrics::ServeMetrics;

/// What the HTTP side and the loop share.
#[derive(Default)]
pub struct Shared {
    /// Jobs submitted and not yet admitted (for the 429 check).
    pub queued: AtomicUsize,
    /// No new request is taken.
    pub closing: AtomicBool,
    /// The loop's counters.
    pub metrics: Mutex<ServeMetrics>,
    /// The cache's counters after the latest step.
    pub cache: Mutex<Option<CacheStats>>,
    /// Dashboards watching: while any is, each step publishes `strips`.
    pub watchers: AtomicUsize,
    /// The running requests' block tables after the latest step.
    pub strips: Mutex<Vec<Strip>>,
    /// The quality probe's readings.
    pub probe: Mutex<ProbeReading>,
    /// The KV events' log, when they are on (`--kv-events`): each step's
    /// events are committed as its batches.
    pub kv_events: Option<std::sync::Arc<crate::events::EventLog>>,
}

/// Locks `m`, whatever a panicking holder left (plain counters).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Messages into the loop.
pub enum Msg {
    /// A new request.
    Submit(Job),
    /// Stop: finish what runs until the deadline, then cancel the rest.
    Shutdown(Instant),
}
