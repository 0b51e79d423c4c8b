//! Tiered KV quantization on real text (`cargo xtask quant-sweep`).
//!
//! For each context length, streams the longest article of `wiki.utf8`
//! through the engine (prefill `--prefix` tokens, then score the rest in
//! chunks of `--chunk`), first with the unquantized cache, then with a
//! quantized cold tier for every hot window N × format × key rotation; then
//! times `--decode` greedy steps at the final context. Reports perplexity
//! and its change, peak KV bytes per tier, and decode speed.
//!
//! Writes `sweep.csv`, `report.md` and `pareto_<context>.png` (perplexity
//! change against KV bytes) to the output directory.

#![allow(clippy::print_stdout)] // a report printer

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Common};
use kvforge_bench::longest_article;
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::{Axis, Engine, EngineConfig, KvQuant, PplReport};

/// Tiered KV quantization on real text: perplexity, KV bytes and decode
/// speed for every hot window × cold format × key rotation.
#[derive(Parser)]
#[command(name = "quant-sweep")]
struct Args {
    /// Context lengths to score at.
    #[arg(long, value_delimiter = ',', default_values_t = [4096, 8192])]
    contexts: Vec<usize>,
    /// Hot windows (tokens kept in f16 before the cold tier).
    #[arg(long, value_delimiter = ',', default_values_t = [0, 128, 512, 1024, 2048, 4096])]
    windows: Vec<usize>,
    /// Cold formats.
    #[arg(long, value_delimiter = ',', default_values_t = ["int8".to_string(), "int4".into(), "int2".into()])]
    formats: Vec<String>,
    /// The Hadamard rotation of keys: off, on or both.
    #[arg(long, value_enum, default_value_t = Rotate::Both)]
    rotate: Rotate,
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Quantization group (channels per scale).
    #[arg(long, default_value_t = 32)]
    group: usize,
    /// Keys quantized per channel or per token.
    #[arg(long, value_enum, default_value_t = Keys::Channel)]
    keys: Keys,
    /// Tokens kept hot at the start.
    #[arg(long, default_value_t = 32)]
    sink: usize,
    /// Tokens prefilled before scoring.
    #[arg(long, default_value_t = 512)]
    prefix: usize,
    /// Tokens per scored chunk.
    #[arg(long, default_value_t = 64)]
    chunk: usize,
    /// Greedy decode steps timed at the final context.
    #[arg(long, default_value_t = 16)]
    decode: usize,
    /// Weight dtype.
    #[arg(long, default_value = "f32")]
    weights: String,
    /// The text to stream (its longest article).
    #[arg(long, default_value = "data/exllamav2/wiki.utf8")]
    text: PathBuf,
    #[command(flatten)]
    common: Common,
}

#[derive(Clone, Copy, ValueEnum)]
enum Rotate {
    Off,
    On,
    Both,
}

#[derive(Clone, Copy, ValueEnum)]
enum Keys {
    Channel,
    Token,
}

impl Args {
    fn rotations(&self) -> Vec<bool> {
        match self.rotate {
            Rotate::Off => vec![false],
            Rotate::On => vec![true],
            Rotate::Both => vec![false, true],
        }
    }

    fn key_axis(&self) -> Axis {
        match self.keys {
            Keys::Channel => Axis::PerChannel,
            Keys::Token => Axis::PerToken,
        }
    }

