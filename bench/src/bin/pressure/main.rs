//! Many sessions over a budget that holds a fraction of their KV
//! (`cargo xtask pressure`).
//!
//! `--sessions` chitchat conversations run as `CacheManager` sessions, turn
//! by turn in round robin, so that every session holds its KV while the
//! others run. Pass 1 runs them with the mechanisms configured (cold tier,
//! eviction policy under a watermark) and a budget they never reach: it
//! measures their total KV (the peak of bytes in use) and each session's
//! greedy answers. Pass 2 runs the same turns with the byte budget set to
//! `--share` of that total: the watermark policy evicts from the session
//! being stepped whenever the bytes in use reach `--high` of the budget.
//! Reported: turns completed (a turn the budget cannot hold is refused and
//! rolled back, the session goes on), bytes per tier after every turn,
//! evictions and demotions, and whether the sessions that never lost an
//! entry answer exactly as in pass 1 (they should: nothing they read
//! changed).
//!
//! Writes `turns.csv` and `report.md` to `--out`.

#![allow(clippy::print_stdout)] // a report printer

mod report;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Chats, Common};
use kvforge_bench::output::Output;
use kvforge_coordinator::Slot;
use kvforge_engine::mechanisms::Registry;
use kvforge_engine::{
    Axis, CacheManager, Engine, EngineConfig, KvQuant, Message, ReuseConfig, SamplingParams,
};

const SYSTEM: &str = "You are SmolLM, a friendly assistant in a long conversation. Answer the user \
                      briefly.";

/// Many sessions under a byte budget with watermark eviction.
#[derive(Parser)]
#[command(name = "pressure")]
struct Args {
    /// Sessions.
    #[arg(long, default_value_t = 32, value_parser = cli::positive)]
    sessions: usize,
    /// Turns per session (at most 20).
    #[arg(long, default_value_t = 10, value_parser = cli::positive)]
    turns: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 24, value_parser = cli::positive)]
    answer_tokens: usize,
    /// The budget as a share of what the sessions would hold.
    #[arg(long, default_value_t = 0.25, value_parser = fraction)]
    share: f64,
    /// Eviction policy: h2o, lfu or hybrid.
    #[arg(long, default_value = "h2o")]
    policy: String,
    /// High watermark (a share of the budget).
    #[arg(long, default_value_t = 0.9, value_parser = fraction)]
    high: f64,
    /// Low watermark.
    #[arg(long, default_value_t = 0.8, value_parser = fraction)]
    low: f64,
    /// Tokens kept at the start.
    #[arg(long, default_value_t = 16)]
    sink: usize,
    /// Recent tokens kept.
    #[arg(long, default_value_t = 16, value_parser = cli::positive)]
    window: usize,
    /// The cold tier's format.
    #[arg(long, value_enum, default_value_t = Cold::Int4)]
    cold: Cold,
    #[command(flatten)]
    chats_file: Chats,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/pressure")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if a.turns > 20 {
        bail!("--turns must be at most 20 (the conversations this workload takes)");
    }
    // The policy's own checks (watermarks, weights), before any model load.
    config(&a, 0)?;
    Ok(a)
}

/// A fraction in (0, 1] (a `value_parser`).
fn fraction(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err("takes a fraction in (0, 1]".into()),
    }
}

/// The cold tier's format.
#[derive(Clone, Copy, ValueEnum)]
enum Cold {
    Int8,
    Int4,
    Int2,
    None,
}

impl Args {
    /// The cold tier's bits, `None` without one.
    fn cold_bits(&self) -> Option<u32> {
        match self.cold {
            Cold::Int8 => Some(8),
            Cold::Int4 => Some(4),
            Cold::Int2 => Some(2),
            Cold::None => None,
        }
    }
}

/// The eviction policy's parameters (a mechanisms file's `[eviction]`
/// table): a watermark over the byte budget, the hybrid's weights all 1.
fn eviction(a: &Args) -> Result<serde_json::Value> {
    let mut p = serde_json::json!({
        "sink": a.sink,
        "window": a.window,
        "high": a.high,
        "low": a.low,
    });
    match a.policy.as_str() {
        "h2o" | "lfu" => {}
        "hybrid" => {
            for w in ["alpha", "beta", "gamma"] {
                p[w] = 1.0.into();
            }
        }
        other => bail!("--policy takes h2o, lfu or hybrid, not {other:?}"),
    }
    Ok(p)
}

/// One turn of one session in one pass.
struct Row {
    pass: usize,
    session: usize,
    turn: usize,
    error: String,
    answer: Vec<u32>,
    kv_bytes: u64,
    hot_bytes: u64,
    cold_bytes: u64,
    evicted: u64,
    evicted_idle: u64,
    demoted: u64,
    /// The session had lost an entry by the end of this turn.
    lost: bool,
}

