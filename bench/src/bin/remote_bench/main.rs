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

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use kvforge_bench::cli::{self, Common};
use kvforge_bench::median;
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::cache::RemoteSetup;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, Kind, KvQuant, ReuseConfig, SamplingParams,
};
use kvforge_remote::{ExtraKeys, RemoteOptions, RemoteTier, Secret, blob};
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

/// Part 1 for one format: medians of (recompute, remote, local) TTFT and
/// the bytes read per token hit.
fn ttft(
    a: &Args,
    url: &str,
    text: &str,
    cold: bool,
    len: usize,
    csv: &mut Csv,
) -> Result<[f64; 4]> {
    let first = instance(a, cold, Some(url))?;
    let prompt = tokens(&first, text, 0, len)?;
    complete(&first, &prompt, 1)?;
    if !first.engine().cache().remote_flush(Duration::from_secs(60)) {
        bail!("the first instance's writes did not finish in 60 s");
    }
    let (mut re, mut rh, mut lh, mut bytes) = (vec![], vec![], vec![], vec![]);
    let format = format!("{}@{len}", if cold { "int4" } else { "f16" });
    for round in 0..a.rounds {
        let cold_start = instance(a, cold, None)?;
        let (t_re, reused, _) = complete(&cold_start, &prompt, 1)?;
        drop(cold_start);
        let second = instance(a, cold, Some(url))?;
        let (t_rh, got, _) = complete(&second, &prompt, 1)?;
        let st = second.engine().cache().remote_stats().unwrap_or_default();
        if reused != 0 || got + 16 < len {
            bail!("round {round}: recompute reused {reused}, remote hit only {got} of {len}");
        }
        drop(second);
        let (t_lh, _, _) = complete(&first, &prompt, 1)?;
        let per_token = st.bytes_in as f64 / st.hit_tokens.max(1) as f64;
        for (arm, t) in [("recompute", t_re), ("remote", t_rh), ("local", t_lh)] {
            csv.row([
                format.as_str(),
                arm,
                &round.to_string(),
                &format!("{t:.4}"),
                &format!("{per_token:.0}"),
            ]);
        }
        re.push(t_re);
        rh.push(t_rh);
        lh.push(t_lh);
        bytes.push(per_token);
    }
    Ok([median(re), median(rh), median(lh), median(bytes)])
}

/// Part 2: (put blocks/s, get blocks/s, blob bytes) for blobs of
/// `payload` bytes.
fn throughput(
    url: &str,
    blocks: usize,
    payload: u64,
    format: &str,
    round: usize,
) -> Result<(f64, f64, usize)> {
    let t = tier(url)?;
    let scope = kvforge_remote::Scope {
        seed: SEED,
        model: 0xbe9c,
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        block_size: 16,
        format: format!("bench-{format}"),
        payload_bytes: payload,
    };
    let toks: Vec<u32> = (0..(blocks * 16) as u32).collect();
    // Fresh keys every round.
    let ns = format!("bench-{}-{round}", std::process::id());
    let secret = secret()?;
    let links = scope.chain(&secret, &toks, &ExtraKeys::namespace(ns));
    let body = vec![0x5au8; payload as usize];
    let items: Vec<_> = links
        .iter()
        .enumerate()
        .map(|(i, l)| {
            (
                l.key,
                blob::seal(&secret, &scope, *l, &toks[i * 16..(i + 1) * 16], &body),
            )
        })
        .collect();
    let size = items[0].1.len();
    let t0 = Instant::now();
    for chunk in items.chunks(32) {
        t.put_many(chunk).map_err(|e| anyhow!("put: {e}"))?;
    }
    let put = blocks as f64 / t0.elapsed().as_secs_f64();
    let keys: Vec<_> = links.iter().map(|l| l.key).collect();
    let t0 = Instant::now();
    for chunk in keys.chunks(32) {
        let got = t.get_many(chunk).map_err(|e| anyhow!("get: {e}"))?;
        if got.iter().any(Option::is_none) {
            bail!("a block written was not read back");
        }
    }
    let get = blocks as f64 / t0.elapsed().as_secs_f64();
    Ok((put, get, size))
}

