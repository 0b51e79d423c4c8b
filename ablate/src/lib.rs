//! The ablation harness of kvforge (`cargo xtask ablate`, and `ablate()`
//! in the Python package): every mechanism on and off on a real model,
//! one report.
//!
//! * [`config`]: the experiment file (TOML): model, [`workloads`], matrix.
//! * [`run`]: each configuration on each workload, item by item,
//!   resumable; `start` is what it does before the first item (inputs
//!   present, model loaded, what a resume keeps), [`items`] builds the
//!   workloads' items and their inputs (chats, streams, pass-key prompts),
//!   `export` writes them out, `runner` measures one item on one
//!   configuration's engine.
//! * [`report`]: `report.md`, `results.csv`, `turns.csv`, PNGs; `tables`
//!   its per-workload tables and CSV files, `numbers` how it aggregates
//!   and prints values.
//! * [`intervals`], [`stats`]: quality with 95% intervals (Wilson, paired
//!   bootstrap against the baseline), `intervals.csv`.
//! * [`iso`]: quality at equal memory — KV share against the baseline item
//!   by item, `iso.csv`, the headline plot.
//! * [`target`]: `target_kv`, a configuration sized to a share of the full
//!   cache's KV on each item.
//! * [`strided`]: the worked example of adding an eviction policy.
//! * [`record`]: one measured item; [`output`]: the output folder, CSV
//!   files, provenance; [`plot`]: the PNGs; [`inputs`]: data files read
//!   with a bound, chats, articles, a seeded generator.

pub mod config;
mod export;
pub mod inputs;
pub mod intervals;
pub mod iso;
pub mod items;
mod numbers;
pub mod output;
pub mod plot;
pub mod record;
pub mod report;
pub mod stats;
mod tables;
pub mod target;

/// The eviction policies experiment files can name: kvforge's own, and
/// the README's worked example.
pub fn registry() -> kvforge_engine::Registry {
    kvforge_engine::Registry::builtin().with_eviction("strided", strided::build)
}

/// The dtype every configuration stores its hot KV in (the engine's
/// default; [`run`] sets it explicitly, the report names it).
pub const HOT_KV: &str = "f16";
pub mod run;
mod runner;
mod start;
pub mod strided;
pub mod workloads;
