//! The shared remote tier on a real `redis-server` this program starts on
//! a loopback port (`cargo xtask remote-bench`):
//!
//! 1. **Time to first token** of `--prompts`-token prompts (default 256,
//!    512, 1024, 2048, from `--text`) on a second instance whose local
//!    cache is empty: its
//!    prefix imported from Redis ("remote hit") against computing it
//!    ("recompute", a fresh instance without the tier) and against the
//!    first instance's own local prefix hit — for blocks at the KV dtype
//!    (`f16`) and as the INT4 cold tier's bytes. `--rounds` rounds, the
//!    three arms interleaved in each; medians, and a plot against the
//!    prompt length. Bytes read per token hit.
//! 2. **Throughput of the tier alone**: `put_many` / `get_many` of
//!    `--blocks` blobs of each format, in batches of 32, on an emptied
//!    store, formats interleaved over `--rounds` rounds; median blocks/s
//!    and MB/s.
//! 3. **Decode speed of an instance that writes**: `--requests` requests
//!    of `--decode` greedy tokens on distinct prompts, on an instance with
//!    the tier (each request's blocks queued for writing behind while the
//!    next one decodes) and one without, alternating, `--rounds` rounds;
//!    median decode tokens/s and their ratio.
//!
//! Prints a Markdown report and writes it with `remote.csv` to `--out`
//! (default `target/remote-bench`).

#![allow(clippy::print_stdout)] // a report printer

mod measure;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use kvforge_bench::cli::{self, Common};
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::cache::RemoteSetup;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, Kind, KvQuant, ReuseConfig, SamplingParams,
};
use kvforge_remote::{RemoteOptions, Secret};
use kvforge_remote_redis::{RedisConfig, RedisServer, RedisTier};

/// Time to first token with and without a remote KV tier on Redis.
#[derive(Parser)]
#[command(name = "remote-bench")]
struct Args {
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_values_t = [256, 512, 1024, 2048], value_parser = cli::positive)]
    prompts: Vec<usize>,
    /// Rounds (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = cli::positive)]
    rounds: usize,
    /// KV blocks of each engine's hot tier.
    #[arg(long, default_value_t = 2048, value_parser = cli::positive)]
    blocks: usize,
    /// Requests per round.
    #[arg(long, default_value_t = 4, value_parser = cli::positive)]
    requests: usize,
    /// Tokens decoded per request.
    #[arg(long, default_value_t = 64, value_parser = cli::positive)]
    decode: usize,
    /// The text prompts are cut from.
    #[arg(long, default_value = "data/exllamav2/wiki.utf8")]
    text: PathBuf,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/remote-bench")
    }
}

fn parse_args() -> Result<Args> {
    cli::parse()
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("remote-bench", run)
}

const SEED: u64 = 42;

/// The secret this benchmark's instances share (its store is its own).
fn secret() -> Result<Secret> {
    Ok(Secret::new(b"kvforge remote-bench: its own store")?)
}

/// An instance: the model with an f16 KV cache (INT4 cold tier when
/// `cold`), prefix reuse on, and the tier on `url` when given.
fn instance(a: &Args, cold: bool, url: Option<&str>) -> Result<CacheManager> {
    let cfg = EngineConfig {
        kv_kind: Some(Kind::Half),
        kv_tokens: a.prompts.iter().max().copied().unwrap_or(0) + 4 * a.decode + 512,
        kv_quant: cold.then(|| KvQuant::parse("int4")).transpose()?,
        ..EngineConfig::default()
    };
    let mut e = Engine::load(&a.common.model, &cfg)?;
    if let Some(url) = url {
        let model = e.fingerprint()?;
        e.cache_mut().set_remote(Some(RemoteSetup {
            store: Arc::new(tier(url)?),
            secret: secret()?,
            seed: SEED,
            model,
            cold,
            options: RemoteOptions::default(),
        }))?;
    }
    Ok(CacheManager::new(e, ReuseConfig::default())?)
}

fn tier(url: &str) -> Result<RedisTier> {
    RedisTier::new(RedisConfig {
        urls: vec![url.into()],
        cluster: false,
        ttl: Some(Duration::from_secs(3600)),
        deadline: Duration::from_secs(5),
    })
    .map_err(|e| anyhow!(e))
}

/// Greedy `max_tokens` tokens of `prompt`: (ttft s, reused tokens, decode
/// tokens/s).
fn complete(m: &CacheManager, prompt: &[u32], max_tokens: usize) -> Result<(f64, usize, f64)> {
    let p = SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let r = m.complete(prompt, "", &p, &mut |_, _| true)?;
    let g = &r.generation;
    let rate = (g.tokens.len().saturating_sub(1)) as f64 / g.decode_secs.max(1e-9);
    Ok((r.ttft_secs, r.reused_tokens, rate))
}

/// `n` tokens of the text, from its `skip`-th character on.
fn tokens(m: &CacheManager, text: &str, skip: usize, n: usize) -> Result<Vec<u32>> {
    let t: String = text.chars().skip(skip).collect();
    let ids = m.engine().tokenizer().encode_text(&t)?;
    if ids.len() < n {
        bail!("the text gives {} tokens, fewer than {n}", ids.len());
    }
    Ok(ids[..n].to_vec())
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let mut out = Output::create(a.out())?;
    let text = std::fs::read_to_string(&a.text).with_context(|| a.text.display().to_string())?;
    let redis = RedisServer::start(&[]).map_err(|e| anyhow!(e))?;
    let url = redis.url();
    let mut csv = Csv::new(&["experiment", "arm", "round", "value", "bytes_per_token"]);
    let mut md = String::new();
    writeln!(md, "# Remote tier on one redis-server (loopback)\n")?;
    measure::ttft_table(&a, &url, &text, &mut csv, &mut md, &mut out)?;
    measure::throughput_table(&a, &redis, &mut csv, &mut md)?;
    let (off, on) = measure::decode(&a, &url, &text, &mut csv)?;
    writeln!(
        md,
        "\n## Decode speed of the writing instance ({} requests × {} tokens per round)\n",
        a.requests, a.decode
    )?;
    writeln!(
        md,
        "| tier off tok/s | tier on tok/s | on / off |\n|---:|---:|---:|\n| {off:.2} | {on:.2} | {:.3}× |",
        on / off
    )?;
    out.csv("remote.csv", &csv)?;
    let path = out.report(&md)?;
    println!("{md}\nwritten: {}", path.display());
    Ok(())
}