/// What one pass left.
struct Pass {
    rows: Vec<Row>,
    peak: u64,
    /// Per session: whether its table lost an entry to eviction.
    evicted: Vec<bool>,
    budget: u64,
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("pressure", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let chats = kvforge_bench::load_chats(&a.chats_file.data, a.turns, a.sessions, 10..=20)?;
    let mut out = Output::create(a.out())?;
    let bar = ProgressBar::new((2 * a.sessions * a.turns) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} turns {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("pass 1: no pressure");
    let free = replay(&a, &chats, 0, 1, &bar)?;
    if free
        .rows
        .iter()
        .any(|r| r.evicted > 0 || !r.error.is_empty())
    {
        bail!("pass 1 evicted or failed: raise its capacity");
    }
    let budget = (free.peak as f64 * a.share) as u64;
    bar.set_message(format!("pass 2: budget {} MiB", budget >> 20));
    let tight = replay(&a, &chats, budget, 2, &bar)?;
    bar.finish_and_clear();
    let report = report::write_outputs(&a, &free, &tight, &mut out)?;
    println!("pressure: {}", report.display());
    Ok(())
}

/// The engine's configuration of `a` under `budget` bytes (0: the hot
/// capacity): blocks of 16, room for every session at full length (pass 1
/// never evicts), the cold tier and the eviction policy `a` names.
fn config(a: &Args, budget: u64) -> Result<EngineConfig> {
    let kv_quant = a.cold_bits().map(|bits| KvQuant {
        bits,
        group_size: 32,
        window: a.window,
        rotate: false,
        key_axis: Axis::PerChannel,
        sink: a.sink,
    });
    let mut cfg = EngineConfig {
        block_size: 16,
        kv_tokens: a.sessions * 2048,
        kv_quant,
        kv_budget: budget,
        ..EngineConfig::default()
    };
    cfg.evict_with(&Registry::builtin(), &a.policy, eviction(a)?)
        .map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

/// The sessions' cache manager (no prefix reuse): the mechanisms of `a`
/// under `budget` bytes (0: the hot capacity); and the budget it holds.
fn manager(a: &Args, budget: u64) -> Result<(CacheManager, u64)> {
    let cfg = config(a, budget)?;
    let engine = Engine::load(&a.common.model, &cfg)
        .with_context(|| format!("loading {}", a.common.model.display()))?;
    let budget = engine.cache().config().budget();
    let m = CacheManager::new(
        engine,
        ReuseConfig {
            enabled: false,
            ..ReuseConfig::default()
        },
    )?;
    Ok((m, budget))
}

/// Runs every session turn by turn in round robin; `budget` 0 leaves the
/// budget at the (large) hot capacity.
fn replay(
    a: &Args,
    chats: &[Vec<String>],
    budget: u64,
    pass: usize,
    bar: &ProgressBar,
) -> Result<Pass> {
    let (m, budget) = manager(a, budget)?;
    let params = SamplingParams {
        max_tokens: a.answer_tokens,
        ..SamplingParams::default()
    };
    let ids: Vec<u64> = chats.iter().map(|_| m.open_session("pressure")).collect();
    let mut closed = vec![true; chats.len()];
    let mut rows = Vec::new();
    let mut peak = 0u64;
    for turn in 0..a.turns {
        for (s, chat) in chats.iter().enumerate() {
            let tok = &m.engine().tokenizer();
            let text = chat[turn].as_str();
            let prompt = if turn == 0 {
                tok.chat_ids(&[Message::new("system", SYSTEM), Message::new("user", text)])?
            } else {
                tok.user_turn_ids(!closed[s], text)?
            };
            let cache = &m.engine().cache();
            let mut high = cache.bytes_in_use();
            let r = m.turn(ids[s], &prompt, &params, &mut |_, _| {
                high = high.max(cache.bytes_in_use());
                true
            });
            let (hot, cold) = cache.tier_bytes();
            let counters = cache.stats().policies;
            peak = peak.max(high).max(cache.bytes_in_use());
            let (error, answer) = match r {
                Ok(r) => {
                    closed[s] = r.generation.stopped_at_eos;
                    (String::new(), r.generation.tokens)
                }
                Err(e) => (e.to_string(), Vec::new()),
            };
            let lost = m
                .session_table(ids[s])?
                .entries()
                .iter()
                .any(|e| e.slot() == Slot::Dropped);
            rows.push(Row {
                pass,
                lost,
                session: s,
                turn,
                error,
                answer,
                kv_bytes: cache.bytes_in_use(),
                hot_bytes: hot,
                cold_bytes: cold,
                evicted: counters.evicted_entries,
                evicted_idle: counters.evicted_idle_entries,
                demoted: counters.demoted_blocks,
            });
            bar.inc(1);
        }
    }
    let mut evicted = Vec::with_capacity(ids.len());
    for &id in &ids {
        let t = m.session_table(id)?;
        evicted.push(t.entries().iter().any(|e| e.slot() == Slot::Dropped));
        m.close_session(id)?;
    }
    Ok(Pass {
        rows,
        peak,
        evicted,
        budget,
    })
}
