//! `kvforge.ablate`: the ablation runner in the Python process, so that a
//! policy written in Python runs in it.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::errors::bad;
use crate::policy::{not_in_policy, take_interrupt};

/// `kvforge.ablate`: `cargo xtask ablate`'s runner on `config`, in this
/// process; the output folder and how many items failed.
#[pyfunction]
#[pyo3(signature = (config, out = None, resume = false, progress = false, root = None))]
pub(crate) fn ablate(
    py: Python<'_>,
    config: PathBuf,
    out: Option<PathBuf>,
    resume: bool,
    progress: bool,
    root: Option<PathBuf>,
) -> PyResult<(PathBuf, usize, usize)> {
    not_in_policy()?;
    let opts = kvforge_ablate::run::Options {
        config,
        out,
        resume,
        progress,
        root: root.unwrap_or_else(|| PathBuf::from(".")),
        registry: crate::resolve::with_python(kvforge_ablate::registry()),
    };
    let done = py
        .detach(|| kvforge_ablate::run::run(&opts))
        .map_err(|e| take_interrupt().unwrap_or_else(|| bad(format!("{e:#}"))))?;
    if let Some(interrupt) = take_interrupt() {
        return Err(interrupt);
    }
    Ok((done.out, done.measured, done.failed))
}
