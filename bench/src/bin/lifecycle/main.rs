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

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Common};
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::lifecycle::segment_cuts;
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, EvictionConfig, LabelSource, LifecycleConfig, Message,
    ReuseConfig, SamplingParams, TurnReport,
};
use kvforge_lifecycle::{Lifecycle, LifecycleParams, RuleFallback, TurnEnd};

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
    /// The chitchat dataset.
    #[arg(long, default_value = "data/chitchat/dataset.json")]
    data: PathBuf,
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

/// A fact the user states: the statement, the question, the answer prefix
/// the model completes, and how to draw a value.
struct FactKind {
    statement: &'static str,
    question: &'static str,
    prefix: &'static str,
    values: &'static [&'static str],
}

const NAMES: &[&str] = &[
    "Marta", "Jonas", "Priya", "Tomas", "Ingrid", "Kofi", "Elena", "Dmitri", "Aiko", "Rafael",
];
const CODES: &[&str] = &[
    "4821", "7730", "1596", "3364", "9042", "2718", "6150", "8473", "5209", "3881",
];
const ROOMS: &[&str] = &["214", "507", "330", "118", "642", "905", "271", "483"];
const FLIGHTS: &[&str] = &[
    "KL417", "BA902", "LH338", "AF156", "SK771", "IB624", "AY205", "OS489",
];
const WORDS: &[&str] = &[
    "maple42", "harbor17", "violet88", "copper35", "falcon63", "meadow29",
];

const FACTS: [FactKind; 6] = [
    FactKind {
        statement: "My locker code is {}.",
        question: "What is my locker code?",
        prefix: "Your locker code is",
        values: CODES,
    },
    FactKind {
        statement: "My cousin is called {}.",
        question: "What is my cousin called?",
        prefix: "Your cousin is called",
        values: NAMES,
    },
    FactKind {
        statement: "My flight number is {}.",
        question: "What is my flight number?",
        prefix: "Your flight number is",
        values: FLIGHTS,
    },
    FactKind {
        statement: "The meeting is in room {}.",
        question: "Which room is the meeting in?",
        prefix: "The meeting is in room",
        values: ROOMS,
    },
    FactKind {
        statement: "My dog is called {}.",
        question: "What is my dog called?",
        prefix: "Your dog is called",
        values: NAMES,
    },
    FactKind {
        statement: "The wifi password is {}.",
        question: "What is the wifi password?",
        prefix: "The wifi password is",
        values: WORDS,
    },
];

/// What a question checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// A fact stated once.
    Kept,
    /// A fact stated, then updated: the newer value is expected.
    Updated,
    /// Never stated: a hit is a guess.
    Control,
}

/// One user turn of a conversation.
struct Turn {
    text: String,
    /// For a question: the answer prefix, the expected value, the old
    /// value of an updated fact, and what it probes.
    question: Option<(String, String, Option<String>, Probe)>,
}

