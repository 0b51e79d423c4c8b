//! Counters of a [`RemoteCache`](crate::RemoteCache): lookups, hits,
//! misses, errors by kind, bytes, latency histograms.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::ErrorKind;

/// Upper bounds of the latency buckets, microseconds (a last bucket holds
/// the rest).
pub(crate) const LATENCY_BOUNDS_US: [u64; 12] = [
    250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
];

/// A latency histogram: `counts[i]` calls took at most `bounds_us[i]`
/// (and more than the bound before); the last count is the rest.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Histogram {
    /// Bucket upper bounds, microseconds.
    pub bounds_us: Vec<u64>,
    /// Calls per bucket (one more than `bounds_us`).
    pub counts: Vec<u64>,
    /// Sum of all latencies, microseconds.
    pub sum_us: u64,
}

/// A reading of a [`RemoteCache`](crate::RemoteCache)'s counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RemoteStats {
    /// Lookup rounds (one per prompt that asked the store).
    pub lookups: u64,
    /// Lookups skipped in the back-off after a timeout or a lost
    /// connection (each a miss).
    pub lookups_skipped: u64,
    /// Blocks asked for.
    pub lookup_blocks: u64,
    /// Blocks found and verified (handed to the engine).
    pub hit_blocks: u64,
    /// Tokens those blocks hold.
    pub hit_tokens: u64,
    /// Blocks asked for and not used: absent, or after the first block
    /// that was absent or invalid.
    pub miss_blocks: u64,
    /// Values found that failed verification (corrupt, truncated, foreign).
    pub invalid_blocks: u64,
    /// Calls that timed out.
    pub errors_timeout: u64,
    /// Calls that found no connection.
    pub errors_connection: u64,
    /// Calls the store answered with an error.
    pub errors_store: u64,
    /// Blocks written (new keys).
    pub put_blocks: u64,
    /// Blocks the store already held.
    pub put_existing: u64,
    /// Blocks not written because the write-behind queue was full.
    pub put_dropped: u64,
    /// Blocks whose write failed: the store answered an error for the
    /// batch or refused the key (out of memory), or no connection.
    pub put_failed: u64,
    /// Blocks whose write got no answer within the deadline: they may
    /// have landed (offered again later; set-if-absent keeps one value).
    pub put_unconfirmed: u64,
    /// Verified blocks whose expiry was renewed after a lookup.
    pub renewed_blocks: u64,
    /// Invalid values deleted from the store (so they can be written
    /// again).
    pub removed_invalid: u64,
    /// Times the store was found to have forgotten everything (flushed,
    /// restarted, or a connection lost): every block held locally is
    /// offered again.
    pub store_resets: u64,
    /// Bytes read from the store.
    pub bytes_in: u64,
    /// Bytes written to the store.
    pub bytes_out: u64,
    /// Latency of lookups.
    pub get_latency: Histogram,
    /// Latency of batched writes.
    pub put_latency: Histogram,
}

