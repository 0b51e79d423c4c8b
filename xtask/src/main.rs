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

mod ablate;
mod bench;
mod checks;
mod debian;
mod lm_eval;
mod numerics;
mod setup;
mod tidy;
mod wheel;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: cargo xtask <setup [--reference] | ci | ablate [--quick | --full | --config FILE] [--resume] | \
                     bench [FILTER] | fuzz [RUNS] | kvforge ARGS... | serve ARGS... | serve-load ARGS... | prefix-bench ARGS... | remote-bench ARGS... | route-sim ARGS... | pressure ARGS... | lifecycle ARGS... | quant-sweep ARGS... | decode-ab ARGS... | gpu-check | model-check [CASES] | numerics | cross-test | kv-stats ARGS... | engine-bench [CONTEXT] [DECODE] | lm-eval [QUESTIONS] | wheel | tidy>";

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
        Some("ci") if args.len() == 1 => checks::ci(&root),
        Some("wheel") if args.len() == 1 => {
            setup::setup(&root, false)?;
            wheel::run(&root)
        }
        Some("ablate") if ablate::names_python_policy(&root, &args[1..]) => {
            ablate::python_ablate(&root, &args[1..])
        }
        Some("ablate") => run_after_setup(&root, "kvforge-bench", "ablate", &args[1..]),
        Some("kvforge") => run_after_setup(&root, "kvforge-engine", "kvforge", &args[1..]),
        Some("serve") => run_after_setup(&root, "kvforge-server", "kvforge-serve", &args[1..]),
        Some("serve-load") => {
            // The load generator starts the release server (and, for
            // `single`, the release CLI) itself.
            setup::setup(&root, false)?;
            build_release(
                &root,
                &["-p", "kvforge-server", "-p", "kvforge-engine", "--bins"],
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
            bench::engine_bench(&root, num(1, 1024)?, num(2, 64)?)
        }
        Some("lm-eval") => lm_eval::run(&root, &args[1..]),
        Some("gpu-check") if args.len() == 1 => checks::gpu_check(&root),
        Some("model-check") if args.len() <= 2 => {
            let cases = match args.get(1) {
                None => 100_000,
                Some(s) => s
                    .parse()
                    .with_context(|| format!("{s:?} is not a number of cases"))?,
            };
            checks::model_check(&root, cases)
        }
        Some("cross-test") if args.len() == 1 => checks::cross_test(&root),
        Some("numerics") if args.len() == 1 => {
            let env = setup::setup(&root, false)?;
            let none = numerics::Baselines {
                engine: None,
                python: None,
            };
            numerics::numerics(&root, &env, none)
        }
        Some("bench") if args.len() <= 2 => bench::bench(&root, args.get(1).map(String::as_str)),
        Some("fuzz") if args.len() <= 2 => {
            let runs = match args.get(1) {
                None => 1_000_000,
                Some(s) => s
                    .parse()
                    .with_context(|| format!("{s:?} is not a number of runs"))?,
            };
            checks::fuzz(&root, runs)
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

/// `PY -m pip install` quietly and without pip's cache (which would keep a
/// second copy of the torch and CUDA wheels, ~4 GB, on the disk).
fn pip_install(py: &Path) -> Command {
    let mut cmd = Command::new(py);
    cmd.args([
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-cache-dir",
    ]);
    cmd
}

/// `python -c CODE`'s trimmed output.
pub(crate) fn python_says(py: &Path, code: &str) -> Result<String> {
    let out = Command::new(py)
        .args(["-c", code])
        .output()
        .with_context(|| format!("could not start {}", py.display()))?;
    if !out.status.success() {
        bail!(
            "{} -c {code:?} failed: {}",
            py.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `cargo build --quiet --release ARGS` in the workspace, as a step.
fn build_release(root: &Path, args: &[&str]) -> Result<()> {
    let mut build = cargo();
    build
        .current_dir(root)
        .args(["build", "--quiet", "--release"])
        .args(args);
    step(&format!("cargo build --release {}", args.join(" ")), build)
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

/// `dir` in front of the environment variable `var`'s search path.
pub(crate) fn prepend_path(dir: &Path, var: &str) -> std::ffi::OsString {
    let mut out = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        out.push(":");
        out.push(old);
    }
    out
}
