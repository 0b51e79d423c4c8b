//! Decode speed of attention backends and cache formats, measured side by
//! side (`cargo xtask decode-ab`).
//!
//! One model; one KV cache per storage configuration (`--kv-dtypes` ×
//! unquantized and each `--formats` entry with the default tier: window
//! 128, sink 32, KIVI keys). Every sequence is prefilled with the same
//! `--context` tokens of `wiki.utf8` (in 512-token chunks). Then, for
//! `--rounds` rounds, every configuration decodes `--steps` greedy tokens
//! with each of `--backends` in turn (the backend is swapped on the same
//! cache, so every backend sees the same contexts): interleaving spreads
//! machine noise over all arms alike. One Markdown row per arm: the
//! median over rounds of tokens/s, its ratio to the first arm (the
//! reference backend on the first dtype, unquantized) and to the same
//! cache with the first backend, and KV bytes; printed, and written with
//! `decode.csv` to `--out` (default `target/decode-ab`).
//!
//! Then batched decode (`--batch B` sequences at `--batch-context` tokens,
//! different slices of the article, on the first KV dtype, unquantized,
//! the first fused backend or else the first one): rounds alternate
//! decoding the B sequences one by one and as one batch
//! (`Llama::forward_batch`), and the table gives the median tokens/s of
//! each (`--batch 1` skips it).
//!
//! `--weights f16` stores the weights in f16 (f32 compute), the engine's
//! fastest CPU setting.
//!
//! Backends: `reference` (gather + SDPA), `fused` (the paged kernel,
//! fastest instruction set), `fused-scalar` (its scalar twin), and a
//! `-tN` suffix to split long contexts over N threads (`fused-t2`).

#![allow(clippy::print_stdout)] // a report printer

use std::path::PathBuf;
use std::time::Instant;

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvforge_bench::cli::{self, Common};
use kvforge_bench::median;
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::ppl::greedy_token;
use kvforge_engine::{
    AttentionBackend, Engine, EngineConfig, FusedBackend, Isa, Kind, KvQuant, KvStore, Llama,
    PagedKvCache, ReferenceBackend, Sequence, Tensor, parse_dtype,
};

/// Decode speed of each cold format × attention backend × KV dtype at one
/// context, and a batch of sequences decoded together.
#[derive(Parser)]
#[command(name = "decode-ab")]
struct Args {
    /// Context length of the timed decode.
    #[arg(long, default_value_t = 8192 - 256, value_parser = cli::positive)]
    context: usize,
    /// Decode steps per round.
    #[arg(long, default_value_t = 8, value_parser = cli::positive)]
    steps: usize,
    /// Rounds (the median is reported).
    #[arg(long, default_value_t = 8, value_parser = cli::positive)]
    rounds: usize,
    /// Cold formats (`none`: only the hot cache).
    #[arg(long, value_delimiter = ',', default_values_t = ["int8".to_string(), "int4".into(), "int2".into()])]
    formats: Vec<String>,
    /// Attention backends: reference, fused, fused-scalar (`-tN`: threads).
    #[arg(long, value_delimiter = ',', default_values_t = ["reference".to_string(), "fused".into()])]
    backends: Vec<String>,
    /// KV dtypes of the hot cache.
    #[arg(long, value_delimiter = ',', default_values_t = ["f32".to_string()])]
    kv_dtypes: Vec<String>,
    /// Sequences decoded together in the batch measurement.
    #[arg(long, default_value_t = 8, value_parser = cli::positive)]
    batch: usize,
    /// Context of each sequence of the batch.
    #[arg(long, default_value_t = 1024, value_parser = cli::positive)]
    batch_context: usize,
    /// Weight dtype (default: the compute dtype).
    #[arg(long)]
    weights: Option<String>,
    #[arg(long, default_value_t = 32, value_parser = cli::positive)]
    block_size: usize,
    /// The text to decode from (its longest article).
    #[arg(long, default_value = "data/exllamav2/wiki.utf8")]
    text: PathBuf,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/decode-ab")
    }
}

fn parse_args() -> Result<Args> {
    let mut a: Args = cli::parse()?;
    for l in [&mut a.formats, &mut a.backends, &mut a.kv_dtypes] {
        l.retain(|s| !s.trim().is_empty() && s.trim() != "none");
    }
    if a.backends.is_empty() || a.kv_dtypes.is_empty() {
        bail!("--backends and --kv-dtypes need at least one entry");
    }
    Ok(a)
}

