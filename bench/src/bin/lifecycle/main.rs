//! The context lifecycle's three-configuration experiment
//! (`cargo xtask lifecycle`).
//!
//! Long conversations built from chitchat dialogues with planted facts:
//! key → value facts stated in early turns (inside a filler message), one
//! of them updated in a later turn, filler turns, then one question per
//! fact plus a control (a fact never stated), each answered after a primed
//! answer prefix ("Your locker code is") and scored by exact match of the
//! value. Every configuration replays the same token ids, greedily:
//!
//! * `full` — a session with prefix reuse, no lifecycle (the cache alone);
//! * `no-reuse` — stateless requests, the whole history prefilled each turn;
//! * `lifecycle-alone` — stateless requests without reuse whose history
//!   leaves out what the seed's rule reclaimed (K rounds after the drop);
//! * `lc-rule`, `lc-free`, `lc-constrained` — sessions with prefix reuse
//!   and the lifecycle: labels by the rule, by the model's block decoded
//!   freely, by the model under the label grammar (the rule standing in
//!   for missing labels);
//! * `streaming` — a session with StreamingLLM eviction, and `truncation` —
//!   stateless requests keeping the system prompt and the newest whole
//!   turns, both held to the KV bytes `lc-rule` peaked at in this run.
//!
//! Per configuration: peak KV bytes (inside steps, forks and summaries
//! included), fact recall (latest values), updated facts answered new /
//! old, control hits, per-turn TTFT, label validity and rule fallbacks.
//! Writes `turns.csv`, `results.csv`, `report.md` and PNGs to `--out`.

#![allow(clippy::print_stdout)] // a report printer

mod facts;
mod report;
mod stateless;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Chats, Common};
use kvforge_bench::output::Output;
use kvforge_engine::mechanisms::Registry;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, LabelSource, LifecycleConfig, Message, ReuseConfig,
    SamplingParams, TurnReport,
};
use kvforge_lifecycle::RuleFallback;

use crate::facts::{Probe, Turn, build_conversation};
use crate::stateless::Stateless;

const SYSTEM: &str = "You are SmolLM, a friendly assistant in a long conversation. Answer the user \
                      briefly. Remember what the user tells you.";

const CONFIGS: [&str; 8] = [
    "full",
    "no-reuse",
    "lifecycle-alone",
    "lc-rule",
    "lc-free",
    "lc-constrained",
    "streaming",
    "truncation",
];

/// Context lifecycle on chats that state facts and ask for them later.
#[derive(Parser)]
#[command(name = "lifecycle")]
struct Args {
    /// Conversations.
    #[arg(long, default_value_t = 4, value_parser = cli::positive)]
    conversations: usize,
    /// Filler turns between a fact and its question (at most 40).
    #[arg(long, default_value_t = 24, value_parser = cli::positive)]
    filler: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 24, value_parser = cli::positive)]
    answer_tokens: usize,
    /// Turns the lifecycle rule protects.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    protect: u32,
    /// Turns before a label acts.
    #[arg(long, default_value_t = 2)]
    delay: u32,
    /// Tokens below which a segment is not compressed.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    compress_min: u64,
    /// Configurations to run.
    #[arg(long, value_delimiter = ',', default_values_t = CONFIGS.map(String::from))]
    configs: Vec<String>,
    #[command(flatten)]
    chats_file: Chats,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/lifecycle")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if let Some(bad) = a.configs.iter().find(|c| !CONFIGS.contains(&c.trim())) {
        bail!(
            "--configs: unknown configuration {bad:?}; choose from {}",
            CONFIGS.join(", ")
        );
    }
    if a.filler > 40 {
        bail!("--filler must be at most 40 (the conversations this workload takes)");
    }
    let needs_budget = a
        .configs
        .iter()
        .any(|c| c == "streaming" || c == "truncation");
    if needs_budget && !a.configs.iter().any(|c| c == "lc-rule") {
        bail!("--configs: streaming and truncation are held to lc-rule's peak: include lc-rule");
    }
    RuleFallback::new(a.protect, a.compress_min)?;
    Ok(a)
}

