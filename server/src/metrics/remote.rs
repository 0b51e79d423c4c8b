//! The remote tier's series: lookups, hits, misses, errors by kind, bytes,
//! and the latency histograms of its lookups and batched writes.

use std::fmt::Write;

use kvforge_remote::{Histogram, RemoteStats};

use super::{Series, c};

/// The remote tier's counters: name, help, reading.
type Counter = (&'static str, &'static str, fn(&RemoteStats) -> u64);

const COUNTERS: &[Counter] = &[
    (
        "remote_lookups_total",
        "Remote lookup rounds (one per prompt that asked).",
        |r| r.lookups,
    ),
    (
        "remote_lookups_skipped_total",
        "Lookups skipped in the back-off after a timeout or a lost connection (each a miss).",
        |r| r.lookups_skipped,
    ),
    (
        "remote_lookup_blocks_total",
        "Blocks asked of the remote tier.",
        |r| r.lookup_blocks,
    ),
    (
        "remote_hit_blocks_total",
        "Blocks found there and verified.",
        |r| r.hit_blocks,
    ),
    (
        "remote_hit_tokens_total",
        "Tokens those blocks hold (not recomputed).",
        |r| r.hit_tokens,
    ),
    (
        "remote_miss_blocks_total",
        "Blocks asked for and not used.",
        |r| r.miss_blocks,
    ),
    (
        "remote_invalid_blocks_total",
        "Values found that failed verification (forged, corrupt, truncated, foreign).",
        |r| r.invalid_blocks,
    ),
    (
        "remote_put_blocks_total",
        "Blocks written to the remote tier.",
        |r| r.put_blocks,
    ),
    (
        "remote_put_existing_total",
        "Blocks the remote tier already held.",
        |r| r.put_existing,
    ),
    (
        "remote_put_dropped_total",
        "Blocks not written: the write-behind queue was full.",
        |r| r.put_dropped,
    ),
    (
        "remote_put_failed_total",
        "Blocks whose write failed: an error of the store, a key it refused (out of memory), or no connection.",
        |r| r.put_failed,
    ),
    (
        "remote_put_unconfirmed_total",
        "Blocks whose write got no answer in time (they may have landed).",
        |r| r.put_unconfirmed,
    ),
    (
        "remote_renewed_blocks_total",
        "Verified blocks whose expiry a lookup renewed.",
        |r| r.renewed_blocks,
    ),
    (
        "remote_removed_invalid_total",
        "Invalid values deleted from the remote tier (to be written again).",
        |r| r.removed_invalid,
    ),
    (
        "remote_store_resets_total",
        "Times the store was found to have forgotten everything (its blocks offered again).",
        |r| r.store_resets,
    ),
    (
        "remote_bytes_in_total",
        "Bytes read from the remote tier.",
        |r| r.bytes_in,
    ),
    (
        "remote_bytes_out_total",
        "Bytes written to the remote tier.",
        |r| r.bytes_out,
    ),
];

/// The remote tier's counters as series.
pub(super) fn series<'a>(r: &RemoteStats) -> Vec<Series<'a>> {
    let errors = [
        ("timeout", r.errors_timeout),
        ("connection", r.errors_connection),
        ("store", r.errors_store),
    ]
    .iter()
    .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), *v as f64))
    .collect();
    let mut out: Vec<Series<'a>> = COUNTERS
        .iter()
        .map(|(name, help, read)| (*name, *help, "counter", c(read(r))))
        .collect();
    out.push((
        "remote_errors_total",
        "Remote calls that failed, by kind (each a miss).",
        "counter",
        errors,
    ));
    out
}

/// A latency histogram of the remote tier in Prometheus' text format
/// (seconds, cumulative buckets).
pub(super) fn render_histogram(out: &mut String, h: &Histogram, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut acc = 0;
    for (b, n) in h.bounds_us.iter().zip(&h.counts) {
        acc += n;
        let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {acc}", *b as f64 / 1e6);
    }
    let count: u64 = h.counts.iter().sum();
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum {}", h.sum_us as f64 / 1e6);
    let _ = writeln!(out, "{name}_count {count}");
}
