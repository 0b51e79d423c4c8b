//! The measurements: a second instance's time to first token from the
//! remote tier against recompute and a local hit, the tier's throughput,
//! and decode speed while the tier is written; their tables.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use kvforge_bench::median;
use kvforge_bench::output::{Csv, Output};
use kvforge_remote::{ExtraKeys, RemoteTier, blob};
use kvforge_remote_redis::RedisServer;

use crate::{Args, SEED, complete, instance, secret, tier, tokens};

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
pub(crate) fn decode(a: &Args, url: &str, text: &str, csv: &mut Csv) -> Result<(f64, f64)> {
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

/// Part 1's table and plot: every prompt length × format, interleaved
/// arms, medians.
pub(crate) fn ttft_table(
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
pub(crate) fn throughput_table(
    a: &Args,
    redis: &RedisServer,
    csv: &mut Csv,
    md: &mut String,
) -> Result<()> {
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