/// A backend by name: `reference`, `fused`, `fused-scalar`, with an
/// optional `-tN` thread suffix on the fused ones.
fn backend(name: &str) -> Result<Box<dyn AttentionBackend>> {
    if name == "reference" {
        return Ok(Box::new(ReferenceBackend));
    }
    let (base, threads) = match name.rsplit_once("-t") {
        Some((b, n)) if n.parse::<usize>().is_ok_and(|n| n > 0) => (b, n.parse::<usize>()?),
        _ => (name, 1),
    };
    let f = FusedBackend::default().with_threads(threads, kvforge_engine::DEFAULT_MIN_SPLIT);
    Ok(Box::new(match base {
        "fused" => f,
        "fused-scalar" => f.with_isa(Isa::Scalar)?,
        _ => bail!(
            "unknown backend {name}; backends: reference, fused, fused-scalar (and -tN on fused ones)"
        ),
    }))
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("decode-ab", run)
}

/// One storage configuration under test, decoded by every backend.
struct Arm {
    name: String,
    cache: PagedKvCache,
    seq: Sequence,
    last: Tensor,
    /// Per backend, tokens/s of each round.
    rates: Vec<Vec<f64>>,
}

fn run() -> Result<()> {
    let a = parse_args()?;
    for b in &a.backends {
        backend(b)?;
    }
    let mut out = Output::create(a.out())?;
    let backends = &a.backends;
    let kinds: Vec<(String, Kind)> = a
        .kv_dtypes
        .iter()
        .map(|d| Ok((d.clone(), parse_dtype(d)?)))
        .collect::<Result<_>>()?;
    let article = kvforge_bench::longest_article(&a.text)?;
    let cfg = EngineConfig {
        block_size: a.block_size,
        weight_kind: a.weights.as_deref().map(parse_dtype).transpose()?,
        ..Default::default()
    };
    let engine = Engine::load(&a.common.model, &cfg)
        .with_context(|| format!("loading {}", a.common.model.display()))?;
    let all_ids = engine.tokenizer().encode(&article)?;
    let mut ids = all_ids.clone();
    if ids.len() < a.context {
        bail!(
            "the longest article holds {} tokens, fewer than --context {}",
            ids.len(),
            a.context
        );
    }
    ids.truncate(a.context);
    let capacity = a.context + a.steps * a.rounds * backends.len();
    let model = engine.model();
    let mut arms = prefilled(&a, model, &ids, &kinds, capacity)?;
    race(&a, model, &mut arms)?;
    let (mut md, csv) = table(&a, model, &arms);
    for arm in &mut arms {
        arm.cache.free(&mut arm.seq)?;
    }
    drop(arms);
    if a.batch > 1 {
        let name = backends
            .iter()
            .find(|b| b.starts_with("fused"))
            .unwrap_or(&backends[0]);
        md.push_str(&batched(&a, &engine, &all_ids, name, kinds[0].1)?);
    }
    out.csv("decode.csv", &csv)?;
    out.report(&md)?;
    println!("{md}");
    println!("written to {}", a.out().display());
    Ok(())
}

/// One arm per KV dtype × cold format, each with its own cache holding
/// `ids` (prefilled in chunks of 512) and the logits after them.
fn prefilled(
    a: &Args,
    model: &Llama,
    ids: &[u32],
    kinds: &[(String, Kind)],
    capacity: usize,
) -> Result<Vec<Arm>> {
    let mut specs: Vec<Option<KvQuant>> = vec![None];
    for f in &a.formats {
        specs.push(Some(KvQuant::parse(f)?));
    }
    let mut arms = Vec::new();
    for (dname, kind) in kinds {
        for spec in &specs {
            let mut cache =
                PagedKvCache::new(&model.cfg, a.block_size, capacity, model.device(), *kind)?;
            cache.set_cold_tier(*spec)?;
            let mut seq = Sequence::default();
            let mut last = None;
            for chunk in ids.chunks(512) {
                last = Some(model.forward(chunk, &mut cache.view(&mut seq), false)?);
            }
            let last = last.context("empty context")?;
            let format = spec.map_or_else(|| "unquantized".into(), |q| q.name());
            arms.push(Arm {
                name: format!("{dname} {format}"),
                cache,
                seq,
                last,
                rates: vec![Vec::new(); a.backends.len()],
            });
        }
    }
    Ok(arms)
}

/// `a.rounds` rounds: every arm decodes `a.steps` tokens under each
/// backend in turn, so that machine noise hits all alike.
fn race(a: &Args, model: &Llama, arms: &mut [Arm]) -> Result<()> {
    let backends = &a.backends;
    for _ in 0..a.rounds {
        for arm in arms.iter_mut() {
            for (b, name) in backends.iter().enumerate() {
                arm.cache.set_backend(backend(name)?);
                let t = Instant::now();
                for _ in 0..a.steps {
                    let next = greedy_token(&arm.last)?;
                    arm.last = model.forward(&[next], &mut arm.cache.view(&mut arm.seq), false)?;
                }
                arm.rates[b].push(a.steps as f64 / t.elapsed().as_secs_f64());
            }
        }
    }
    Ok(())
}