/// Facts 0..3 stated in turns 1..=3, fact 0 updated after half the filler,
/// fact 3 (never stated) the control; then the questions.
fn build_conversation(filler: &[String], seed: u64) -> Vec<Turn> {
    let mut rng = kvforge_bench::SplitMix::new(seed);
    // Four distinct kinds: 3 stated, 1 control.
    let mut kinds: Vec<usize> = (0..FACTS.len()).collect();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.range(0, i as u32) as usize);
    }
    let kinds = &kinds[..4];
    let mut pick = |v: &'static [&'static str]| v[rng.range(0, v.len() as u32 - 1) as usize];
    let values: Vec<&str> = kinds.iter().map(|&k| pick(FACTS[k].values)).collect();
    let mut newer = pick(FACTS[kinds[0]].values);
    while newer == values[0] {
        newer = pick(FACTS[kinds[0]].values);
    }
    let say = |k: usize, v: &str| FACTS[k].statement.replace("{}", v);
    let mut turns = Vec::new();
    let mut f = filler.iter();
    let mut next_filler = || f.next().cloned().unwrap_or_else(|| "Tell me more.".into());
    turns.push(Turn {
        text: next_filler(),
        question: None,
    });
    for i in 0..3 {
        turns.push(Turn {
            text: format!("{} By the way, {}", next_filler(), say(kinds[i], values[i])),
            question: None,
        });
    }
    let n_filler = filler.len().saturating_sub(4);
    for j in 0..n_filler {
        if j == n_filler / 2 {
            turns.push(Turn {
                text: format!("{} One correction: {}", next_filler(), say(kinds[0], newer)),
                question: None,
            });
        } else {
            turns.push(Turn {
                text: next_filler(),
                question: None,
            });
        }
    }
    for (i, &k) in kinds.iter().enumerate() {
        let (expect, old, probe) = match i {
            0 => (
                newer.to_string(),
                Some(values[0].to_string()),
                Probe::Updated,
            ),
            3 => (values[3].to_string(), None, Probe::Control),
            _ => (values[i].to_string(), None, Probe::Kept),
        };
        turns.push(Turn {
            text: FACTS[k].question.to_string(),
            question: Some((FACTS[k].prefix.to_string(), expect, old, probe)),
        });
    }
    turns
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
    let chats = kvforge_bench::load_chats(&a.data, filler_turns, a.conversations, 10..=60)?;
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
    let report = write_outputs(&a, &rows, budget, &mut out)?;
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
    let cfg = EngineConfig {
        kv_tokens: 8192,
        lifecycle: source.map(|source| LifecycleConfig::Labels {
            source,
            protect: a.protect,
            delay: a.delay,
            min_match: 6,
            compress_min: Some(a.compress_min),
        }),
        eviction: (config == "streaming").then_some(EvictionConfig::SinkWindow {
            sink: 16,
            window: budget_tokens.saturating_sub(16).max(16),
        }),
        ..EngineConfig::default()
    };
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
    // Stateless state: every token of the conversation so far, the turns'
    // starts, and (lifecycle-alone) which positions the rule reclaimed.
    let mut history: Vec<u32> = Vec::new();
    let mut starts: Vec<usize> = Vec::new();
    let mut removed: Vec<bool> = Vec::new();
    let mut rule = Lifecycle::new(
        Box::new(RuleFallback::new(a.protect, u64::MAX)?),
        LifecycleParams {
            delay: a.delay,
            min_match: 6,
            compress_min: None,
        },
    )?;
    let stop: Vec<u32> = ["<|im_start|>", "<|im_end|>"]
        .iter()
        .filter_map(|t| tok.token_id(t))
        .collect();
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
            starts.push(history.len());
            history.extend(&input);
            removed.resize(history.len(), false);
            let prompt: Vec<u32> = match config {
                "truncation" => truncated(&history, &starts, budget_tokens),
                "lifecycle-alone" => history
                    .iter()
                    .zip(&removed)
                    .filter(|(_, r)| !**r)
                    .map(|(&t, _)| t)
                    .collect(),
                _ => history.clone(),
            };
            let r = m.complete(&prompt, "lifecycle", &params, &mut |_, _| true)?;
            history.extend(&r.generation.tokens);
            removed.resize(history.len(), false);
            if config == "lifecycle-alone" {
                let start = starts[ti];
                let cuts = segment_cuts(&tok, &history, start);
                let o = rule.end_turn(
                    1,
                    TurnEnd {
                        end: history.len() as u64,
                        cuts: &cuts,
                        tokens: &history,
                        stop: &stop,
                        refer: Some(start as u64..(start + input.len()) as u64),
                        model: None,
                    },
                );
                for r in o.reclaim {
                    for x in &mut removed[r.start as usize..r.end as usize] {
                        *x = true;
                    }
                }
            }
            r
        };
        close = !report.generation.stopped_at_eos;
        let peak = m.engine().cache().take_step_peak_bytes();
        let answer = tok.decode_text(&report.generation.tokens)?;
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
        rows.push(row);
        bar.inc(1);
    }
    m.close_session(sid)?;
    Ok(rows)
}

/// The system prompt (turn 0 up to its user message) and the newest whole
/// turns that fit `budget` tokens with the newest turn always in.
fn truncated(history: &[u32], starts: &[usize], budget: usize) -> Vec<u32> {
    let sys_end = starts.get(1).copied().unwrap_or(history.len());
    let newest = *starts.last().unwrap_or(&0);
    let mut from = newest;
    for &s in starts.iter().rev().skip(1) {
        if s == 0 || sys_end + (history.len() - s) > budget {
            break;
        }
        from = s;
    }
    if from == 0 {
        return history.to_vec();
    }
    let mut p = history[..sys_end.min(history.len())].to_vec();
    // Keep turn 0 whole when it fits; otherwise its system part only.
    if from > sys_end {
        p.truncate(sys_end);
    }
    p.extend(&history[from..]);
    p
}

struct Summary {
    config: String,
    peak_bytes: u64,
    held_final: u64,
    kept: (usize, usize),
    updated_new: usize,
    updated_old: usize,
    updated: usize,
    control: (usize, usize),
    ttft_median: f64,
    ttft_mean: f64,
    label_turns: usize,
    labels_valid: usize,
    fallbacks: usize,
    revived: u32,
    reclaimed: u32,
    compressed: u32,
    summary_tokens: usize,
    label_secs: f64,
    compress_secs: f64,
    turns: usize,
}

