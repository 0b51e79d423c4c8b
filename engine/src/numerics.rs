//! Float comparisons between two computation orders, for tests.
//!
//! Two ways of computing the same thing (fused against reference
//! attention, a batch against one sequence at a time, a cached prefix
//! against a recompute) agree only within rounding, and how much rounding
//! depends on the kernels libtorch and MKL pick for the CPU at hand
//! (`ATEN_CPU_CAPABILITY`, `MKL_CBWR`). A test states its bound and passes
//! its measured error through [`within`]: besides the comparison, the error
//! is recorded (when [`LOG_ENV`] names a file), so that `cargo xtask
//! numerics` can run those tests under every kernel setting the machine
//! offers and show each bound's margin — failing when an error comes
//! within a quarter of its bound, long before another CPU's kernels would
//! make it fail outright.
//!
//! A lossy comparison — quantized KV against full precision — is
//! different: its error is the quantizer's, far above kernel noise, and its
//! bound a claim about quality, not rounding. [`within_loss`] records it
//! too; `cargo xtask numerics` checks that the kernels move it by less than
//! a quarter of the room left under its bound.
//!
//! A record names the test by the thread it runs on (libtest names each
//! test's thread after the test), then `what` (the case within it).

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

/// The environment variable naming the file records are appended to.
pub const LOG_ENV: &str = "KVFORGE_NUMERICS_LOG";

/// Whether `err` — two computation orders of the same arithmetic apart —
/// is within `bound` (NaN is not); records the comparison as
/// `test<TAB>what<TAB>err<TAB>bound<TAB>order`, once per new largest error
/// of that test and case in this process.
pub fn within(what: &str, err: f64, bound: f64) -> bool {
    record(what, err, bound, "order");
    err <= bound
}

/// [`within`] for a lossy path against an exact one (kind `loss`).
pub fn within_loss(what: &str, err: f64, bound: f64) -> bool {
    record(what, err, bound, "loss");
    err <= bound
}

fn record(what: &str, err: f64, bound: f64, kind: &str) {
    let Some(path) = std::env::var_os(LOG_ENV) else {
        return;
    };
    static WORST: OnceLock<Mutex<HashMap<(String, String), f64>>> = OnceLock::new();
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string();
    let err = if err.is_nan() { f64::INFINITY } else { err };
    let mut worst = WORST
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let seen = worst
        .entry((test.clone(), what.to_string()))
        .or_insert(-1.0);
    if err <= *seen {
        return;
    }
    *seen = err;
    let clean = |s: &str| s.replace(['\t', '\n'], " ");
    let line = format!(
        "{}\t{}\t{err:e}\t{bound:e}\t{kind}\n",
        clean(&test),
        clean(what)
    );
    // One short line per write, appended: concurrent tests do not interleave.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}
