//! Benchmark groups.

pub(crate) mod attention;
pub(crate) mod events;
pub(crate) mod evict;
pub(crate) mod hashing;
pub(crate) mod lsh;
pub(crate) mod matching;
pub(crate) mod pool;
pub(crate) mod qmatmul;
pub(crate) mod quant;

use std::time::Duration;

/// Shorter than criterion's defaults so the whole suite runs in a few minutes
/// on a 2-core machine; still enough samples for stable medians.
pub(crate) fn config() -> criterion::Criterion {
    criterion::Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}
