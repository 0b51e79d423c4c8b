//! `cargo xtask <command>`: the project's own commands (matklad's xtask
//! pattern). Plain `std::process::Command`, so it compiles in seconds.
//!
//! * `setup` — venv with torch, the model, the data (see `setup.rs`).
//! * `ci`    — setup, fmt check, clippy `-D warnings`, all tests, the
//!   engine's float comparisons under every kernel setting (`numerics`),
//!   loom model, a short run of each fuzz target.
//! * `numerics` — the engine's tests, then its float comparisons under
//!   every `MKL_CBWR` × `ATEN_CPU_CAPABILITY` setting of this CPU; fails
//!   when an error passes a quarter of its bound (`target/numerics/`).
//! * `ablate ARGS` — the main job: every mechanism on and off on the real
//!   model (`configs/ablate.toml`; `--quick`, `--full`, `--config FILE`,
//!   `--resume`), one report in `target/ablate/<name>/`.
//! * `kvforge ARGS` — setup, then the `kvforge` CLI (release build).
//! * `serve ARGS` — setup, then `kvforge-serve`, the OpenAI-compatible
//!   server (release build; `--port`, `--config` …).
//! * `serve-load ARGS` — the server under replayed chitchat conversations
//!   at rising concurrency, a soak, and the same load on llama.cpp's
//!   `llama-server` (`target/serve-load`).
//! * `engine-bench` — kvforge and Hugging Face transformers, prefill and
//!   decode speed at 1k context on the same model, one table.
//! * `pressure ARGS` — many chitchat sessions over a budget that holds a
//!   fraction of their KV (`target/pressure`).
//! * `lifecycle ARGS` — the context lifecycle's experiment: long
//!   conversations with planted facts under the cache alone, the lifecycle
//!   alone, both, StreamingLLM and truncation (`target/lifecycle`).
//! * `prefix-bench ARGS` — prefix reuse on chitchat conversations (per-turn
//!   table, block-size sweep, CSV / Markdown / PNG in `target/prefix-bench`).
//! * `remote-bench ARGS` — the shared remote tier on a redis-server it
//!   starts: second-instance TTFT, tier throughput, decode speed while
//!   writing (`target/remote-bench`).
//! * `route-sim ARGS` — instances behind a round-robin, sticky or
//!   prefix-aware router, with and without the remote tier, simulated on
//!   the chitchat replay (`target/route-sim`).
//! * `quant-sweep ARGS` — tiered KV quantization: streaming perplexity, KV
//!   bytes and decode speed over hot window × format × rotation at 4k and 8k
//!   context (CSV / Markdown / Pareto PNG in `target/quant-sweep`).
//! * `decode-ab ARGS` — decode speed of the cold tier's formats against the
//!   unquantized cache, interleaved rounds in one process.
//! * `kv-stats ARGS` — how often the KV cache holds near-duplicate vectors
//!   (best cosine match per vector across positions, layers and sequences;
//!   CSV / Markdown / PNG in `target/kv-stats`).
//! * `gpu-check` — builds the one prepared run for a lent GPU (kernels
//!   against the CPU, bandwidth, engine logits, 8B-shape throughput) and
//!   stages it, stripped, with its launcher in `target/gpu-check/`.
//! * `model-check [CASES]` — the coordinator's randomized model-based
//!   test at 10^5 cases (CI runs 1,500), in release.
//! * `cross-test` — the kernels' and quantizers' tests on AArch64 (the
//!   NEON path) under `qemu-aarch64`: needs `rustup`, and Debian's
//!   `gcc-aarch64-linux-gnu` and `qemu-user`; not part of `ci`.
//! * `bench` — the criterion benches, then a Markdown summary of their
//!   medians in `target/kvforge-bench.md`.
//! * `fuzz [RUNS]` — the coverage-guided fuzzers of the GGUF and the
//!   Hugging Face loaders and of the `[LIFECYCLE]` label parser (cargo-fuzz,
//!   libFuzzer), 10^6 runs each by default.
//! * `tidy`  — source hygiene checks (also run by `cargo test`).