fn summarise(rows: &[Row], config: &str) -> Summary {
    let r: Vec<&Row> = rows.iter().filter(|r| r.config == config).collect();
    let count = |p: Probe, f: &dyn Fn(&Row) -> bool| {
        r.iter().filter(|x| x.probe == Some(p) && f(x)).count()
    };
    let last_turn = r.iter().map(|x| x.turn).max().unwrap_or(0);
    Summary {
        config: config.to_string(),
        peak_bytes: r.iter().map(|x| x.peak_bytes).max().unwrap_or(0),
        held_final: r
            .iter()
            .filter(|x| x.turn == last_turn)
            .map(|x| x.held_bytes)
            .max()
            .unwrap_or(0),
        kept: (
            count(Probe::Kept, &|x| x.correct),
            count(Probe::Kept, &|_| true),
        ),
        updated_new: count(Probe::Updated, &|x| x.correct),
        updated_old: count(Probe::Updated, &|x| x.old_value),
        updated: count(Probe::Updated, &|_| true),
        control: (
            count(Probe::Control, &|x| x.correct),
            count(Probe::Control, &|_| true),
        ),
        ttft_median: kvforge_bench::median(r.iter().map(|x| x.ttft_secs).collect()),
        ttft_mean: r.iter().map(|x| x.ttft_secs).sum::<f64>() / r.len().max(1) as f64,
        label_turns: r.iter().filter(|x| x.labels_valid.is_some()).count(),
        labels_valid: r.iter().filter(|x| x.labels_valid == Some(true)).count(),
        fallbacks: r.iter().filter(|x| x.fallback).count(),
        revived: r.iter().map(|x| x.revived).sum(),
        reclaimed: r.iter().map(|x| x.reclaimed).sum(),
        compressed: r.iter().map(|x| x.compressed).sum(),
        summary_tokens: r.iter().map(|x| x.summary_tokens).sum(),
        label_secs: r.iter().map(|x| x.label_secs).sum(),
        compress_secs: r.iter().map(|x| x.compress_secs).sum(),
        turns: r.len(),
    }
}

