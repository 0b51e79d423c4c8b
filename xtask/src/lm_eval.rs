//! `cargo xtask lm-eval [QUESTIONS]`: lm-evaluation-harness against
//! `kvforge serve` and against transformers on the same GGUF
//! (`scripts/lm_eval_compare.py`), in a venv of its own.
//!
//! The harness pins versions of `datasets`, `httpx` and others that the
//! project's `.venv` must not take (its `openai` client and transformers
//! are tested as they are), so it lives in `.venv-lmeval`, which reads
//! `.venv`'s packages (torch, transformers, gguf) through a `.pth` file
//! and installs only what the harness adds. Idempotent: a venv whose
//! `lm_eval` imports at the pinned version is kept.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{say, setup, step};

/// The harness, and the versions of what it would otherwise upgrade
/// beyond what the project's transformers takes.
const PACKAGES: &[&str] = &[
    "lm-eval[api]==0.4.13",
    "transformers==4.57.6",
    "huggingface_hub<1.0",
];

const PURELIB: &str = "import sysconfig; print(sysconfig.get_paths()['purelib'])";

/// `.venv-lmeval`'s python, the venv made and the harness installed when
/// they are not.
fn harness_venv(root: &Path) -> Result<PathBuf> {
    let venv = root.join(".venv-lmeval");
    let py = venv.join("bin/python");
    let ready = "import importlib.metadata as m, tenacity; assert m.version('lm_eval') == '0.4.13'";
    if py.exists() && crate::python_says(&py, ready).is_ok() {
        return Ok(py);
    }
    let base = root.join(".venv/bin/python");
    if !py.exists() {
        say("lm-eval: creating .venv-lmeval");
        let mut venv_cmd = Command::new(&base);
        venv_cmd
            .current_dir(root)
            .args(["-m", "venv", ".venv-lmeval"]);
        step("python -m venv .venv-lmeval", venv_cmd)?;
    }
    // The project's packages, read through a .pth file (after the
    // harness venv's own, which shadow them).
    let theirs = crate::python_says(&base, PURELIB)?;
    let ours = PathBuf::from(crate::python_says(&py, PURELIB)?);
    std::fs::write(ours.join("kvforge-venv.pth"), format!("{theirs}\n"))
        .with_context(|| format!("writing {}", ours.display()))?;
    let mut pip = crate::pip_install(&py);
    pip.args(PACKAGES);
    step(&format!("pip install {}", PACKAGES.join(" ")), pip)?;
    Ok(py)
}

/// The command: `questions` items (default 300), results into
/// `docs/results/lm-eval/`.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let questions: usize = match args {
        [] => 300,
        [n] => n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("{n:?} is not a number of questions above 0"))?,
        _ => bail!("usage: cargo xtask lm-eval [QUESTIONS]"),
    };
    setup::setup(root, false)?;
    crate::build_release(root, &["-p", "kvforge-server", "--bin", "kvforge-serve"])?;
    compare(
        root,
        questions,
        &root.join("target/release/kvforge-serve"),
        &root.join("docs/results/lm-eval"),
    )
}

/// CI's version: 10 questions through the tests' (debug) server binary,
/// results under `target/`; fails when the two accuracies differ by more
/// than two standard errors.
pub(crate) fn ci(root: &Path) -> Result<()> {
    compare(
        root,
        10,
        &root.join("target/debug/kvforge-serve"),
        &root.join("target/lm-eval/ci"),
    )
}

/// The harness on `questions` questions against `serve` and transformers;
/// the comparison into `out`.
fn compare(root: &Path, questions: usize, serve: &Path, out: &Path) -> Result<()> {
    let py = harness_venv(root)?;
    let work = root.join("target/lm-eval/work");
    let _ = std::fs::remove_dir_all(&work);
    let mut cmd = Command::new(py);
    cmd.current_dir(root)
        .arg("scripts/lm_eval_compare.py")
        .arg("--serve")
        .arg(serve)
        .arg("--model")
        .arg(root.join("models").join(setup::MODEL_FILE))
        .arg("--essays")
        .arg(root.join("data/PaulGrahamEssays"))
        .args(["--limit", &questions.to_string()])
        .arg("--work")
        .arg(&work)
        .arg("--out")
        .arg(out);
    step("scripts/lm_eval_compare.py", cmd)
}