mod numerics;
mod setup;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: cargo xtask <setup [--reference] | ci | ablate [--quick | --full | --config FILE] [--resume] | \
                     bench [FILTER] | fuzz [RUNS] | kvforge ARGS... | serve ARGS... | serve-load ARGS... | prefix-bench ARGS... | remote-bench ARGS... | route-sim ARGS... | pressure ARGS... | lifecycle ARGS... | quant-sweep ARGS... | decode-ab ARGS... | gpu-check | model-check [CASES] | numerics | cross-test | kv-stats ARGS... | engine-bench [CONTEXT] [DECODE] | tidy>";

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = project_root();
    match args.first().map(String::as_str) {
        Some("setup") if args.len() == 1 => setup::setup(&root, false).map(|_| ()),
        Some("setup") if args.len() == 2 && args[1] == "--reference" => {
            setup::setup(&root, true).map(|_| ())
        }
        Some("ci") if args.len() == 1 => ci(&root),
        Some("ablate") if names_python_policy(&root, &args[1..]) => {
            python_ablate(&root, &args[1..])
        }
        Some("ablate") => run_after_setup(&root, "kvforge-bench", "ablate", &args[1..]),
        Some("kvforge") => run_after_setup(&root, "kvforge-engine", "kvforge", &args[1..]),
        Some("serve") => run_after_setup(&root, "kvforge-server", "kvforge-serve", &args[1..]),
        Some("serve-load") => {
            // The load generator starts the release server (and, for
            // `single`, the release CLI) itself.
            setup::setup(&root, false)?;
            let mut build = cargo();
            build.current_dir(&root).args([
                "build",
                "--quiet",
                "--release",
                "-p",
                "kvforge-server",
                "-p",
                "kvforge-engine",
                "--bins",
            ]);
            step(
                "cargo build --release -p kvforge-server -p kvforge-engine",
                build,
            )?;
            run_after_setup(&root, "kvforge-bench", "serve_load", &args[1..])
        }
        Some("prefix-bench") => run_after_setup(&root, "kvforge-bench", "prefix_bench", &args[1..]),
        Some("remote-bench") => run_after_setup(&root, "kvforge-bench", "remote_bench", &args[1..]),
        Some("route-sim") => run_after_setup(&root, "kvforge-bench", "route_sim", &args[1..]),
        Some("pressure") => run_after_setup(&root, "kvforge-bench", "pressure", &args[1..]),
        Some("lifecycle") => run_after_setup(&root, "kvforge-bench", "lifecycle", &args[1..]),
        Some("quant-sweep") => run_after_setup(&root, "kvforge-bench", "quant_sweep", &args[1..]),
        Some("kv-stats") => run_after_setup(&root, "kvforge-bench", "kv_stats", &args[1..]),
        Some("decode-ab") => run_after_setup(&root, "kvforge-bench", "decode_ab", &args[1..]),
        Some("engine-bench") if args.len() <= 3 => {
            let num = |i: usize, d: usize| -> Result<usize> {
                match args.get(i) {
                    None => Ok(d),
                    Some(s) => s
                        .parse()
                        .with_context(|| format!("{s:?} is not a token count")),
                }
            };
            engine_bench(&root, num(1, 1024)?, num(2, 64)?)
        }
        Some("gpu-check") if args.len() == 1 => gpu_check(&root),
        Some("model-check") if args.len() <= 2 => {
            let cases = match args.get(1) {
                None => 100_000,
                Some(s) => s
                    .parse()
                    .with_context(|| format!("{s:?} is not a number of cases"))?,
            };
            model_check(&root, cases)
        }
        Some("cross-test") if args.len() == 1 => cross_test(&root),
        Some("numerics") if args.len() == 1 => {
            let env = setup::setup(&root, false)?;
            let none = numerics::Baselines {
                engine: None,
                python: None,
            };
            numerics::numerics(&root, &env, none)
        }
        Some("bench") if args.len() <= 2 => bench(&root, args.get(1).map(String::as_str)),
        Some("fuzz") if args.len() <= 2 => {
            let runs = match args.get(1) {
                None => 1_000_000,
                Some(s) => s
                    .parse()
                    .with_context(|| format!("{s:?} is not a number of runs"))?,
            };
            fuzz(&root, runs)
        }
        Some("tidy") if args.len() == 1 => {
            let problems = tidy::check(&root)?;
            if !problems.is_empty() {
                bail!("tidy:\n{}", problems.join("\n"));
            }
            say("tidy: ok");
            Ok(())
        }
        _ => bail!("{USAGE}"),
    }
}