fn write_outputs(a: &Args, rows: &[Row], budget: u64, out: &mut Output) -> Result<PathBuf> {
    let mut csv = Csv::new(&[
        "config",
        "conversation",
        "turn",
        "prompt_tokens",
        "reused_tokens",
        "ttft_secs",
        "held_bytes",
        "peak_bytes",
        "segments",
        "labels_valid",
        "fallback",
        "queued",
        "revived",
        "reclaimed",
        "compressed",
        "summary_tokens",
        "label_secs",
        "compress_secs",
        "probe",
        "expected",
        "correct",
        "old_value",
        "answer",
    ]);
    for r in rows {
        csv.row([
            r.config.to_string(),
            r.conversation.to_string(),
            r.turn.to_string(),
            r.prompt_tokens.to_string(),
            r.reused_tokens.to_string(),
            format!("{:.4}", r.ttft_secs),
            r.held_bytes.to_string(),
            r.peak_bytes.to_string(),
            r.segments.to_string(),
            r.labels_valid.map_or(String::new(), |v| v.to_string()),
            r.fallback.to_string(),
            r.queued.to_string(),
            r.revived.to_string(),
            r.reclaimed.to_string(),
            r.compressed.to_string(),
            r.summary_tokens.to_string(),
            format!("{:.3}", r.label_secs),
            format!("{:.3}", r.compress_secs),
            r.probe
                .map_or(String::new(), |p| format!("{p:?}").to_lowercase()),
            r.expected.to_string(),
            r.correct.to_string(),
            r.old_value.to_string(),
            r.answer.replace('\n', " "),
        ]);
    }
    out.csv("turns.csv", &csv)?;
    let configs: Vec<String> = CONFIGS
        .iter()
        .filter(|c| rows.iter().any(|r| r.config == **c))
        .map(|c| c.to_string())
        .collect();
    let sums: Vec<Summary> = configs.iter().map(|c| summarise(rows, c)).collect();
    let full_peak = sums
        .iter()
        .find(|s| s.config == "full")
        .map_or(0, |s| s.peak_bytes);
    let full_recall = sums.iter().find(|s| s.config == "full").map(|s| s.kept);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let pct = |n: usize, d: usize| {
        if d == 0 {
            "–".to_string()
        } else {
            format!("{n}/{d}")
        }
    };
    let mut res = Csv::new(&[
        "config",
        "peak_kv_bytes",
        "peak_vs_full",
        "kept_correct",
        "kept_asked",
        "updated_new",
        "updated_old",
        "updated_asked",
        "control_hits",
        "control_asked",
        "ttft_median_secs",
        "ttft_mean_secs",
        "label_turns",
        "labels_valid",
        "fallbacks",
        "revived_segments",
        "reclaimed_segments",
        "compressed_segments",
        "summary_tokens",
        "label_secs",
        "compress_secs",
        "turns",
    ]);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Context lifecycle: the three-configuration experiment\n"
    );
    let _ = writeln!(
        md,
        "`cargo xtask lifecycle` — {} conversations of {} turns ({} filler from chitchat, \
         3 planted facts, 1 updated, then 4 questions: 2 kept facts, the updated one, a \
         control never stated), replies of up to {} tokens, answers of up to 12 after a primed \
         prefix, greedy. Lifecycle: protect {} rounds, K = {}, segments of 4+ tokens cut at \
         sentence ends, compression of segments of {}+ tokens. `streaming` and `truncation` \
         are held to lc-rule's peak: {:.2} MiB.\n",
        a.conversations,
        a.filler + 8,
        a.filler,
        a.answer_tokens,
        a.protect,
        a.delay,
        a.compress_min,
        mib(budget)
    );
    let _ = writeln!(
        md,
        "| config | peak KV MiB | vs full | held at end MiB | kept facts | updated: new / old | control hits | TTFT median ms | TTFT mean ms | labels valid | rule fallbacks | label pass ms / turn | revived | reclaimed | compressed (summary ms) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for s in &sums {
        res.row([
            s.config.to_string(),
            s.peak_bytes.to_string(),
            format!("{:.4}", s.peak_bytes as f64 / full_peak.max(1) as f64),
            s.kept.0.to_string(),
            s.kept.1.to_string(),
            s.updated_new.to_string(),
            s.updated_old.to_string(),
            s.updated.to_string(),
            s.control.0.to_string(),
            s.control.1.to_string(),
            format!("{:.4}", s.ttft_median),
            format!("{:.4}", s.ttft_mean),
            s.label_turns.to_string(),
            s.labels_valid.to_string(),
            s.fallbacks.to_string(),
            s.revived.to_string(),
            s.reclaimed.to_string(),
            s.compressed.to_string(),
            s.summary_tokens.to_string(),
            format!("{:.3}", s.label_secs),
            format!("{:.3}", s.compress_secs),
            s.turns.to_string(),
        ]);
        let _ = writeln!(
            md,
            "| {} | {:.2} | {} | {:.2} | {} | {} / {} of {} | {} | {:.0} | {:.0} | {} | {} | {:.0} | {} | {} | {} ({:.0}) |",
            s.config,
            mib(s.peak_bytes),
            if full_peak == 0 {
                "–".to_string()
            } else {
                format!("{:.0}%", 100.0 * s.peak_bytes as f64 / full_peak as f64)
            },
            mib(s.held_final),
            pct(s.kept.0, s.kept.1),
            s.updated_new,
            s.updated_old,
            s.updated,
            pct(s.control.0, s.control.1),
            1e3 * s.ttft_median,
            1e3 * s.ttft_mean,
            pct(s.labels_valid, s.label_turns),
            s.fallbacks,
            1e3 * s.label_secs / s.turns.max(1) as f64,
            s.revived,
            s.reclaimed,
            s.compressed,
            1e3 * s.compress_secs,
        );
    }
    if let Some((n, d)) = full_recall {
        let _ = writeln!(
            md,
            "\nThe full cache recalls {n} of {d} kept facts: every configuration is judged against \
             that. Peak KV is the most bytes in use inside any step of a turn (a labelling fork \
             or a summary pass included); `vs full` divides by `full`'s."
        );
    }
    out.csv("results.csv", &res)?;
    // Recall against peak KV; KV held after each turn of conversation 0.
    let points: Vec<(String, f64, f64)> = sums
        .iter()
        .map(|s| {
            (
                s.config.clone(),
                mib(s.peak_bytes),
                s.kept.0 as f64 / s.kept.1.max(1) as f64,
            )
        })
        .collect();
    out.png("recall_vs_peak.png", |path| {
        kvforge_bench::plot::scatter_plot(
            path,
            "Kept-fact recall against peak KV",
            "peak KV (MiB)",
            "kept facts recalled",
            &points,
            false,
        )
    })?;
    let series: Vec<(&str, Vec<(f64, f64)>)> = configs
        .iter()
        .map(|c| {
            let pts = rows
                .iter()
                .filter(|r| r.config == *c && r.conversation == 0)
                .map(|r| (r.turn as f64, mib(r.peak_bytes)))
                .collect();
            (c.as_str(), pts)
        })
        .collect();
    let max_turn = rows.iter().map(|r| r.turn).max().unwrap_or(1) as f64;
    let max_mib = rows.iter().map(|r| mib(r.peak_bytes)).fold(0.0, f64::max);
    out.png("kv_per_turn.png", |path| {
        kvforge_bench::plot::line_plot(
            path,
            "Peak KV per turn (conversation 0)",
            "turn",
            "peak KV (MiB)",
            (0.0, max_turn),
            (0.0, max_mib * 1.1),
            &series,
        )
    })?;
    out.report(&md)
}