/// The report's table and `decode.csv`: each arm's median rate under each
/// backend, against the first arm and against its first backend.
fn table(a: &Args, model: &Llama, arms: &[Arm]) -> (String, Csv) {
    let backends = &a.backends;
    let base = median(arms[0].rates[0].clone());
    let mut md = format!(
        "Decode at {} tokens of context, {} rounds × {} steps per arm, interleaved, medians (block {}, compute {:?}, weights {}, {} kernel).\n\n\
         | KV cache | backend | decode tok/s | × first row | × {} on this cache | KV MiB (hot + cold) |\n|---|---|---:|---:|---:|---:|\n",
        a.context,
        a.rounds,
        a.steps,
        a.block_size,
        model.kind(),
        a.weights.as_deref().unwrap_or("in the compute dtype"),
        Isa::detect().name(),
        backends[0]
    );
    let mut csv = Csv::new(&[
        "kv_cache",
        "backend",
        "decode_tok_s",
        "vs_first_row",
        "vs_first_backend",
        "hot_bytes",
        "cold_bytes",
    ]);
    for arm in arms {
        let (hot, cold) = arm.cache.tier_bytes();
        let own = median(arm.rates[0].clone());
        for (b, bname) in backends.iter().enumerate() {
            let rate = median(arm.rates[b].clone());
            csv.row([
                arm.name.clone(),
                bname.clone(),
                format!("{rate:.3}"),
                format!("{:.4}", rate / base),
                format!("{:.4}", rate / own),
                hot.to_string(),
                cold.to_string(),
            ]);
            let _ = writeln!(
                md,
                "| {} | {bname} | {rate:.2} | {:.2} | {:.2} | {:.1} ({:.1} + {:.1}) |",
                arm.name,
                rate / base,
                rate / own,
                (hot + cold) as f64 / 1048576.0,
                hot as f64 / 1048576.0,
                cold as f64 / 1048576.0
            );
        }
    }
    (md, csv)
}

/// Batch 1 against batch `a.batch`, interleaved, on the same sequences.
/// Its section of the report.
fn batched(
    a: &Args,
    engine: &Engine,
    ids: &[u32],
    backend_name: &str,
    kind: Kind,
) -> Result<String> {
    let (b, ctx) = (a.batch, a.batch_context);
    let stride = 512.min(ctx);
    if ids.len() < (b - 1) * stride + ctx {
        bail!(
            "the longest article holds {} tokens, fewer than --batch {b} slices of --batch-context {ctx}",
            ids.len()
        );
    }
    let model = engine.model();
    let capacity = b * (ctx + 2 * a.steps * a.rounds + a.block_size);
    let mut cache = PagedKvCache::new(&model.cfg, a.block_size, capacity, model.device(), kind)?;
    cache.set_backend(backend(backend_name)?);
    let mut seqs: Vec<Sequence> = (0..b).map(|_| Sequence::default()).collect();
    let mut next = Vec::with_capacity(b);
    for (i, s) in seqs.iter_mut().enumerate() {
        let slice = &ids[i * stride..i * stride + ctx];
        let mut last = None;
        for chunk in slice.chunks(512) {
            last = Some(model.forward(chunk, &mut cache.view(s), false)?);
        }
        next.push(greedy_token(&last.context("empty context")?)?);
    }
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..a.rounds {
        let t = Instant::now();
        for _ in 0..a.steps {
            for (s, tok) in seqs.iter_mut().zip(next.iter_mut()) {
                let logits = model.forward(&[*tok], &mut cache.view(s), false)?;
                *tok = greedy_token(&logits)?;
            }
        }
        one.push((b * a.steps) as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..a.steps {
            let mut views: Vec<_> = seqs.iter_mut().map(|s| cache.view(s)).collect();
            let mut stores: Vec<&mut dyn KvStore> =
                views.iter_mut().map(|v| v as &mut dyn KvStore).collect();
            let logits = model.forward_batch(&next, &mut stores)?;
            for (i, tok) in next.iter_mut().enumerate() {
                *tok = greedy_token(&logits.f_narrow(0, i as i64, 1)?)?;
            }
        }
        many.push((b * a.steps) as f64 / t.elapsed().as_secs_f64());
    }
    let (one, many) = (median(one), median(many));
    let md = format!(
        "\nBatched decode: {b} sequences of {ctx} tokens (slices of the article {stride} tokens apart), {} KV, {backend_name} backend; {} rounds × {} steps, interleaved, medians.\n\n\
         | decode | tok/s (all sequences) | × one by one |\n|---|---:|---:|\n\
         | one by one | {one:.2} | 1.00 |\n| batch {b} | {many:.2} | {:.2} |\n",
        a.kv_dtypes[0],
        a.rounds,
        a.steps,
        many / one
    );
    for s in &mut seqs {
        cache.free(s)?;
    }
    Ok(md)
}