/// The coordinator's randomized model-based test (`engine/coordinator/
/// tests/model.rs`) at `cases` cases, in release: no setup needed (pure
/// Rust). CI runs 1,500 of them on every test run.
fn model_check(root: &Path, cases: u64) -> Result<()> {
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

/// The experiment file `ablate ARGS` reads (`--config FILE`, `--quick`,
/// `--full`, else the default).
fn ablate_config(root: &Path, args: &[String]) -> PathBuf {
    let mut file = PathBuf::from("configs/ablate.toml");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" | "--full" => file = PathBuf::from(format!("configs/{}.toml", &a[2..])),
            "--config" => file = it.next().map_or(file, PathBuf::from),
            _ => {}
        }
    }
    root.join(file)
}

/// Whether the experiment file names a policy written in Python (a
/// `[[config]]` whose `eviction.policy` or `tier.policy` is
/// `"module:Class"`). A file
/// that cannot be read or parsed is left to the ablation's own error.
fn names_python_policy(root: &Path, args: &[String]) -> bool {
    std::fs::read_to_string(ablate_config(root, args)).is_ok_and(|t| python_policy_named(&t))
}

/// Whether a TOML experiment text has a `[[config]]` whose eviction or
/// tier policy is a `"module:Class"` name.
fn python_policy_named(text: &str) -> bool {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return false;
    };
    let configs = doc.get("config").and_then(|c| c.as_array());
    configs.into_iter().flatten().any(|c| {
        ["eviction", "tier"].iter().any(|k| {
            c.get(k)
                .and_then(|e| e.get("policy"))
                .and_then(|p| p.as_str())
                .is_some_and(|p| p.contains(':'))
        })
    })
}

/// The ablation of a file that names a policy written in Python: setup
/// (which builds the Python package), then `python -m kvforge ablate ARGS`
/// — the same runner, in a Python process; exits with its status.
fn python_ablate(root: &Path, args: &[String]) -> Result<()> {
    let env = setup::setup(root, false)?;
    say("ablate: the experiment file names a policy written in Python: python -m kvforge ablate");
    let status = Command::new(&env.python)
        .current_dir(root)
        .env("KVFORGE_REDIS_SERVER", &env.redis_server)
        .args(["-m", "kvforge", "ablate"])
        .args(args)
        .status()
        .context("could not start python -m kvforge")?;
    std::process::exit(status.code().unwrap_or(1));
}

/// Setup, then `cargo run --release` of one binary with `args`; exits with
/// its status.
fn run_after_setup(root: &Path, package: &str, bin: &str, args: &[String]) -> Result<()> {
    let env = setup::setup(root, false)?;
    let mut cmd = cargo();
    cmd.current_dir(root)
        .env("KVFORGE_REDIS_SERVER", &env.redis_server)
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            package,
            "--bin",
            bin,
            "--",
        ])
        .args(args);
    let status = cmd.status().context("could not start cargo run")?;
    std::process::exit(status.code().unwrap_or(1));
}

fn project_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

