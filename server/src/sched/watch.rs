//! What the loop publishes after each step for the HTTP side: the cache's
//! reading, the gauges, the KV events' batch, and — while a dashboard
//! watches — each running request's block table as a strip of entries.

use std::sync::atomic::Ordering;

use kvforge_pool::Slot;

use super::{Scheduler, lock};

/// One running request's block table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Strip {
    /// The request's order of admission.
    pub request: u64,
    /// Tokens its sequence holds.
    pub tokens: usize,
    /// One letter per entry: `h` hot, `c` cold, `a` an alias of another
    /// block's content, `d` dropped, `p` a packed (head-wise) hot block.
    pub entries: String,
}

/// The letter of one entry.
fn letter(e: &kvforge_pool::Entry) -> char {
    match e.slot() {
        Slot::Hot(_) if e.is_packed() => 'p',
        Slot::Hot(_) => 'h',
        Slot::Cold(_) => 'c',
        Slot::Alias { .. } => 'a',
        Slot::Dropped => 'd',
    }
}

impl Scheduler {
    /// Publishes the gauges and the cache's counters.
    pub(super) fn publish(&self) {
        let stats = self.engine.cache().stats();
        *lock(&self.shared.cache) = Some(stats);
        if self.shared.watchers.load(Ordering::Relaxed) > 0 {
            *lock(&self.shared.strips) = self.strips();
        } else {
            // Unwatched, none kept: a dashboard opening later reads no
            // stale tables.
            lock(&self.shared.strips).clear();
        }
        if let Some(log) = &self.shared.kv_events {
            log.commit();
        }
        let mut m = lock(&self.shared.metrics);
        m.running = self.running.len();
        m.waiting = self.shared.queued.load(Ordering::SeqCst);
    }

    /// The running requests' strips, under one lock of the coordinator.
    pub(super) fn strips(&self) -> Vec<Strip> {
        self.engine.cache().with_coordinator(|c| {
            self.running
                .iter()
                .filter_map(|r| {
                    let t = c.table(r.seq.id()?).ok()?;
                    Some(Strip {
                        request: r.admitted,
                        tokens: r.seq.len(),
                        entries: t.entries().iter().map(letter).collect(),
                    })
                })
                .collect()
        })
    }
}
