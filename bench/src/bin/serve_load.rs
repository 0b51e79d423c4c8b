//! `cargo xtask serve-load MODE [FLAGS]`: kvforge-serve under real,
//! bounded load on loopback; each mode starts and stops its servers.
//!
//! * `sweep`: chitchat conversations replayed at concurrency 1, 2, 4, 8,
//!   16, 32 (`--levels`), `--reps` runs per level, with `--llama-server
//!   PATH` the same load on llama.cpp's server (`-np` = concurrency), the
//!   two interleaved. TTFT and inter-token latency p50/p99, tokens/s,
//!   prefix hits, KV bytes per tier, errors; plots.
//! * `soak`: `--minutes` of waves at `--concurrency`, `--leave` of the
//!   clients hanging up mid-stream; blocks in use after each wave, RSS.
//! * `budget`: `--concurrency` conversations over a KV budget that holds
//!   half of their KV: kvforge with the INT4 cold tier, hot only, and
//!   llama-server given the same memory.
//! * `single`: one stream through the server against `kvforge bench` on
//!   the same prompt (`--context`), interleaved.
//!
//! Writes CSV, PNG and `report.md` to `--out` (default
//! `target/serve-load/MODE`).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Parser, ValueEnum};
use kvforge_bench::cli;
use kvforge_bench::output::Output;
use kvforge_bench::serve_load::Common;
use kvforge_bench::serve_load::servers::LlamaSpec;
use kvforge_bench::serve_load::soak::Soak;
use kvforge_bench::serve_load::sweep::Sweep;
use kvforge_bench::serve_load::{compare, soak, sweep};

/// What to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Conversations at each concurrency level, llama-server beside.
    Sweep,
    /// Waves of conversations for `--minutes`, some clients leaving.
    Soak,
    /// Conversations over a KV budget that holds half of their KV.
    Budget,
    /// One stream through the server against `kvforge bench`.
    Single,
}

/// kvforge-serve under real, bounded load on loopback; each mode starts
/// and stops its servers.
#[derive(Parser)]
#[command(name = "serve-load")]
struct Args {
    mode: Mode,
    /// Concurrency levels (sweep).
    #[arg(long, value_delimiter = ',', value_parser = cli::positive, default_value = "1,2,4,8,16,32")]
    levels: Vec<usize>,
    /// Runs per server and level (sweep), or per arm (single).
    #[arg(long, default_value_t = 3, value_parser = cli::positive)]
    reps: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4, value_parser = cli::positive)]
    turns: usize,
    /// Tokens per reply at most (default 64; single: 128).
    #[arg(long, value_parser = cli::positive)]
    max_tokens: Option<usize>,
    /// Ignore end-of-sequence tokens (replies run to --max-tokens).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    ignore_eos: bool,
    /// Conversations per level at least (sweep).
    #[arg(long, default_value_t = 8, value_parser = cli::positive)]
    min_convs: usize,
    /// kvforge's hot KV tokens, and llama-server's context, per slot (sweep).
    #[arg(long, default_value_t = 1024, value_parser = cli::positive)]
    ctx_per_slot: usize,
    /// llama.cpp's server binary (scripts/llama_server.sh builds it).
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Minutes to run (soak), in (0, 240].
    #[arg(long, default_value_t = 10.0, value_parser = minutes)]
    minutes: f64,
    /// Clients at once (soak: 16, budget: 8).
    #[arg(long, value_parser = cli::positive)]
    concurrency: Option<usize>,
    /// Share of clients that leave mid-stream (soak).
    #[arg(long, default_value_t = 0.1)]
    leave: f64,
    /// Prompt tokens (single).
    #[arg(long, default_value_t = 1024, value_parser = cli::positive)]
    context: usize,
    /// A mechanisms file for kvforge-serve.
    #[arg(long)]
    config: Option<PathBuf>,
    /// More flags for kvforge-serve, space-separated.
    #[arg(long, default_value = "")]
    serve_args: String,
    /// The model.
    #[arg(long, default_value = kvforge_engine::DEFAULT_MODEL)]
    model: PathBuf,
    /// chitchat's dataset.json.
    #[arg(long, default_value = cli::CHITCHAT)]
    data: PathBuf,
    /// The kvforge-serve binary.
    #[arg(long, default_value = "target/release/kvforge-serve")]
    serve_bin: PathBuf,
    /// The kvforge binary (single).
    #[arg(long, default_value = "target/release/kvforge")]
    kvforge_bin: PathBuf,
    /// llama-server's threads.
    #[arg(long, default_value_t = 2, value_parser = cli::positive)]
    threads: usize,
    /// Where the outputs go (default target/serve-load/MODE).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `--minutes`: a number in (0, 240].
fn minutes(value: &str) -> Result<f64, String> {
    value
        .parse()
        .ok()
        .filter(|m: &f64| *m > 0.0 && *m <= 240.0)
        .ok_or_else(|| "takes a number in (0, 240]".to_string())
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("serve-load", run)
}

fn run() -> Result<()> {
    let a: Args = cli::parse()?;
    let mode = a
        .mode
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string());
    let mut c = Common {
        model: a.model,
        data: a.data,
        serve_bin: a.serve_bin,
        turns: a.turns,
        max_tokens: a.max_tokens.unwrap_or(64),
        ignore_eos: a.ignore_eos,
        config: a.config,
        extra: a.serve_args.split_whitespace().map(String::from).collect(),
    };
    let sw = Sweep {
        levels: a.levels,
        reps: a.reps,
        min_convs: a.min_convs,
        ctx_per_slot: a.ctx_per_slot,
    };
    for (what, p) in [
        ("--model", &c.model),
        ("--data", &c.data),
        ("--serve-bin", &c.serve_bin),
    ] {
        if !p.is_file() {
            bail!(
                "{what} {}: no such file (`cargo xtask serve-load` builds and sets up everything)",
                p.display()
            );
        }
    }
    let llama = match a.llama_server {
        Some(bin) if !bin.is_file() => bail!(
            "--llama-server {}: no such file (scripts/llama_server.sh builds it)",
            bin.display()
        ),
        Some(bin) => Some(LlamaSpec {
            bin,
            model: c.model.clone(),
            threads: a.threads,
        }),
        None => None,
    };
    let out = a
        .out
        .unwrap_or_else(|| PathBuf::from(format!("target/serve-load/{mode}")));
    let mut o = Output::create(&out)?;
    match a.mode {
        Mode::Sweep => sweep::sweep(&c, &sw, llama.as_ref(), &mut o)?,
        Mode::Soak => {
            let sk = Soak {
                minutes: a.minutes,
                concurrency: a.concurrency.unwrap_or(16),
                leave: a.leave,
            };
            soak::soak(&c, &sk, &mut o)?
        }
        Mode::Budget => compare::budget(&c, a.concurrency.unwrap_or(8), llama.as_ref(), &mut o)?,
        Mode::Single => {
            let text = PathBuf::from("data/exllamav2/wiki.utf8");
            c.max_tokens = a.max_tokens.unwrap_or(128);
            compare::single(&c, &a.kvforge_bin, &text, a.context, sw.reps, &mut o)?
        }
    }
    eprintln!("serve-load: wrote {}", o.dir().display());
    Ok(())
}
