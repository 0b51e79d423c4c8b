//! The project's checks: `ci`, the coordinator's model test, the AArch64
//! cross test, the fuzzers, and the prepared GPU run.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, numerics, prepend_path, say, setup, step};

/// The coordinator's randomized model-based test (`engine/coordinator/
/// tests/model.rs`) at `cases` cases, in release: no setup needed (pure
/// Rust). CI runs 1,500 of them on every test run.
pub(crate) fn model_check(root: &Path, cases: u64) -> Result<()> {
    let mut t = cargo();
    t.current_dir(root)
        .env("KVFORGE_MODEL_CASES", cases.to_string())
        .env(
            "KVFORGE_MODEL_THREAD_ROUNDS",
            (cases / 100).max(20).to_string(),
        )
        .args([
            "test",
            "--release",
            "-p",
            "kvforge-coordinator",
            "--test",
            "tests",
            "model::",
            "--",
            "--nocapture",
            "--test-threads",
            "1",
        ]);
    step(&format!("coordinator model, {cases} cases"), t)
}

pub(crate) fn ci(root: &Path) -> Result<()> {
    // A fresh clone builds everything once: incremental state (~2 GB of
    // target/debug/incremental) buys nothing and costs disk a CI machine
    // may not have. Every cargo below inherits it.
    // SAFETY: set before this process starts a thread or a child.
    unsafe { std::env::set_var("CARGO_INCREMENTAL", "0") };
    let env = setup::setup(root, false)?;
    // The wheel as a user installs it, in a fresh venv (first, while the
    // disk holds least: its torch is removed after).
    crate::wheel::run(root)?;
    let mut fmt = cargo();
    fmt.current_dir(root).args(["fmt", "--all", "--check"]);
    step("cargo fmt --check", fmt)?;

    let mut clippy = cargo();
    clippy.current_dir(root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    step("cargo clippy -D warnings", clippy)?;

    // The CUDA kernels compile with NVRTC (from the venv's torch wheels)
    // and run under the CPU emulator in every CI run: a missing library or
    // compiler fails the tests instead of skipping them.
    let nvrtc = nvrtc_dir(root)?;
    // The run as it is records the engine's float comparisons: the
    // baseline of the kernel matrix below.
    let baseline = root.join("target/numerics/baseline.tsv");
    std::fs::create_dir_all(root.join("target/numerics"))?;
    let _ = std::fs::remove_file(&baseline);
    let mut test = cargo();
    test.current_dir(root)
        .env("LD_LIBRARY_PATH", prepend_path(&nvrtc, "LD_LIBRARY_PATH"))
        .env("KVFORGE_REQUIRE_NVRTC", "1")
        .env("KVFORGE_REDIS_SERVER", &env.redis_server)
        .env("KVFORGE_REQUIRE_PROMETHEUS", "1")
        .env("KVFORGE_REQUIRE_CHROMIUM", "1")
        .env("KVFORGE_NUMERICS_LOG", &baseline)
        .args(["test", "--workspace"]);
    if let Some(p) = &env.prometheus {
        test.env("KVFORGE_PROMETHEUS", p);
    }
    if let Some(p) = &env.chromium {
        test.env("KVFORGE_CHROMIUM", p);
    }
    step("cargo test --workspace", test)?;

    // The Python package, rebuilt from these sources, and its pytest suite
    // (offline: the model is the local GGUF).
    setup::python_package(root, &env.python, true)?;
    let py_baseline = root.join("target/numerics/python-baseline.tsv");
    let _ = std::fs::remove_file(&py_baseline);
    let mut pytest = numerics::pytest(root, &env.python);
    pytest
        .env("KVFORGE_NUMERICS_LOG", &py_baseline)
        .arg("python/tests");
    step("pytest python/tests", pytest)?;
    // lm-evaluation-harness against the server (the tests' build) and
    // transformers on 10 questions.
    crate::lm_eval::ci(root)?;
    // The same comparisons under every other kernel setting of this CPU.
    let base = numerics::Baselines {
        engine: Some(&baseline),
        python: Some(&py_baseline),
    };
    numerics::numerics(root, &env, base)?;

    // The loom model needs its own cfg, hence its own target directory.
    let mut loom = cargo();
    loom.current_dir(root)
        .env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", root.join("target/loom"))
        .args(["test", "-p", "kvforge-pool", "--test", "loom", "--release"]);
    step("loom model of kvforge-pool", loom)?;
    // A short fuzzing run (seconds once built): every committed seed and the
    // inputs libFuzzer derives from them still load or fail cleanly.
    fuzz_after_setup(root, 20_000)?;
    say("\nci: all checks passed");
    Ok(())
}

/// The directory of the venv's `libnvrtc.so.*` (torch's CUDA wheels
/// bring it; no GPU needed to compile with it).
fn nvrtc_dir(root: &Path) -> Result<PathBuf> {
    let nvidia = root.join(".venv/libtorch/../nvidia");
    let entries = std::fs::read_dir(&nvidia)
        .with_context(|| format!("no {} (setup installs torch with it)", nvidia.display()))?;
    for e in entries.flatten() {
        let lib = e.path().join("lib");
        let found = std::fs::read_dir(&lib).is_ok_and(|mut d| {
            d.any(|f| f.is_ok_and(|f| f.file_name().to_string_lossy().starts_with("libnvrtc.so")))
        });
        if found {
            return Ok(lib);
        }
    }
    bail!("no libnvrtc.so under {}/*/lib", nvidia.display())
}

/// Builds `gpu_check` (release), strips it into `target/gpu-check/` with
/// its launcher (`scripts/gpu_check.sh` as `run.sh`), and says how to run
/// it on the device: everything travels in that one folder (a few MB; the
/// carry limit is 64 MiB).
pub(crate) fn gpu_check(root: &Path) -> Result<()> {
    setup::setup(root, false)?;
    crate::build_release(root, &["-p", "kvforge-bench", "--bin", "gpu_check"])?;
    let stage = root.join("target/gpu-check");
    std::fs::create_dir_all(&stage).with_context(|| format!("creating {}", stage.display()))?;
    let mut strip = Command::new("strip");
    strip
        .arg("-o")
        .arg(stage.join("gpu_check"))
        .arg(root.join("target/release/gpu_check"));
    step("strip gpu_check", strip)?;
    std::fs::copy(root.join("scripts/gpu_check.sh"), stage.join("run.sh"))
        .context("copying scripts/gpu_check.sh")?;
    let bytes: u64 = std::fs::read_dir(&stage)?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    say(&format!(
        "
staged {} ({:.1} MB). On the GPU machine (device tool): carry [\"target/gpu-check\"], command \"bash target/gpu-check/run.sh\"; the report comes back as $OUT/gpu-check.md.",
        stage.display(),
        bytes as f64 / 1e6
    ));
    Ok(())
}

/// The AArch64 target `cross-test` builds for.
const AARCH64: &str = "aarch64-unknown-linux-gnu";

/// Runs the pure-Rust kernel and quantizer tests for AArch64 under
/// `qemu-aarch64` (every instruction set the CPU has, so NEON against the
/// scalar twin). Installs the Rust target with rustup; the cross linker
/// and qemu must be there (Debian: `apt-get install gcc-aarch64-linux-gnu
/// qemu-user`).
pub(crate) fn cross_test(root: &Path) -> Result<()> {
    for tool in ["aarch64-linux-gnu-gcc", "qemu-aarch64"] {
        let found = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            bail!(
                "{tool} not found: install Debian's gcc-aarch64-linux-gnu and qemu-user (apt-get install gcc-aarch64-linux-gnu qemu-user)"
            );
        }
    }
    let mut add = Command::new("rustup");
    add.args(["target", "add", AARCH64]);
    step("rustup target add", add)?;
    let mut test = cargo();
    test.current_dir(root)
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
            "aarch64-linux-gnu-gcc",
        )
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            "qemu-aarch64 -L /usr/aarch64-linux-gnu",
        )
        .args([
            "test",
            "-p",
            "kvforge-kernels",
            "-p",
            "kvforge-quant",
            "--target",
            AARCH64,
        ]);
    step("cargo test --target aarch64 (under qemu)", test)?;
    say("\ncross-test: the AArch64 tests passed");
    Ok(())
}

