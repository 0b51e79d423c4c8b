//! Decode speed of the quantized cold tier against the unquantized cache,
//! measured side by side (`cargo xtask decode-ab`).
//!
//! One model, one KV cache per configuration (unquantized, then each
//! `--formats` entry with the default tier: window 128, sink 32, KIVI keys).
//! Every sequence is prefilled with the same `--context` tokens of
//! `wiki.utf8` (in 512-token chunks); then, for `--rounds` rounds, each
//! configuration in turn decodes `--steps` greedy tokens. Interleaving the
//! rounds spreads machine noise over all configurations alike. Prints one
//! Markdown row per configuration: tokens/s over all its rounds, the ratio to
//! the unquantized cache, and KV bytes.

#![allow(clippy::print_stdout)] // a report printer

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvforge_engine::ppl::greedy_token;
use kvforge_engine::{Engine, EngineConfig, KvQuant, PagedKvCache, Sequence, Tensor};

struct Args {
    context: usize,
    steps: usize,
    rounds: usize,
    formats: Vec<String>,
    block_size: usize,
    model: PathBuf,
    text: PathBuf,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        context: 8192 - 256,
        steps: 8,
        rounds: 8,
        formats: vec!["int8".into(), "int4".into(), "int2".into()],
        block_size: 32,
        model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        text: PathBuf::from("data/exllamav2/wiki.utf8"),
    };
    for (flag, value) in kvforge_bench::flag_pairs()? {
        let num = || kvforge_bench::positive(&flag, &value);
        match flag.as_str() {
            "--context" => a.context = num()?,
            "--steps" => a.steps = num()?,
            "--rounds" => a.rounds = num()?,
            "--block-size" => a.block_size = num()?,
            "--formats" => a.formats = value.split(',').map(|s| s.trim().into()).collect(),
            "--model" => a.model = value.into(),
            "--text" => a.text = value.into(),
            _ => bail!(
                "unknown flag {flag}; flags: --context --steps --rounds --formats --block-size --model --text"
            ),
        }
    }
    Ok(a)
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("decode-ab", run)
}

/// One configuration under test.
struct Arm {
    name: String,
    cache: PagedKvCache,
    seq: Sequence,
    last: Tensor,
    time: Duration,
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let article = kvforge_bench::longest_article(&a.text)?;
    let cfg = EngineConfig {
        block_size: a.block_size,
        ..Default::default()
    };
    let engine =
        Engine::load(&a.model, &cfg).with_context(|| format!("loading {}", a.model.display()))?;
    let mut ids = engine.tokenizer.encode(&article)?;
    if ids.len() < a.context {
        bail!(
            "the longest article holds {} tokens, fewer than --context {}",
            ids.len(),
            a.context
        );
    }
    ids.truncate(a.context);
    let capacity = a.context + a.steps * a.rounds;
    let (model, kind) = (&engine.model, engine.model.kind());
    let mut specs: Vec<Option<KvQuant>> = vec![None];
    for f in &a.formats {
        specs.push(Some(KvQuant::parse(f)?));
    }
    let mut arms = Vec::new();
    for spec in specs {
        let mut cache =
            PagedKvCache::new(&model.cfg, a.block_size, capacity, model.device(), kind)?;
        cache.set_cold_tier(spec)?;
        let mut seq = Sequence::default();
        let mut last = None;
        for chunk in ids.chunks(512) {
            last = Some(model.forward(chunk, &mut cache.view(&mut seq), false)?);
        }
        let last = last.context("empty context")?;
        arms.push(Arm {
            name: spec.map_or_else(|| "unquantized".into(), |q| q.name()),
            cache,
            seq,
            last,
            time: Duration::ZERO,
        });
    }
    for _ in 0..a.rounds {
        for arm in &mut arms {
            let t = Instant::now();
            for _ in 0..a.steps {
                let next = greedy_token(&arm.last)?;
                arm.last = model.forward(&[next], &mut arm.cache.view(&mut arm.seq), false)?;
            }
            arm.time += t.elapsed();
        }
    }
    let n = (a.steps * a.rounds) as f64;
    let base = n / arms[0].time.as_secs_f64();
    println!(
        "Decode at {} tokens of context, {} rounds × {} steps per configuration, interleaved (block {}).\n\n\
         | cache | decode tok/s | × unquantized | KV MiB (hot + cold) |\n|---|---:|---:|---:|",
        a.context, a.rounds, a.steps, a.block_size
    );
    for arm in &arms {
        let rate = n / arm.time.as_secs_f64();
        let (hot, cold) = arm.cache.tier_bytes();
        println!(
            "| {} | {rate:.2} | {:.2} | {:.1} ({:.1} + {:.1}) |",
            arm.name,
            rate / base,
            (hot + cold) as f64 / 1048576.0,
            hot as f64 / 1048576.0,
            cold as f64 / 1048576.0
        );
    }
    for arm in &mut arms {
        arm.cache.free(&mut arm.seq)?;
    }
    Ok(())
}
