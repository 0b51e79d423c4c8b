//! The time the tier's decisions read (house rule 3: injected, never
//! `Instant::now()` in the logic): how long a key stays remembered as
//! stored, and how long lookups back off after a timeout. A test drives a
//! [`ManualClock`] instead of sleeping. The write-behind thread's own
//! waits (its batches, its marker probe, `flush`'s timeout) and the
//! latency histograms are real time: a thread blocked on a condition
//! variable wakes on the system's clock.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A source of the current instant.
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to ([`advance`](Self::advance)).
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    offset: Mutex<Duration>,
}

impl ManualClock {
    /// A clock standing at the instant it was made.
    pub fn new() -> Self {
        ManualClock {
            start: Instant::now(),
            offset: Mutex::new(Duration::ZERO),
        }
    }

    /// Moves the clock on by `by`.
    pub fn advance(&self, by: Duration) {
        let mut o = self.offset.lock().unwrap_or_else(|e| e.into_inner());
        *o = o.saturating_add(by);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + *self.offset.lock().unwrap_or_else(|e| e.into_inner())
    }
}
