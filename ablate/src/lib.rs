//! The ablation harness of kvforge (`cargo xtask ablate`, and `ablate()`
//! in the Python package): every mechanism on and off on a real model,
//! one report.
//!
//! * [`config`]: the experiment file (TOML): model, workloads, matrix.
//! * [`run`]: each configuration on each workload, item
//!   by item, resumable.
//! * [`report`]: `report.md`, `results.csv`, `turns.csv`, PNGs.
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
pub mod inputs;
pub mod intervals;
pub mod iso;
pub mod output;
pub mod plot;
pub mod record;
pub mod report;
pub mod stats;
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
pub mod strided;