impl Histogram {
    /// Adds `other`'s calls (the same bounds, or none yet).
    pub fn add(&mut self, other: &Histogram) {
        if self.counts.is_empty() {
            *self = other.clone();
            return;
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_us += other.sum_us;
    }
}

impl RemoteStats {
    /// Adds `other`'s counts (two caches of one engine, read as one).
    pub fn add(&mut self, o: &RemoteStats) {
        self.lookups += o.lookups;
        self.lookups_skipped += o.lookups_skipped;
        self.lookup_blocks += o.lookup_blocks;
        self.hit_blocks += o.hit_blocks;
        self.hit_tokens += o.hit_tokens;
        self.miss_blocks += o.miss_blocks;
        self.invalid_blocks += o.invalid_blocks;
        self.errors_timeout += o.errors_timeout;
        self.errors_connection += o.errors_connection;
        self.errors_store += o.errors_store;
        self.put_blocks += o.put_blocks;
        self.put_existing += o.put_existing;
        self.put_dropped += o.put_dropped;
        self.put_failed += o.put_failed;
        self.put_unconfirmed += o.put_unconfirmed;
        self.renewed_blocks += o.renewed_blocks;
        self.removed_invalid += o.removed_invalid;
        self.store_resets += o.store_resets;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.get_latency.add(&o.get_latency);
        self.put_latency.add(&o.put_latency);
    }
}

#[derive(Default)]
pub(crate) struct AtomicHistogram {
    counts: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

impl AtomicHistogram {
    pub(crate) fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    fn read(&self) -> Histogram {
        Histogram {
            bounds_us: LATENCY_BOUNDS_US.to_vec(),
            counts: self.counts.iter().map(|c| c.load(Relaxed)).collect(),
            sum_us: self.sum_us.load(Relaxed),
        }
    }
}

/// The live counters, shared by the cache and its writer thread.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) lookups: AtomicU64,
    pub(crate) lookups_skipped: AtomicU64,
    pub(crate) lookup_blocks: AtomicU64,
    pub(crate) hit_blocks: AtomicU64,
    pub(crate) hit_tokens: AtomicU64,
    pub(crate) miss_blocks: AtomicU64,
    pub(crate) invalid_blocks: AtomicU64,
    errors: [AtomicU64; 3],
    pub(crate) put_blocks: AtomicU64,
    pub(crate) put_existing: AtomicU64,
    pub(crate) put_dropped: AtomicU64,
    pub(crate) put_failed: AtomicU64,
    pub(crate) put_unconfirmed: AtomicU64,
    pub(crate) renewed_blocks: AtomicU64,
    pub(crate) removed_invalid: AtomicU64,
    pub(crate) store_resets: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) get_latency: AtomicHistogram,
    pub(crate) put_latency: AtomicHistogram,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn error(&self, kind: ErrorKind) {
        let i = match kind {
            ErrorKind::Timeout => 0,
            ErrorKind::Connection => 1,
            ErrorKind::Store => 2,
        };
        self.errors[i].fetch_add(1, Relaxed);
    }

    pub(crate) fn read(&self) -> RemoteStats {
        let l = |c: &AtomicU64| c.load(Relaxed);
        RemoteStats {
            lookups: l(&self.lookups),
            lookups_skipped: l(&self.lookups_skipped),
            lookup_blocks: l(&self.lookup_blocks),
            hit_blocks: l(&self.hit_blocks),
            hit_tokens: l(&self.hit_tokens),
            miss_blocks: l(&self.miss_blocks),
            invalid_blocks: l(&self.invalid_blocks),
            errors_timeout: l(&self.errors[0]),
            errors_connection: l(&self.errors[1]),
            errors_store: l(&self.errors[2]),
            put_blocks: l(&self.put_blocks),
            put_existing: l(&self.put_existing),
            put_dropped: l(&self.put_dropped),
            put_failed: l(&self.put_failed),
            put_unconfirmed: l(&self.put_unconfirmed),
            renewed_blocks: l(&self.renewed_blocks),
            removed_invalid: l(&self.removed_invalid),
            store_resets: l(&self.store_resets),
            bytes_in: l(&self.bytes_in),
            bytes_out: l(&self.bytes_out),
            get_latency: self.get_latency.read(),
            put_latency: self.put_latency.read(),
        }
    }
}

/// The live counters of one or more caches, readable from any thread at
/// any time (a metrics endpoint reads them when scraped, not when the
/// engine last published).
#[derive(Clone, Default)]
pub struct StatsSource(pub(crate) Vec<Arc<Counters>>);

impl StatsSource {
    /// The counters now, summed over the caches.
    pub fn read(&self) -> RemoteStats {
        let mut st = RemoteStats::default();
        for c in &self.0 {
            st.add(&c.read());
        }
        st
    }

    /// Both caches' counters as one.
    pub fn join(mut self, other: StatsSource) -> Self {
        self.0.extend(other.0);
        self
    }
}