/// One turn of one conversation under one configuration.
#[derive(Clone, Debug, Default)]
struct Row {
    config: String,
    conversation: usize,
    turn: usize,
    prompt_tokens: usize,
    reused_tokens: usize,
    ttft_secs: f64,
    held_bytes: u64,
    peak_bytes: u64,
    segments: u32,
    labels_valid: Option<bool>,
    fallback: bool,
    queued: u32,
    revived: u32,
    reclaimed: u32,
    compressed: u32,
    summary_tokens: usize,
    label_secs: f64,
    compress_secs: f64,
    probe: Option<Probe>,
    expected: String,
    answer: String,
    correct: bool,
    old_value: bool,
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("lifecycle", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let filler_turns = a.filler + 4;
    let chats =
        kvforge_bench::load_chats(&a.chats_file.data, filler_turns, a.conversations, 10..=60)?;
    let mut out = Output::create(a.out())?;
    let convs: Vec<Vec<Turn>> = chats
        .iter()
        .enumerate()
        .map(|(i, c)| build_conversation(c, 1 + i as u64))
        .collect();
    let turns_total: usize = convs.iter().map(Vec::len).sum();
    let bar = ProgressBar::new((turns_total * a.configs.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} turns {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    // Configurations in a fixed order: lc-rule before those held to it.
    let mut order: Vec<&str> = CONFIGS
        .iter()
        .copied()
        .filter(|c| a.configs.iter().any(|x| x == c))
        .collect();
    order.sort_by_key(|c| matches!(*c, "streaming" | "truncation"));
    let probe = engine_for(&a, "full", 0)?;
    let block = (
        probe
            .cache()
            .with_coordinator(|c| c.config().layout.block_bytes()),
        probe.cache().block_size(),
    );
    drop(probe);
    let mut rows: Vec<Row> = Vec::new();
    let mut budget = 0u64;
    for config in order {
        bar.set_message(config.to_string());
        let mut conf_rows = Vec::new();
        for (ci, conv) in convs.iter().enumerate() {
            conf_rows.extend(replay(&a, config, ci, conv, budget, block, &bar)?);
        }
        if config == "lc-rule" {
            budget = conf_rows.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
        }
        rows.extend(conf_rows);
    }
    bar.finish_and_clear();
    let report = report::write_outputs(&a, &rows, budget, &mut out)?;
    println!("lifecycle: {}", report.display());
    Ok(())
}

fn engine_for(a: &Args, config: &str, budget_tokens: usize) -> Result<Engine> {
    let source = match config {
        "lc-rule" => Some(LabelSource::Rule),
        "lc-free" => Some(LabelSource::Free),
        "lc-constrained" => Some(LabelSource::Constrained),
        _ => None,
    };
    let mut cfg = EngineConfig {
        kv_tokens: 8192,
        lifecycle: source.map(|source| LifecycleConfig::Labels {
            source,
            protect: a.protect,
            delay: a.delay,
            min_match: 6,
            compress_min: Some(a.compress_min),
        }),
        ..EngineConfig::default()
    };
    if config == "streaming" {
        let window = budget_tokens.saturating_sub(16).max(16);
        let params = serde_json::json!({ "sink": 16, "window": window });
        cfg.evict_with(&Registry::builtin(), "sink-window", params)
            .map_err(anyhow::Error::msg)?;
    }
    Engine::load(&a.common.model, &cfg)
        .with_context(|| format!("loading {}", a.common.model.display()))
}

/// Replays one conversation under `config`; `budget` (bytes; `block`:
/// bytes and tokens of a KV block) holds `streaming` and `truncation`.
fn replay(
    a: &Args,
    config: &str,
    ci: usize,
    conv: &[Turn],
    budget: u64,
    (block_bytes, bs): (u64, usize),
    bar: &ProgressBar,
) -> Result<Vec<Row>> {
    let budget_tokens = (budget / block_bytes.max(1)) as usize * bs;
    let engine = engine_for(a, config, budget_tokens)?;
    let reuse = ReuseConfig {
        enabled: !matches!(config, "no-reuse" | "lifecycle-alone"),
        seed: Some(7),
        ..ReuseConfig::default()
    };
    let m = CacheManager::new(engine, reuse)?;
    let tok = m.engine().tokenizer().clone();
    let session = matches!(
        config,
        "full" | "lc-rule" | "lc-free" | "lc-constrained" | "streaming"
    );
    let sid = m.open_session("lifecycle");
    let mut stateless = Stateless::new(a, &tok)?;
    let mut rows = Vec::new();
    let mut close = false;
    for (ti, t) in conv.iter().enumerate() {
        let mut input = if ti == 0 {
            tok.chat_ids(&[
                Message::new("system", SYSTEM),
                Message::new("user", &t.text),
            ])?
        } else {
            tok.user_turn_ids(close, &t.text)?
        };
        if let Some((prefix, ..)) = &t.question {
            input.extend(tok.encode_text(prefix)?);
        }
        let params = SamplingParams {
            max_tokens: if t.question.is_some() {
                12
            } else {
                a.answer_tokens
            },
            ..SamplingParams::default()
        };
        m.engine().cache().take_step_peak_bytes();
        let report: TurnReport = if session {
            m.turn(sid, &input, &params, &mut |_, _| true)?
        } else {
            stateless.turn(&m, config, &input, &params, budget_tokens, ti)?
        };
        close = !report.generation.stopped_at_eos;
        let peak = m.engine().cache().take_step_peak_bytes();
        let answer = tok.decode_text(&report.generation.tokens)?;
        rows.push(row(config, ci, ti, &report, peak, answer, t));
        bar.inc(1);
    }
    m.close_session(sid)?;
    Ok(rows)
}

/// The row of turn `ti` of conversation `ci` under `config`.
fn row(
    config: &str,
    ci: usize,
    ti: usize,
    report: &TurnReport,
    peak: u64,
    answer: String,
    t: &Turn,
) -> Row {
    let l = report.lifecycle.clone().unwrap_or_default();
    let mut row = Row {
        config: config.to_string(),
        conversation: ci,
        turn: ti,
        prompt_tokens: report.prompt_tokens,
        reused_tokens: report.reused_tokens,
        ttft_secs: report.ttft_secs,
        held_bytes: report.kv_bytes_in_use,
        peak_bytes: peak,
        segments: l.segments,
        labels_valid: l.labels_valid,
        fallback: l.fallback,
        queued: l.queued,
        revived: l.revived,
        reclaimed: l.reclaimed,
        compressed: l.compressed,
        summary_tokens: l.summary_tokens,
        label_secs: l.label_secs,
        compress_secs: l.compress_secs,
        answer: answer.clone(),
        ..Row::default()
    };
    if let Some((_, expect, old, probe)) = &t.question {
        row.probe = Some(*probe);
        row.expected = expect.clone();
        row.correct = answer.contains(expect.as_str());
        row.old_value = old.as_ref().is_some_and(|o| answer.contains(o.as_str()));
    }
    row
}
