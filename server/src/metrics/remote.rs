//! The remote tier's series: lookups, hits, misses, errors by kind, bytes,
//! and the latency histograms of its lookups and batched writes.

use kvforge_engine::metrics::{Exposition, label};
use kvforge_remote::{Histogram, RemoteStats};

use super::{Series, n};

/// The remote tier's counters, then its errors by kind.
pub(super) const SERIES: &[Series<RemoteStats>] = &[
    (
        "remote_lookups_total",
        "Remote lookup rounds (one per prompt that asked).",
        |r| n(r.lookups),
    ),
    (
        "remote_lookups_skipped_total",
        "Lookups skipped in the back-off after a timeout or a lost connection (each a miss).",
        |r| n(r.lookups_skipped),
    ),
    (
        "remote_lookup_blocks_total",
        "Blocks asked of the remote tier.",
        |r| n(r.lookup_blocks),
    ),
    (
        "remote_hit_blocks_total",
        "Blocks found there and verified.",
        |r| n(r.hit_blocks),
    ),
    (
        "remote_hit_tokens_total",
        "Tokens those blocks hold (fewer are imported when the local cache gained some meanwhile).",
        |r| n(r.hit_tokens),
    ),
    (
        "remote_miss_blocks_total",
        "Blocks asked for and not used.",
        |r| n(r.miss_blocks),
    ),
    (
        "remote_invalid_blocks_total",
        "Values found that failed verification (forged, corrupt, truncated, foreign).",
        |r| n(r.invalid_blocks),
    ),
    (
        "remote_put_blocks_total",
        "Blocks written to the remote tier.",
        |r| n(r.put_blocks),
    ),
    (
        "remote_put_existing_total",
        "Blocks the remote tier already held.",
        |r| n(r.put_existing),
    ),
    (
        "remote_put_dropped_total",
        "Blocks not written: the write-behind queue was full.",
        |r| n(r.put_dropped),
    ),
    (
        "remote_put_failed_total",
        "Blocks whose write failed: an error of the store, a key it refused (out of memory), or no connection.",
        |r| n(r.put_failed),
    ),
    (
        "remote_put_unconfirmed_total",
        "Blocks whose write got no answer in time (they may have landed).",
        |r| n(r.put_unconfirmed),
    ),
    (
        "remote_renewed_blocks_total",
        "Verified blocks whose expiry a lookup renewed.",
        |r| n(r.renewed_blocks),
    ),
    (
        "remote_removed_invalid_total",
        "Invalid values deleted from the remote tier (to be written again).",
        |r| n(r.removed_invalid),
    ),
    (
        "remote_store_resets_total",
        "Times the store was found to have forgotten everything (its blocks offered again).",
        |r| n(r.store_resets),
    ),
    (
        "remote_bytes_in_total",
        "Bytes read from the remote tier.",
        |r| n(r.bytes_in),
    ),
    (
        "remote_bytes_out_total",
        "Bytes written to the remote tier.",
        |r| n(r.bytes_out),
    ),
    (
        "remote_errors_total",
        "Remote calls that failed, by kind (each a miss).",
        |r| {
            [
                ("timeout", r.errors_timeout),
                ("connection", r.errors_connection),
                ("store", r.errors_store),
            ]
            .iter()
            .map(|(k, v)| (label("kind", k), *v as f64))
            .collect()
        },
    ),
];

/// A latency histogram of the remote tier (microseconds counted,
/// seconds written; the last count is above every bound).
pub(super) fn histogram(out: &mut Exposition, h: &Histogram, name: &str, help: &str) {
    let bounds = h.bounds_us.iter().map(|&b| b as f64 / 1e6);
    let count: u64 = h.counts.iter().sum();
    out.histogram(
        name,
        help,
        bounds.zip(h.counts.iter().copied()),
        count,
        h.sum_us as f64 / 1e6,
    );
}
