//! Two comparisons: conversations over a KV budget that holds half of
//! their KV (kvforge with the INT4 cold tier, kvforge hot-only, and
//! llama-server given the same memory), and one stream through the
//! server against `kvforge bench` on the same prompt.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvforge_engine::Tokenizer;
use kvforge_engine::gguf::GgufFile;
use kvforge_server::client;
use serde_json::{Value, json};

use super::replay::Load;
use super::run::{Summary, measure, median, series};
use super::servers::LlamaSpec;
use super::{Common, progress, warm_up};
use kvforge_ablate::output::{Csv, Output};

/// KV bytes per token and per block of kvforge's hot tier, read off a
/// run's metrics.
fn block_bytes(metrics: &str) -> Result<f64> {
    let bytes = series(metrics, "kvforge:kv_bytes_in_use");
    let blocks = series(metrics, "kvforge:kv_blocks_in_use");
    let hot = |v: &[(String, f64)]| v.iter().find(|r| r.0.contains("tier=\"hot\"")).map(|r| r.1);
    match (hot(&bytes), hot(&blocks)) {
        (Some(b), Some(n)) if n > 0.0 => Ok(b / n),
        _ => bail!("no hot blocks in use to size a block from"),
    }
}

/// kvforge's count of preempted requests.
fn preemptions(metrics: &str) -> f64 {
    series(metrics, "kvforge:num_preemptions_total")
        .first()
        .map_or(0.0, |r| r.1)
}

/// The comparison's table: `budget.csv`, and the report's rows.
struct Table {
    csv: Csv,
    lines: String,
    budget_mib: u64,
    concurrency: usize,
}

impl Table {
    fn new(budget_mib: u64, concurrency: usize) -> Table {
        let csv = Csv::new(&[
            "server",
            "budget_mib",
            "completed",
            "conversations",
            "errors",
            "tok_s",
            "ttft_p50_ms",
            "peak_hot_mib",
            "peak_cold_mib",
            "preemptions",
            "first_error",
        ]);
        Table {
            csv,
            lines: String::new(),
            budget_mib,
            concurrency,
        }
    }

    /// One server's run.
    fn record(&mut self, name: &str, s: &Summary, preempted: Option<f64>) {
        let mib = |b: f64| b / f64::from(1u32 << 20);
        let first = s.errors.first().cloned().unwrap_or_default();
        let cold = s.cold_peak();
        let pre = preempted.map_or_else(|| "–".to_string(), |p| format!("{p:.0}"));
        self.csv.row([
            name.to_string(),
            self.budget_mib.to_string(),
            s.completed.to_string(),
            self.concurrency.to_string(),
            s.errors.len().to_string(),
            format!("{:.2}", s.tok_s()),
            format!("{:.0}", s.ttft_ms(0.5)),
            format!("{:.1}", mib(s.peak("hot"))),
            format!("{:.1}", mib(cold)),
            pre.clone(),
            first.clone(),
        ]);
        let concurrency = self.concurrency;
        let _ = writeln!(
            self.lines,
            "| {name} | {}/{concurrency} | {} | {:.1} | {:.0} | {:.1} + {:.1} | {pre} | {} |",
            s.completed,
            s.errors.len(),
            s.tok_s(),
            s.ttft_ms(0.5),
            mib(s.peak("hot")),
            mib(cold),
            first
                .chars()
                .take(120)
                .collect::<String>()
                .replace('|', "/")
        );
    }
}

/// Pass 1, no budget: the conversations' run, the bytes of a hot block
/// (read off the metrics while one long request holds blocks) and the
/// preemptions.
fn unconstrained(
    c: &Common,
    convs: &[Vec<String>],
    concurrency: usize,
    load: &Load,
) -> Result<(Summary, f64, f64)> {
    let full = c.kvforge(&[
        "--max-batch".into(),
        concurrency.to_string(),
        "--kv-tokens".into(),
        "65536".into(),
    ]);
    let server = full.start(&c.log("kvforge-full.log"))?;
    let mut probe = client::post_json(
        &server.addr,
        "/v1/completions",
        &[],
        &json!({"model": server.model_id, "prompt": "Tell me a long story.", "max_tokens": 200,
                "ignore_eos": true, "stream": true}),
        Duration::from_secs(120),
    )?
    .events();
    probe.next();
    let per_block = block_bytes(&server.metrics())?;
    probe.close();
    let s_full = measure(&server, convs, concurrency, load, &|_| false);
    let full_preempted = preemptions(&server.metrics());
    server.stop();
    if !s_full.errors.is_empty() {
        bail!("the unconstrained run failed: {:?}", s_full.errors.first());
    }
    Ok((s_full, per_block, full_preempted))
}