    fn out(&self) -> PathBuf {
        self.common.out_or("target/quant-sweep")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if let Some(&c) = a.contexts.iter().find(|&&c| c <= a.prefix + a.decode) {
        bail!(
            "context {c} leaves nothing to score after --prefix {} and --decode {}",
            a.prefix,
            a.decode
        );
    }
    Ok(a)
}

/// One measured configuration.
struct Row {
    context: usize,
    quant: Option<KvQuant>,
    r: PplReport,
}

impl Row {
    fn format(&self) -> String {
        self.quant
            .map_or_else(|| "none".into(), |q| format!("int{}", q.bits))
    }
    fn window(&self) -> String {
        self.quant
            .map_or_else(|| "all".into(), |q| q.window.to_string())
    }
    fn rotate(&self) -> bool {
        self.quant.is_some_and(|q| q.rotate)
    }
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("quant-sweep", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let article = longest_article(&a.text)?;
    let cfg = EngineConfig {
        weight_kind: Some(kvforge_engine::parse_dtype(&a.weights)?),
        block_size: a.block_size,
        ..Default::default()
    };
    let mut engine = Engine::load(&a.common.model, &cfg)
        .with_context(|| format!("loading {}", a.common.model.display()))?;
    let all = engine.tokenizer().encode(&article)?;
    // Every configuration is checked before the long runs start.
    let mut plan: Vec<(usize, Option<KvQuant>)> = Vec::new();
    for &ctx in &a.contexts {
        if all.len() < ctx {
            bail!(
                "the longest article of {} holds {} tokens, fewer than context {ctx}",
                a.text.display(),
                all.len()
            );
        }
        plan.push((ctx, None));
        for &window in &a.windows {
            // A window that keeps every token hot is the baseline itself.
            if a.sink + window + a.block_size > ctx {
                continue;
            }
            for f in &a.formats {
                for &rotate in &a.rotations() {
                    let q = KvQuant {
                        window,
                        group_size: a.group,
                        rotate,
                        key_axis: a.key_axis(),
                        sink: a.sink,
                        ..KvQuant::parse(f)?
                    };
                    engine.cache_mut().set_cold_tier(Some(q))?;
                    plan.push((ctx, Some(q)));
                }
            }
        }
    }
    let mut out = Output::create(a.out())?;
    let bar = ProgressBar::new(plan.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows: Vec<Row> = Vec::new();
    for (ctx, quant) in plan {
        bar.set_message(format!(
            "{ctx} tokens, {}",
            quant.map_or_else(|| "unquantized".into(), |q| q.name())
        ));
        engine.cache_mut().set_cold_tier(quant)?;
        // The last `decode` positions are decoded, not scored.
        let r = engine.streaming_ppl(&all[..ctx - a.decode], a.prefix, a.chunk, a.decode)?;
        rows.push(Row {
            context: ctx,
            quant,
            r,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    write_outputs(&a, &rows, &mut out)
}

fn write_outputs(a: &Args, rows: &[Row], out: &mut Output) -> Result<()> {
    let base = |ctx: usize| rows.iter().find(|r| r.context == ctx && r.quant.is_none());
    let mut csv = Csv::new(&[
        "context",
        "format",
        "window",
        "rotate",
        "ppl",
        "ppl_change",
        "kv_bytes",
        "hot_bytes",
        "cold_bytes",
        "kv_bytes_per_token",
        "kv_cut_vs_f32",
        "kv_cut_vs_f16",
        "decode_tok_s",
        "decode_ratio",
        "tok_s",
    ]);
    let mut md = format!(
        "Streaming perplexity of the longest `wiki.utf8` article (SmolLM2-135M, {} weights, f32 compute and hot tier, \
         block {}, prefix {}, chunk {}; values per token in groups of {}, keys {}; first {} tokens kept hot; then {} greedy decode steps). \
         KV bytes are the peak held (hot pool blocks + quantized cold tier); the f16 column compares with an \
         unquantized f16 cache (half the f32 bytes).\n",
        a.weights,
        a.block_size,
        a.prefix,
        a.chunk,
        a.group,
        match a.key_axis() {
            Axis::PerChannel => "per channel over each block's tokens (KIVI)",
            Axis::PerToken => "per token like values",
        },
        a.sink,
        a.decode
    );
    for &ctx in &a.contexts {
        let Some(b) = base(ctx) else { continue };
        md.push_str(&format!(
            "\n### Context {ctx} (unquantized: ppl {:.4}, {:.1} MiB KV, decode {:.2} tok/s)\n\n\
             | format | window N | rotate | ppl | change | KV MiB (hot + cold) | B/token | cut vs f32 | cut vs f16 | decode tok/s | × unquantized |\n\
             |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            b.r.ppl,
            mib(b.r.kv_bytes),
            b.r.decode_tokens_per_sec
        ));
        for row in rows.iter().filter(|r| r.context == ctx) {
            let r = &row.r;
            let change = r.ppl / b.r.ppl - 1.0;
            let cut32 = 1.0 - r.kv_bytes as f64 / b.r.kv_bytes as f64;
            let cut16 = 1.0 - r.kv_bytes as f64 / (b.r.kv_bytes as f64 / 2.0);
            let ratio = r.decode_tokens_per_sec / b.r.decode_tokens_per_sec.max(1e-9);
            csv.row([
                ctx.to_string(),
                row.format(),
                row.window().to_string(),
                row.rotate().to_string(),
                format!("{:.6}", r.ppl),
                format!("{change:.6}"),
                r.kv_bytes.to_string(),
                r.hot_bytes.to_string(),
                r.cold_bytes.to_string(),
                format!("{:.1}", r.kv_bytes_per_token),
                format!("{cut32:.4}"),
                format!("{cut16:.4}"),
                format!("{:.3}", r.decode_tokens_per_sec),
                format!("{ratio:.3}"),
                format!("{:.1}", r.tokens_per_sec),
            ]);
            md.push_str(&format!(
                "| {} | {} | {} | {:.4} | {:+.3}% | {:.1} ({:.1} + {:.1}) | {:.0} | {:.1}% | {:.1}% | {:.2} | {:.2} |\n",
                row.format(),
                row.window(),
                if row.rotate() { "yes" } else { "no" },
                r.ppl,
                100.0 * change,
                mib(r.kv_bytes),
                mib(r.hot_bytes),
                mib(r.cold_bytes),
                r.kv_bytes_per_token,
                100.0 * cut32,
                100.0 * cut16,
                r.decode_tokens_per_sec,
                ratio
            ));
        }
        pareto(a, rows, ctx, b, out)?;
    }
    out.csv("sweep.csv", &csv)?;
    out.report(&md)?;
    println!("{md}");
    println!("written to {}", a.out().display());
    Ok(())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Perplexity change (%) against KV bytes (% of the unquantized f32
/// cache), one line per format × rotation through its windows.
fn pareto(a: &Args, rows: &[Row], ctx: usize, base: &Row, out: &mut Output) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for f in &a.formats {
        for &rot in &a.rotations() {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.context == ctx && r.format() == *f && r.rotate() == rot)
                .map(|r| {
                    (
                        100.0 * r.r.kv_bytes as f64 / base.r.kv_bytes as f64,
                        100.0 * (r.r.ppl / base.r.ppl - 1.0),
                    )
                })
                .collect();
            pts.sort_by(|p, q| p.0.total_cmp(&q.0));
            let name = if rot {
                format!("{f} + rotation")
            } else {
                f.clone()
            };
            series.push((name, pts));
        }
    }
    let ys = series.iter().flat_map(|s| s.1.iter().map(|p| p.1));
    let (lo, hi) = ys.fold((0.0f64, 0.0f64), |(l, h), y| (l.min(y), h.max(y)));
    let pad = (hi - lo).max(0.1) * 0.05;
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    out.png(&format!("pareto_{ctx}.png"), |path| {
        kvforge_bench::plot::line_plot(
            path,
            &format!("Perplexity change vs KV bytes, {ctx}-token context"),
            "KV bytes, % of the unquantized f32 cache",
            "perplexity change, %",
            (0.0, 100.0),
            (lo - pad, hi + pad),
            &named,
        )
    })?;
    Ok(())
}
