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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, say, setup};

/// Tests that compare floats but take long (seconds of real-model work or
/// many turns): run under the baseline and one more setting, not all.
const SLOW: &[&str] = &[
    "manager::real_model_reuse_matches_a_full_recompute_within_rounding_over_16_turns",
    "manager::reuse_matches_recomputing_every_prompt_over_16_turns",
    "compose::real_model_reuse_with_a_cold_tier_gives_the_outputs_of_the_same_schedule",
    "batch::generate_batch_follows_generate_one_by_one",
    "real_model_matches_transformers_logits_greedy_and_tokens",
    "f16_weights_with_f32_compute_stay_close_to_transformers",
    "lifecycle::a_long_segment_is_summarised_by_the_real_model",
    "tests/test_hf.py::test_smollm2_int4_keeps_perplexity_within_one_percent",
];

/// The setting the slow tests run under besides the baseline: the farthest
/// from it (MKL's compatible code path, libtorch's scalar kernels).
const SLOW_SETTING: Setting = Setting {
    mkl: Some("COMPATIBLE"),
    aten: Some("default"),
};

/// One kernel setting: `MKL_CBWR` and `ATEN_CPU_CAPABILITY` (`None`: unset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Setting {
    mkl: Option<&'static str>,
    aten: Option<&'static str>,
}

impl Setting {
    fn name(&self) -> String {
        format!(
            "MKL_CBWR={} ATEN_CPU_CAPABILITY={}",
            self.mkl.unwrap_or("unset"),
            self.aten.unwrap_or("unset")
        )
    }

    fn file(&self) -> String {
        format!(
            "{}-{}.tsv",
            self.mkl.unwrap_or("unset"),
            self.aten.unwrap_or("unset")
        )
    }

    fn apply(&self, cmd: &mut Command) {
        for (var, v) in [("MKL_CBWR", self.mkl), ("ATEN_CPU_CAPABILITY", self.aten)] {
            match v {
                Some(v) => cmd.env(var, v),
                None => cmd.env_remove(var),
            };
        }
    }
}

const BASELINE: Setting = Setting {
    mkl: None,
    aten: None,
};