/// kvforge over `budget_mib`, with the INT4 cold tier or hot only: the
/// run and its preemptions.
fn over_budget(
    c: &Common,
    out: &Output,
    (name, cold): (&str, bool),
    budget_mib: u64,
    convs: &[Vec<String>],
    concurrency: usize,
    load: &Load,
) -> Result<(Summary, f64)> {
    let cfg = out.dir().join(if cold { "int4.toml" } else { "hot.toml" });
    let mut toml = format!(
        "prefix = {{ index = \"hash-chain\", tail = \"copy\" }}\nbudget_mib = {budget_mib}\n"
    );
    if cold {
        toml.push_str("cold = { format = \"int4\", window = 64, sink = 16 }\n");
    }
    std::fs::write(&cfg, toml).with_context(|| format!("writing {}", cfg.display()))?;
    let spec = Common {
        config: Some(cfg),
        ..c.clone()
    }
    .kvforge(&[
        "--max-batch".into(),
        concurrency.to_string(),
        "--kv-tokens".into(),
        "65536".into(),
    ]);
    let server = spec.start(&c.log(&format!(
        "{}.log",
        if cold { "kvforge-int4" } else { "kvforge-hot" }
    )))?;
    warm_up(&server);
    let s = measure(&server, convs, concurrency, load, &|_| false);
    let preempted = preemptions(&server.metrics());
    server.stop();
    progress(&format!(
        "{name}: {}/{concurrency} conversations complete, {} errors",
        s.completed,
        s.errors.len()
    ));
    Ok((s, preempted))
}

/// Runs the half-budget comparison; writes `budget.csv` and `report.md`.
pub fn budget(
    c: &Common,
    concurrency: usize,
    llama: Option<&LlamaSpec>,
    out: &mut Output,
) -> Result<()> {
    let convs = c.chats(concurrency)?;
    let load = Load {
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        disconnect_after: None,
    };
    // The conversations' full KV is what their last turns hold (prompt and
    // reply), counted in whole blocks.
    let (s_full, per_block, full_preempted) = unconstrained(c, &convs, concurrency, &load)?;
    // Each conversation's KV at its end: its last prompt and reply.
    let block = 16.0;
    let final_tokens = &s_full.final_tokens;
    let full_bytes: f64 = final_tokens
        .iter()
        .map(|&t| (t as f64 / block).ceil() * per_block)
        .sum();
    let budget_mib = ((full_bytes / 2.0) / (1u64 << 20) as f64).floor().max(1.0) as u64;
    let budget_bytes = (budget_mib << 20) as f64;
    let per_token = per_block / block;
    progress(&format!(
        "full KV {:.1} MiB over {} conversations; budget {budget_mib} MiB",
        full_bytes / (1u64 << 20) as f64,
        concurrency
    ));
    let mut table = Table::new(budget_mib, concurrency);
    table.record("kvforge, full budget", &s_full, Some(full_preempted));
    for arm in [
        ("kvforge, INT4 cold tier", true),
        ("kvforge, hot only", false),
    ] {
        let (s, preempted) = over_budget(c, out, arm, budget_mib, &convs, concurrency, &load)?;
        table.record(arm.0, &s, Some(preempted));
    }
    if let Some(l) = llama {
        let ctx = (budget_bytes / per_token).floor() as usize;
        let server = l.start(concurrency, ctx, &c.log("llama-budget.log"))?;
        warm_up(&server);
        let s = measure(&server, &convs, concurrency, &load, &|_| false);
        server.stop();
        progress(&format!(
            "llama-server -c {ctx}: {}/{concurrency} complete",
            s.completed
        ));
        table.record(
            &format!("llama-server, -c {ctx} (-np {concurrency})"),
            &s,
            None,
        );
    }
    out.csv("budget.csv", &table.csv)?;
    let md = format!(
        "# Conversations over half their KV\n\n{concurrency} chitchat conversations at once, {} turns each, replies of at \
         most {} tokens, every turn resending the history. Their KV at the end (kvforge's f16 hot blocks of {per_block:.0} \
         bytes, {} tokens in all) is {:.1} MiB; the budget is half of it, {budget_mib} MiB. llama-server gets the \
         same memory as its context: budget / {per_token:.0} bytes per token, split over {concurrency} slots.\n\n\
         | server | conversations completed | errors | tok/s | TTFT p50 ms | peak KV MiB (hot + cold) | preemptions | first error |\n|---|---:|---:|---:|---:|---:|---:|---|\n{}",
        c.turns,
        c.max_tokens,
        final_tokens.iter().sum::<usize>(),
        full_bytes / (1u64 << 20) as f64,
        table.lines
    );
    out.report(&md)?;
    Ok(())
}