fn say(msg: &str) {
    eprintln!("{msg}");
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn step(name: &str, mut cmd: Command) -> Result<()> {
    say(&format!("\n==> {name}"));
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{name}`"))?;
    if !status.success() {
        bail!("`{name}` failed ({status})");
    }
    Ok(())
}

fn ci(root: &Path) -> Result<()> {
    let env = setup::setup(root, false)?;
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
        .env("KVFORGE_NUMERICS_LOG", &baseline)
        .args(["test", "--workspace"]);
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
pub(crate) fn nvrtc_dir(root: &Path) -> Result<PathBuf> {
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

/// `dir` in front of the environment variable `var`'s search path.
pub(crate) fn prepend_path(dir: &Path, var: &str) -> std::ffi::OsString {
    let mut out = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        out.push(":");
        out.push(old);
    }
    out
}

/// Runs `kvforge bench` in several precisions and the transformers script on
/// the same text and model, and prints one Markdown table.
fn engine_bench(root: &Path, context: usize, decode: usize) -> Result<()> {
    let env = setup::setup(root, true)?;
    let mut build = cargo();
    build
        .current_dir(root)
        .args(["build", "--quiet", "--release", "-p", "kvforge-engine"]);
    step("cargo build --release -p kvforge-engine", build)?;
    let text = root.join("data/exllamav2/wiki.utf8");
    let model = root.join("models").join(setup::MODEL_FILE);
    let (ctx, dec) = (context.to_string(), decode.to_string());
    let mut runs: Vec<(String, Command)> = Vec::new();
    for extra in [
        &[][..],
        &["--dtype", "bf16"],
        &["--weights", "f16"],
        &["--weights", "f16", "--kv-dtype", "f16"],
    ] {
        let mut c = Command::new(root.join("target/release/kvforge"));
        c.current_dir(root)
            .args(["bench", "--text"])
            .arg(&text)
            .args(["--context", &ctx, "--max-tokens", &dec]);
        c.args(extra);
        let label = if extra.is_empty() {
            "kvforge (f32)".to_string()
        } else {
            format!("kvforge {}", extra.join(" "))
        };
        runs.push((label, c));
    }
    let mut hf = Command::new(&env.python);
    hf.current_dir(root)
        .arg(root.join("scripts/hf_bench.py"))
        .arg(&model)
        .arg(&text)
        .args([&ctx, &dec]);
    runs.push(("transformers (f32)".into(), hf));
    let mut rows = Vec::new();
    for (name, mut cmd) in runs {
        say(&format!("==> {name}"));
        let out = cmd
            .output()
            .with_context(|| format!("could not start {name}"))?;
        if !out.status.success() {
            bail!(
                "{name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .unwrap_or("{}");
        let j: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{name}: bad output {line:?}"))?;
        rows.push((name, j));
    }
    let base = rows
        .last()
        .and_then(|r| r.1["decode_tok_s"].as_f64())
        .unwrap_or(f64::NAN);
    let mut table = format!(
        "Context {context} tokens of wiki.utf8, {decode} greedy decode steps, CPU, SmolLM2-135M Q4_1 GGUF.\n\n\
         | engine | prefill tok/s | decode tok/s | decode vs transformers |\n|---|---:|---:|---:|\n"
    );
    for (name, j) in &rows {
        let d = j["decode_tok_s"].as_f64().unwrap_or(f64::NAN);
        table.push_str(&format!(
            "| {name} | {:.1} | {d:.1} | {:.2}x |\n",
            j["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
            d / base
        ));
    }
    let out = root.join("target/engine-bench.md");
    std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    say(&format!("\n{table}\nwritten to {}", out.display()));
    Ok(())
}

/// Builds `gpu_check` (release), strips it into `target/gpu-check/` with
/// its launcher (`scripts/gpu_check.sh` as `run.sh`), and says how to run
/// it on the device: everything travels in that one folder (a few MB; the
/// carry limit is 64 MiB).
fn gpu_check(root: &Path) -> Result<()> {
    setup::setup(root, false)?;
    let mut build = cargo();
    build.current_dir(root).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "kvforge-bench",
        "--bin",
        "gpu_check",
    ]);
    step("cargo build --release --bin gpu_check", build)?;
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
fn cross_test(root: &Path) -> Result<()> {
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
fn fuzz(root: &Path, runs: u64) -> Result<()> {
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

fn bench(root: &Path, filter: Option<&str>) -> Result<()> {
    // The bench crate also holds the engine-backed prefix-bench binary.
    setup::setup(root, false)?;
    let mut cmd = cargo();
    cmd.current_dir(root).args([
        "bench",
        "-p",
        "kvforge-bench",
        "--bench",
        "bench_main",
        "--",
    ]);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    step("cargo bench -p kvforge-bench", cmd)?;
    let table = summarize(&root.join("target/criterion"))?;
    let out = root.join("target/kvforge-bench.md");
    std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    say(&format!("\n{table}\nwritten to {}", out.display()));
    Ok(())
}

/// Reads every `new/estimates.json` + `new/benchmark.json` criterion left and
/// renders median time and throughput per benchmark.
fn summarize(dir: &Path) -> Result<String> {
    let mut rows = Vec::new();
    collect(dir, &mut rows)?;
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let mut s = String::from("| benchmark | median | throughput |\n|---|---:|---:|\n");
    for (name, median_ns, per_iter) in rows {
        let thr = match per_iter {
            Some(n) => format_rate(n / (median_ns * 1e-9)),
            None => String::new(),
        };
        s.push_str(&format!("| {name} | {} | {thr} |\n", format_ns(median_ns)));
    }
    Ok(s)
}

type Row = (String, f64, Option<f64>);

fn collect(dir: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if !path.is_dir() {
            continue;
        }
        let est = path.join("new/estimates.json");
        let meta = path.join("new/benchmark.json");
        if est.is_file() && meta.is_file() {
            let est: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&est)?)
                .with_context(|| format!("parsing {}", est.display()))?;
            let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta)?)
                .with_context(|| format!("parsing {}", meta.display()))?;
            let median = est["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let name = meta["full_id"].as_str().unwrap_or("?").to_string();
            let per_iter = meta["throughput"]["Elements"].as_f64();
            rows.push((name, median, per_iter));
        } else {
            collect(&path, rows)?;
        }
    }
    Ok(())
}

fn format_ns(ns: f64) -> String {
    match ns {
        n if n < 1e3 => format!("{n:.1} ns"),
        n if n < 1e6 => format!("{:.2} µs", n / 1e3),
        n if n < 1e9 => format!("{:.2} ms", n / 1e6),
        n => format!("{:.2} s", n / 1e9),
    }
}

fn format_rate(per_s: f64) -> String {
    format!("{per_s:.3e} elem/s")
}

#[cfg(test)]
mod tests {
    use super::python_policy_named;

    #[test]
    fn a_python_policy_is_a_module_colon_class_name_of_a_configs_eviction_or_tier() {
        let named = |c: &str| python_policy_named(&format!("[[config]]\nname = \"x\"\n{c}\n"));
        assert!(named(
            "eviction = { policy = \"kvforge.examples.keydiff:KeyDiff\", sink = 16 }"
        ));
        assert!(named("eviction = { policy = 'm:C' }"));
        assert!(named("eviction = { \"policy\" = \"m:C\", note = \"v#2\" }"));
        assert!(named("[config.eviction]\npolicy = \"m:C\""));
        assert!(!named("eviction = { policy = \"keydiff\", sink = 16 }"));
        assert!(!named("# eviction = { policy = \"m:C\" }"));
        assert!(named(
            "tier = { policy = \"kvforge.examples.tiers:Every\" }"
        ));
        assert!(!named("tier = { policy = \"plan\" }"));
        assert!(!named("lifecycle = { policy = \"a:b\" }"));
        assert!(!python_policy_named("not toml = = ="));
    }
}