/// Every setting this CPU can run: `MKL_CBWR` ∈ {COMPATIBLE, AVX2, AVX512}
/// × `ATEN_CPU_CAPABILITY` ∈ {unset, default, avx2}, as far as the CPU has
/// the instructions (AArch64 has no MKL: libtorch's capability only).
fn settings() -> Vec<Setting> {
    let (avx2, avx512) = cpu();
    let mkl: Vec<Option<&'static str>> = if cfg!(target_arch = "x86_64") {
        let mut m = vec![None, Some("COMPATIBLE")];
        if avx2 {
            m.push(Some("AVX2"));
        }
        if avx512 {
            m.push(Some("AVX512"));
        }
        m
    } else {
        vec![None]
    };
    let mut aten = vec![None, Some("default")];
    if avx2 {
        aten.push(Some("avx2"));
    }
    let mut out = Vec::new();
    for &m in &mkl {
        for &a in &aten {
            out.push(Setting { mkl: m, aten: a });
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn cpu() -> (bool, bool) {
    (
        std::arch::is_x86_feature_detected!("avx2"),
        std::arch::is_x86_feature_detected!("avx512f"),
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu() -> (bool, bool) {
    (false, false)
}

/// One recorded comparison: the worst error of a (test, case) under a
/// setting, its bound, and whether it is lossy.
#[derive(Clone, Debug)]
struct Record {
    err: f64,
    bound: f64,
    loss: bool,
}

/// Recorded comparisons: (test, case) → the worst.
type Records = BTreeMap<(String, String), Record>;

/// The records of one log: (test, case) → worst.
fn read_log(path: &Path) -> Result<Records> {
    let mut out = Records::new();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    for (i, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split('\t').collect();
        let [test, what, err, bound, kind] = f[..] else {
            bail!(
                "{}:{}: not test, case, error, bound, kind",
                path.display(),
                i + 1
            );
        };
        let num = |s: &str| -> Result<f64> {
            s.parse()
                .with_context(|| format!("{}:{}: {s:?}", path.display(), i + 1))
        };
        let r = Record {
            err: num(err)?,
            bound: num(bound)?,
            loss: kind == "loss",
        };
        let e = out
            .entry((test.to_string(), what.to_string()))
            .or_insert(r.clone());
        if r.err > e.err {
            *e = r;
        }
    }
    Ok(out)
}

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
    let base_log = match base.engine {
        Some(p) => p.to_path_buf(),
        None => {
            let p = dir.join(BASELINE.file());
            say(&format!(
                "numerics: the engine's tests under {}",
                BASELINE.name()
            ));
            if !run(root, &bins, &[], BASELINE, &p)? {
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

/// Across settings: the worst and the least error of one (test, case).
struct Across {
    worst: f64,
    least: f64,
    bound: f64,
    loss: bool,
    under: Setting,
    settings: usize,
}

/// The markdown table of every (test, case): its bound, its worst error and
/// the setting it was met under, the margin (for a lossy one: the room
/// left under the bound against how far the kernels moved the error); and
/// the rows that fail the check.
fn table(all: &[(Setting, Records)]) -> (String, Vec<String>) {
    let mut rows: BTreeMap<&(String, String), Across> = BTreeMap::new();
    for (s, recs) in all {
        for (k, r) in recs {
            let e = rows.entry(k).or_insert(Across {
                worst: r.err,
                least: r.err,
                bound: r.bound,
                loss: r.loss,
                under: *s,
                settings: 0,
            });
            e.settings += 1;
            e.least = e.least.min(r.err);
            if r.err > e.worst {
                (e.worst, e.bound, e.under) = (r.err, r.bound, *s);
            }
        }
    }
    let mut out = String::from(
        "| test | case | kind | bound | worst error | under | settings | margin |\n|---|---|---|---:|---:|---|---:|---:|\n",
    );
    let mut over = Vec::new();
    for ((test, what), a) in &rows {
        let (margin, text) = if a.loss {
            // How many times the kernels' spread fits in the room left.
            let spread = a.worst - a.least;
            let m = (a.bound - a.worst) / spread.max(f64::MIN_POSITIVE);
            (
                m,
                format!("room {:.2e} / spread {spread:.1e}", a.bound - a.worst),
            )
        } else {
            let m = a.bound / a.worst.max(f64::MIN_POSITIVE);
            (m, String::new())
        };
        if margin < 4.0 {
            over.push(format!(
                "{test} [{what}]: {:.3e} of {:.1e} {text}",
                a.worst, a.bound
            ));
        }
        let shown = if a.worst == 0.0 && !a.loss {
            "exact".into()
        } else if margin > 1e6 {
            format!("> 10^6× {text}")
        } else {
            format!("{margin:.0}× {text}")
        };
        out.push_str(&format!(
            "| `{test}` | {what} | {} | {:.1e} | {:.2e} | {} | {} | {} |\n",
            if a.loss { "loss" } else { "order" },
            a.bound,
            a.worst,
            a.under.name(),
            a.settings,
            shown.trim_end()
        ));
    }
    (out, over)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recs(rows: &[(&str, f64, f64, bool)]) -> Records {
        rows.iter()
            .map(|&(t, err, bound, loss)| {
                (
                    (t.to_string(), "case".to_string()),
                    Record { err, bound, loss },
                )
            })
            .collect()
    }

    #[test]
    fn a_margin_under_four_or_a_lossy_error_the_kernels_move_fails() {
        let other = Setting {
            mkl: Some("AVX2"),
            aten: None,
        };
        let all = [
            (
                BASELINE,
                recs(&[
                    ("wide", 1e-6, 1e-4, false),
                    ("tight", 1e-5, 1e-4, false),
                    ("steady", 0.5, 1.0, true),
                    ("moved", 0.5, 1.0, true),
                ]),
            ),
            (
                other,
                recs(&[
                    ("wide", 2e-6, 1e-4, false),
                    ("tight", 3e-5, 1e-4, false),
                    ("steady", 0.5001, 1.0, true),
                    ("moved", 0.7, 1.0, true),
                ]),
            ),
        ];
        let (text, over) = table(&all);
        assert_eq!(over.len(), 2, "{over:?}");
        assert!(
            over[0].starts_with("moved") && over[1].starts_with("tight"),
            "{over:?}"
        );
        assert!(
            text.contains("| `wide` | case | order | 1.0e-4 | 2.00e-6 | MKL_CBWR=AVX2"),
            "{text}"
        );
    }

    #[test]
    fn logs_are_read_as_the_worst_per_case_and_bad_lines_refused() {
        let dir = std::env::temp_dir().join(format!("xtask-numerics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("log.tsv");
        std::fs::write(
            &p,
            "t\tc\t1e-6\t1e-4\torder\nt\tc\t3e-6\t1e-4\torder\nt\tc\t2e-6\t1e-4\torder\n",
        )
        .unwrap();
        let r = read_log(&p).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[&("t".into(), "c".into())].err, 3e-6);
        std::fs::write(&p, "t\tc\t1e-6\n").unwrap();
        assert!(read_log(&p).is_err());
        assert!(read_log(&dir.join("absent")).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