/// One stream through the server against `kvforge bench`, interleaved.
pub fn single(
    c: &Common,
    kvforge: &Path,
    text: &Path,
    context: usize,
    reps: usize,
    out: &mut Output,
) -> Result<()> {
    let body =
        std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&c.model)?)?;
    let mut ids = tok.encode(&body)?;
    if ids.len() < context {
        bail!(
            "{} holds {} tokens, fewer than --context {context}",
            text.display(),
            ids.len()
        );
    }
    ids.truncate(context);
    let mut csv = Csv::new(&["rep", "path", "decode_tok_s"]);
    let (mut direct, mut served) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        for first_direct in [rep % 2 == 0, rep % 2 == 1] {
            if first_direct {
                let o = Command::new(kvforge)
                    .args(["bench", "--model"])
                    .arg(&c.model)
                    .arg("--text")
                    .arg(text)
                    .args([
                        "--context",
                        &context.to_string(),
                        "--max-tokens",
                        &c.max_tokens.to_string(),
                    ])
                    .output()
                    .with_context(|| format!("running {}", kvforge.display()))?;
                let line = String::from_utf8_lossy(&o.stdout);
                let v: Value = serde_json::from_str(line.trim())
                    .with_context(|| format!("kvforge bench said {line:?}"))?;
                let r = v["decode_tok_s"].as_f64().context("no decode_tok_s")?;
                csv.row([rep.to_string(), "kvforge bench".into(), format!("{r:.3}")]);
                direct.push(r);
            } else {
                let server = c.kvforge(&[]).start(&c.log(&format!("single-{rep}.log")))?;
                warm_up(&server);
                let r = stream_rate(&server.addr, &server.model_id, &ids, c.max_tokens)?;
                server.stop();
                csv.row([
                    rep.to_string(),
                    "through kvforge-serve".into(),
                    format!("{r:.3}"),
                ]);
                served.push(r);
            }
        }
        progress(&format!(
            "rep {rep}: bench {:.2} tok/s, server {:.2} tok/s",
            direct[rep], served[rep]
        ));
    }
    out.csv("single.csv", &csv)?;
    let (d, s) = (median(&direct), median(&served));
    out.report(&format!(
        "# One stream through the server against `kvforge bench`\n\nThe first {context} tokens of `{}` as the prompt, \
         {} greedy tokens (`ignore_eos`), decode tokens/s after the first token; {reps} runs each, interleaved.\n\n\
         | path | decode tok/s (median) |\n|---|---:|\n| kvforge bench | {d:.2} |\n| through kvforge-serve (streamed) | {s:.2} |\n\
         | ratio | **{:.3}×** |\n", text.display(), c.max_tokens, s / d))?;
    Ok(())
}

/// Decode tokens/s of one streamed completion of `ids`: tokens after the
/// first over the time since the first.
fn stream_rate(addr: &str, model: &str, ids: &[u32], max_tokens: usize) -> Result<f64> {
    let body = json!({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": true, "stream": true});
    let r = client::post_json(
        addr,
        "/v1/completions",
        &[],
        &body,
        Duration::from_secs(600),
    )?;
    if r.status != 200 {
        bail!("the server answered {}", r.status);
    }
    let (mut first, mut last) = (None, Instant::now());
    for ev in r.events() {
        let ev = ev?;
        if ev == "[DONE]" {
            break;
        }
        // The last event (the finish reason) leaves in the step of the last token.
        last = Instant::now();
        first.get_or_insert(last);
    }
    let first = first.context("no tokens")?;
    Ok(max_tokens.saturating_sub(1) as f64 / (last - first).as_secs_f64().max(1e-9))
}
