//! Criterion entry point: one group per topic in `benchmarks/`.
//!
//! `cargo bench -p kvforge-bench` (or `cargo xtask bench`, which also writes
//! a Markdown summary). Names carry the backend (`cpu_`) as candle's do.
#![allow(missing_docs, clippy::unwrap_used)]

mod benchmarks;

criterion::criterion_main!(
    benchmarks::pool::benches,
    benchmarks::hashing::benches,
    benchmarks::matching::benches,
    benchmarks::events::benches,
    benchmarks::quant::benches,
    benchmarks::lsh::benches,
    benchmarks::evict::benches,
    benchmarks::attention::benches,
    benchmarks::qmatmul::benches
);