/// Part 3: median decode tokens/s without and with the tier.
fn decode(a: &Args, url: &str, text: &str, csv: &mut Csv) -> Result<(f64, f64)> {
    let (off, on) = (instance(a, false, None)?, instance(a, false, Some(url))?);
    let (mut r_off, mut r_on) = (vec![], vec![]);
    for round in 0..a.rounds {
        for (arm, m, rates) in [("off", &off, &mut r_off), ("on", &on, &mut r_on)] {
            for q in 0..a.requests {
                // Distinct prompts every round and arm: nothing is a hit.
                let skip =
                    20_000 + (round * 2 * a.requests + q) * 3000 + usize::from(arm == "on") * 1500;
                let prompt = tokens(m, text, skip, 512)?;
                let (_, _, rate) = complete(m, &prompt, a.decode)?;
                csv.row(["decode", arm, &round.to_string(), &format!("{rate:.2}"), ""]);
                rates.push(rate);
            }
        }
    }
    on.engine().cache().remote_flush(Duration::from_secs(60));
    let st = on.engine().cache().remote_stats().unwrap_or_default();
    if st.put_blocks == 0 {
        bail!("the writing instance wrote nothing: {st:?}");
    }
    Ok((median(r_off), median(r_on)))
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
    ttft_table(&a, &url, &text, &mut csv, &mut md, &mut out)?;
    throughput_table(&a, &redis, &mut csv, &mut md)?;
    let (off, on) = decode(&a, &url, &text, &mut csv)?;
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

/// Part 1's table and plot: every prompt length × format, interleaved
/// arms, medians.
fn ttft_table(
    a: &Args,
    url: &str,
    text: &str,
    csv: &mut Csv,
    md: &mut String,
    out: &mut Output,
) -> Result<()> {
    writeln!(
        md,
        "## Time to first token on a second instance (median of {} rounds)\n",
        a.rounds
    )?;
    writeln!(
        md,
        "| blocks | prompt tokens | recompute s | remote hit s | local hit s | remote / recompute | remote / local | bytes read per token |"
    )?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut per_token = [0.0; 2];
    for (f, cold) in [false, true].into_iter().enumerate() {
        let name = if cold { "int4" } else { "f16" };
        let mut lines = [Vec::new(), Vec::new(), Vec::new()];
        for &len in &a.prompts {
            let [re, rh, lh, b] = ttft(a, url, text, cold, len, csv)?;
            writeln!(
                md,
                "| {name} | {len} | {re:.3} | {rh:.3} | {lh:.3} | {:.3}× | {:.2}× | {b:.0} |",
                rh / re,
                rh / lh
            )?;
            for (line, t) in lines.iter_mut().zip([re, rh, lh]) {
                line.push((len as f64, t * 1e3));
            }
            per_token[f] = b;
        }
        for (arm, line) in ["recompute", "remote hit", "local hit"].iter().zip(lines) {
            series.push((format!("{name} {arm}"), line));
        }
    }
    writeln!(
        md,
        "\nINT4 blocks (the sink's at f16) move {:.2}× fewer bytes per token than f16.\n",
        per_token[0] / per_token[1].max(1.0)
    )?;
    let max_len = a.prompts.iter().max().copied().unwrap_or(1) as f64;
    let max_ms = series
        .iter()
        .flat_map(|(_, l)| l.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, l)| (n.as_str(), l.clone()))
        .collect();
    out.png("ttft.png", |path| {
        kvforge_bench::plot::line_plot(
            path,
            "Second instance: time to first token",
            "prompt tokens",
            "ms",
            (0.0, max_len * 1.05),
            (0.0, max_ms * 1.1),
            &named,
        )
    })?;
    writeln!(md, "![time to first token](ttft.png)\n")?;
    Ok(())
}

/// Part 2's table: both formats, `--rounds` interleaved rounds, medians.
fn throughput_table(a: &Args, redis: &RedisServer, csv: &mut Csv, md: &mut String) -> Result<()> {
    writeln!(
        md,
        "## Throughput of the tier alone ({} blocks, batches of 32, median of {} interleaved rounds)\n",
        a.blocks, a.rounds
    )?;
    writeln!(
        md,
        "| format | blob bytes | put blocks/s | put MB/s | get blocks/s | get MB/s |\n|---|---:|---:|---:|---:|---:|"
    )?;
    // SmolLM2-135M: 30 layers × 3 KV heads × 64 × 16 tokens, K and V.
    let formats = [
        ("f16", 2 * 30 * 3 * 64 * 16 * 2u64),
        ("int4", int4_payload()),
    ];
    let mut rates = vec![(Vec::new(), Vec::new(), 0usize); formats.len()];
    for round in 0..a.rounds {
        for (i, (format, payload)) in formats.iter().enumerate() {
            // Each run on an empty store (the first parts' blocks gone too).
            redis.command(&["FLUSHALL"]).map_err(|e| anyhow!(e))?;
            let (put, get, size) = throughput(&redis.url(), a.blocks, *payload, format, round)?;
            csv.row(["put", format, &round.to_string(), &format!("{put:.0}"), ""]);
            csv.row(["get", format, &round.to_string(), &format!("{get:.0}"), ""]);
            rates[i].0.push(put);
            rates[i].1.push(get);
            rates[i].2 = size;
        }
    }
    for ((format, _), (puts, gets, size)) in formats.iter().zip(rates) {
        let (put, get) = (median(puts), median(gets));
        let mb = |r: f64| r * size as f64 / 1e6;
        writeln!(
            md,
            "| {format} | {size} | {put:.0} | {:.0} | {get:.0} | {:.0} |",
            mb(put),
            mb(get)
        )?;
    }
    Ok(())
}

/// Bytes of one INT4 cold block of SmolLM2-135M (KIVI keys per channel in
/// groups of the block, values per token in groups of 32), as the engine
/// stores it: what the throughput part writes.
fn int4_payload() -> u64 {
    let (layers, heads, dim, bs) = (30u64, 3, 64, 16);
    let codes = heads * dim * bs / 2;
    let key_groups = heads * dim;
    let value_groups = bs * heads * dim / 32;
    layers * (2 * codes + 4 * key_groups + 4 * value_groups)
}
