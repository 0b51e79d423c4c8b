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

use anyhow::{Context, Result, bail};
use kvforge_bench::output::Output;
use kvforge_bench::serve_load::Common;
use kvforge_bench::serve_load::servers::LlamaSpec;
use kvforge_bench::serve_load::sweep::{Soak, Sweep};
use kvforge_bench::serve_load::{compare, sweep};

const USAGE: &str = "usage: serve_load sweep|soak|budget|single [--levels 1,2,4,8,16,32] [--reps N] \
                     [--turns N] [--max-tokens N] [--ignore-eos true|false] [--min-convs N] [--ctx-per-slot N] [--llama-server PATH] \
                     [--minutes M] [--concurrency N] [--leave SHARE] [--context N] [--config FILE] [--serve-args \"FLAGS\"] \
                     [--model FILE] [--data FILE] [--serve-bin FILE] [--kvforge-bin FILE] [--threads N] [--out DIR]";

fn main() {
    if let Err(e) = run() {
        eprintln!("serve-load: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(mode) = args.first().cloned() else {
        bail!("{USAGE}");
    };
    if !["sweep", "soak", "budget", "single"].contains(&mode.as_str()) {
        bail!("unknown mode {mode:?}; {USAGE}");
    }
    let mut c = Common {
        model: kvforge_engine::DEFAULT_MODEL.into(),
        data: "data/chitchat/dataset.json".into(),
        serve_bin: "target/release/kvforge-serve".into(),
        turns: 4,
        max_tokens: 64,
        ignore_eos: false,
        config: None,
        extra: Vec::new(),
    };
    let mut sw = Sweep {
        levels: vec![1, 2, 4, 8, 16, 32],
        reps: 3,
        min_convs: 8,
        ctx_per_slot: 1024,
    };
    let mut sk = Soak {
        minutes: 10.0,
        concurrency: 16,
        leave: 0.1,
    };
    let (mut llama, mut threads, mut context) = (None::<PathBuf>, 2usize, 1024usize);
    let mut kvforge_bin = PathBuf::from("target/release/kvforge");
    let mut concurrency = None;
    let mut out = PathBuf::from(format!("target/serve-load/{mode}"));
    let mut it = args[1..].iter();
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let num = || kvforge_bench::positive(flag, value);
        match flag.as_str() {
            "--levels" => {
                sw.levels = value
                    .split(',')
                    .map(|v| kvforge_bench::positive(flag, v))
                    .collect::<Result<_>>()?
            }
            "--reps" => sw.reps = num()?,
            "--turns" => c.turns = num()?,
            "--ignore-eos" => {
                c.ignore_eos = value
                    .parse()
                    .with_context(|| format!("--ignore-eos takes true or false, not {value:?}"))?
            }
            "--max-tokens" => c.max_tokens = num()?,
            "--min-convs" => sw.min_convs = num()?,
            "--ctx-per-slot" => sw.ctx_per_slot = num()?,
            "--llama-server" => llama = Some(value.into()),
            "--minutes" => {
                sk.minutes = value
                    .parse()
                    .ok()
                    .filter(|m: &f64| *m > 0.0 && *m <= 240.0)
                    .with_context(|| {
                        format!("--minutes takes a number in (0, 240], not {value:?}")
                    })?
            }
            "--concurrency" => concurrency = Some(num()?),
            "--leave" => {
                sk.leave = value
                    .parse()
                    .with_context(|| format!("--leave: {value:?} is not a share"))?
            }
            "--context" => context = num()?,
            "--config" => c.config = Some(value.into()),
            "--serve-args" => c.extra = value.split_whitespace().map(String::from).collect(),
            "--model" => c.model = value.into(),
            "--data" => c.data = value.into(),
            "--serve-bin" => c.serve_bin = value.into(),
            "--kvforge-bin" => kvforge_bin = value.into(),
            "--threads" => threads = num()?,
            "--out" => out = value.into(),
            _ => bail!("unknown flag {flag}; {USAGE}"),
        }
    }
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
    let llama = match llama {
        Some(bin) if !bin.is_file() => bail!(
            "--llama-server {}: no such file (scripts/llama_server.sh builds it)",
            bin.display()
        ),
        Some(bin) => Some(LlamaSpec {
            bin,
            model: c.model.clone(),
            threads,
        }),
        None => None,
    };
    let mut o = Output::create(&out)?;
    match mode.as_str() {
        "sweep" => sweep::sweep(&c, &sw, llama.as_ref(), &mut o)?,
        "soak" => {
            sk.concurrency = concurrency.unwrap_or(16);
            sweep::soak(&c, &sk, &mut o)?
        }
        "budget" => compare::budget(&c, concurrency.unwrap_or(8), llama.as_ref(), &mut o)?,
        _ => {
            let text = PathBuf::from("data/exllamav2/wiki.utf8");
            c.max_tokens = if args.iter().any(|a| a == "--max-tokens") {
                c.max_tokens
            } else {
                128
            };
            compare::single(&c, &kvforge_bin, &text, context, sw.reps, &mut o)?
        }
    }
    eprintln!("serve-load: wrote {}", o.dir().display());
    Ok(())
}
