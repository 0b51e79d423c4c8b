//! `cargo xtask numerics`: the float comparisons between two computation
//! paths in the engine's tests and the Python package's, under every kernel
//! setting this machine offers.
//!
//! libtorch picks its vectorized kernels by `ATEN_CPU_CAPABILITY` and MKL
//! its sgemm code path by CPU vendor and ISA (`MKL_CBWR`), so a bound
//! measured on one CPU can fail on another. Every such comparison goes
//! through `kvforge_engine::numerics::within` (or the pytest suite's
//! `within`), which records the measured error beside its bound when
//! `KVFORGE_NUMERICS_LOG` names a file. This command runs the engine's
//! tests once as they are (the baseline, which also says which tests
//! compare floats) and the pytest tests marked `numerics`, then those again
//! under every other setting — the slow ones (real-model work, many turns)
//! under one more only — and fails when a test fails under some setting,
//! when the error of two computation orders exceeds a quarter of its bound
//! (a margin under 4), or when the kernels move a lossy comparison's error
//! (quantized against full precision) by more than a quarter of the room
//! left under its bound. It writes the table (test, case, bound, worst
//! error, where, margin) to `target/numerics/table.md`.

mod settings;
mod table;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, say, setup};
use settings::{BASELINE, SLOW, SLOW_SETTING, Setting, settings};
use table::{Records, read_log, table};

/// The engine's test executables (its library's unit tests and its
/// integration tests), built.
fn test_binaries(root: &Path) -> Result<Vec<PathBuf>> {
    let out = cargo()
        .current_dir(root)
        .args([
            "test",
            "-p",
            "kvforge-engine",
            "--no-run",
            "--message-format=json",
        ])
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!(
            "building the engine's tests failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let test = v["profile"]["test"].as_bool() == Some(true);
        if let (true, Some(exe)) = (test, v["executable"].as_str()) {
            bins.push(PathBuf::from(exe));
        }
    }
    if bins.is_empty() {
        bail!("no test executables of kvforge-engine found");
    }
    Ok(bins)
}

/// Runs `tests` (every test when empty) of every binary under `setting`,
/// logging to `log`; whether they all passed.
fn run(
    root: &Path,
    bins: &[PathBuf],
    tests: &[&str],
    setting: Setting,
    log: &Path,
) -> Result<bool> {
    let _ = std::fs::remove_file(log);
    let mut ok = true;
    for bin in bins {
        let mut cmd = Command::new(bin);
        cmd.current_dir(root.join("engine"))
            .env("KVFORGE_NUMERICS_LOG", log)
            .args(["--test-threads", "2", "-q"]);
        if !tests.is_empty() {
            cmd.arg("--exact").args(tests);
        }
        setting.apply(&mut cmd);
        let status = cmd
            .status()
            .with_context(|| format!("running {}", bin.display()))?;
        ok &= status.success();
    }
    Ok(ok)
}

/// The pytest command of the Python package's tests, as CI runs them.
pub(crate) fn pytest(root: &Path, python: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.current_dir(root)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("KVFORGE_REQUIRE_ALL", "1")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"]);
    cmd
}

/// Runs the pytest tests marked `numerics` (but `skip`) under `setting`,
/// logging to `log`; whether they passed.
fn run_python(
    root: &Path,
    python: &Path,
    skip: &[&str],
    setting: Setting,
    log: &Path,
) -> Result<bool> {
    let _ = std::fs::remove_file(log);
    let mut cmd = pytest(root, python);
    cmd.env("KVFORGE_NUMERICS_LOG", log)
        .args(["-m", "numerics", "python/tests"]);
    for s in skip {
        cmd.args(["--deselect", s]);
    }
    setting.apply(&mut cmd);
    Ok(cmd.status().context("running pytest")?.success())
}

/// What a run starts from: the logs of the engine suite and of the Python
/// package's numerics tests as they are (CI's test steps write them).
pub(crate) struct Baselines<'a> {
    pub(crate) engine: Option<&'a Path>,
    pub(crate) python: Option<&'a Path>,
}