/// The pinned cargo-fuzz (coverage-guided libFuzzer; runs on stable with
/// `-s none`, no sanitizer).
const CARGO_FUZZ: &str = "0.13.2";

/// Runs each fuzz target for `runs` executions: installs cargo-fuzz if it
/// is missing, starts from the committed seeds in `fuzz/corpus/<target>` and
/// keeps what it finds in `target/fuzz-corpus/<target>`.
pub(crate) fn fuzz(root: &Path, runs: u64) -> Result<()> {
    setup::setup(root, false)?;
    fuzz_after_setup(root, runs)
}

/// [`fuzz`] once setup has run (as `ci` has).
fn fuzz_after_setup(root: &Path, runs: u64) -> Result<()> {
    let have = cargo()
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        let mut install = cargo();
        install.args(["install", "cargo-fuzz", "--locked", "--version", CARGO_FUZZ]);
        step("cargo install cargo-fuzz", install)?;
    }
    let lib = root.join(".venv/libtorch/lib");
    for target in FUZZ_TARGETS {
        let corpus = root.join("target/fuzz-corpus").join(target);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        let mut run = cargo();
        run.current_dir(root.join("fuzz"))
            .env("LD_LIBRARY_PATH", &lib)
            .args(["fuzz", "run", "-s", "none", target])
            .arg(&corpus)
            .arg(root.join("fuzz/corpus").join(target))
            .args([
                "--",
                &format!("-runs={runs}"),
                "-max_len=65536",
                "-timeout=10",
            ]);
        step(&format!("fuzz {target} ({runs} runs)"), run)?;
    }
    Ok(())
}

/// The fuzz targets in `fuzz/fuzz_targets`.
const FUZZ_TARGETS: [&str; 3] = ["gguf", "hf", "labels"];