/// `cargo xtask numerics`: from `base`'s logs, or after runs that write
/// them.
pub(crate) fn numerics(root: &Path, env: &setup::Env, base: Baselines) -> Result<()> {
    let dir = root.join("target/numerics");
    std::fs::create_dir_all(&dir)?;
    let bins = test_binaries(root)?;
    let (base_log, py_log) = baseline_logs(root, env, &base, &dir, &bins)?;
    let mut base = read_log(&base_log)?;
    if base.is_empty() {
        bail!("numerics: {} records nothing", base_log.display());
    }
    let py_base = read_log(&py_log)?;
    let slow_py: Vec<&str> = SLOW
        .iter()
        .copied()
        .filter(|t| t.contains(".py::"))
        .collect();
    let mut tests: Vec<String> = base.keys().map(|(t, _)| t.clone()).collect();
    tests.dedup();
    if let Some(t) = tests
        .iter()
        .find(|t| matches!(t.as_str(), "unnamed" | "main"))
    {
        bail!("numerics: a comparison ran outside a test's own thread ({t})");
    }
    let slow: Vec<&str> = tests
        .iter()
        .map(String::as_str)
        .filter(|t| SLOW.contains(t))
        .collect();
    let fast: Vec<&str> = tests
        .iter()
        .map(String::as_str)
        .filter(|t| !SLOW.contains(t))
        .collect();
    base.extend(py_base);
    let mut all: Vec<(Setting, Records)> = vec![(BASELINE, base)];
    let mut failed = Vec::new();
    for s in settings().into_iter().filter(|s| *s != BASELINE) {
        let mut which = fast.clone();
        if s == SLOW_SETTING {
            which.extend(&slow);
        }
        say(&format!(
            "numerics: {} engine tests and Python's under {}",
            which.len(),
            s.name()
        ));
        let log = dir.join(s.file());
        if !run(root, &bins, &which, s, &log)? {
            failed.push(s.name());
        }
        let mut recs = read_log(&log)?;
        let py = dir.join(format!("python-{}", s.file()));
        let skip: &[&str] = if s == SLOW_SETTING { &[] } else { &slow_py };
        if !run_python(root, &env.python, skip, s, &py)? {
            failed.push(format!("{} (pytest)", s.name()));
        }
        recs.extend(read_log(&py)?);
        all.push((s, recs));
    }
    let (table, over) = table(&all);
    std::fs::write(dir.join("table.md"), &table)?;
    say(&table);
    if !failed.is_empty() {
        bail!("numerics: tests failed under {}", failed.join("; "));
    }
    if !over.is_empty() {
        bail!(
            "numerics: errors above a quarter of their bounds (a margin under 4): {}",
            over.join("; ")
        );
    }
    say(&format!(
        "numerics: {} comparisons in {} tests under {} settings, every error under a quarter of its bound",
        all[0].1.len(),
        tests.len(),
        all.len()
    ));
    Ok(())
}

/// The baseline logs of the engine's tests and the Python package's: the
/// ones `base` names, or those of runs under [`BASELINE`] now.
fn baseline_logs(
    root: &Path,
    env: &setup::Env,
    base: &Baselines,
    dir: &Path,
    bins: &[PathBuf],
) -> Result<(PathBuf, PathBuf)> {
    let base_log = match base.engine {
        Some(p) => p.to_path_buf(),
        None => {
            let p = dir.join(BASELINE.file());
            say(&format!(
                "numerics: the engine's tests under {}",
                BASELINE.name()
            ));
            if !run(root, bins, &[], BASELINE, &p)? {
                bail!("numerics: the engine's tests fail as they are");
            }
            p
        }
    };
    let py_log = match base.python {
        Some(p) => p.to_path_buf(),
        None => {
            let p = dir.join(format!("python-{}", BASELINE.file()));
            say("numerics: the Python package's numerics tests as they are");
            if !run_python(root, &env.python, &[], BASELINE, &p)? {
                bail!("numerics: the Python package's numerics tests fail as they are");
            }
            p
        }
    };
    Ok((base_log, py_log))
}
