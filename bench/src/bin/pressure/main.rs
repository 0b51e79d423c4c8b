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

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Common};
use kvforge_bench::output::{Csv, Output};
use kvforge_coordinator::Slot;
use kvforge_engine::{
    Axis, CacheManager, Engine, EngineConfig, EvictionConfig, KvQuant, Message, ReuseConfig,
    SamplingParams, Score, Trigger,
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
    /// The chitchat dataset.
    #[arg(long, default_value = "data/chitchat/dataset.json")]
    data: PathBuf,
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
    kvforge_evict::Scored::new(
        score(&a.policy)?,
        Trigger::Watermark {
            high: a.high,
            low: a.low,
        },
        a.sink,
        a.window,
    )?;
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

fn score(policy: &str) -> Result<Score> {
    Ok(match policy {
        "h2o" => Score::AttentionEma { decay: 0.9 },
        "lfu" => Score::Lfu,
        "hybrid" => Score::Hybrid {
            alpha: 1.0,
            beta: 1.0,
            gamma: 1.0,
        },
        _ => bail!("--policy takes h2o, lfu or hybrid, not {policy:?}"),
    })
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
    let chats = kvforge_bench::load_chats(&a.data, a.turns, a.sessions, 10..=20)?;
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
    let report = write_outputs(&a, &free, &tight, &mut out)?;
    println!("pressure: {}", report.display());
    Ok(())
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
    let kv_quant = a.cold_bits().map(|bits| KvQuant {
        bits,
        group_size: 32,
        window: a.window,
        rotate: false,
        key_axis: Axis::PerChannel,
        sink: a.sink,
    });
    let cfg = EngineConfig {
        block_size: 16,
        // Room for every session at full length: pass 1 never evicts.
        kv_tokens: a.sessions * 2048,
        kv_quant,
        eviction: Some(EvictionConfig::Scored {
            score: score(&a.policy)?,
            trigger: Trigger::Watermark {
                high: a.high,
                low: a.low,
            },
            sink: a.sink,
            window: a.window,
            per_head: false,
            per_token: false,
        }),
        kv_budget: budget,
        ..EngineConfig::default()
    };
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

/// Session `s`'s answers in `p`, turn by turn.
fn answers(p: &Pass, s: usize) -> Vec<&[u32]> {
    p.rows
        .iter()
        .filter(|r| r.session == s)
        .map(|r| r.answer.as_slice())
        .collect()
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

fn write_outputs(a: &Args, free: &Pass, tight: &Pass, out: &mut Output) -> Result<PathBuf> {
    let mut csv = Csv::new(&[
        "pass",
        "session",
        "turn",
        "error",
        "answer_tokens",
        "kv_bytes",
        "hot_bytes",
        "cold_bytes",
        "evicted_entries",
        "evicted_idle_entries",
        "demoted_blocks",
        "lost",
    ]);
    for r in free.rows.iter().chain(&tight.rows) {
        csv.row([
            r.pass.to_string(),
            r.session.to_string(),
            r.turn.to_string(),
            r.error.clone(),
            r.answer.len().to_string(),
            r.kv_bytes.to_string(),
            r.hot_bytes.to_string(),
            r.cold_bytes.to_string(),
            r.evicted.to_string(),
            r.evicted_idle.to_string(),
            r.demoted.to_string(),
            u8::from(r.lost).to_string(),
        ]);
    }
    out.csv("turns.csv", &csv)?;

    let n = a.sessions;
    let same: Vec<bool> = (0..n)
        .map(|s| answers(free, s) == answers(tight, s))
        .collect();
    let untouched: Vec<usize> = (0..n).filter(|&s| !tight.evicted[s]).collect();
    let untouched_same = untouched.iter().filter(|&&s| same[s]).count();
    let touched_same = (0..n).filter(|&s| tight.evicted[s] && same[s]).count();
    let failed: Vec<&Row> = tight.rows.iter().filter(|r| !r.error.is_empty()).collect();
    // Turns after which the session still had every entry: nothing it read
    // changed, so its answer must be pass 1's.
    let intact: Vec<(&Row, &Row)> = tight
        .rows
        .iter()
        .zip(&free.rows)
        .filter(|(t, _)| !t.lost && t.error.is_empty())
        .collect();
    let intact_same = intact.iter().filter(|(t, f)| t.answer == f.answer).count();
    let last = tight.rows.last();
    let peak_tight = tight.peak;
    let mut md = String::new();
    let _ = writeln!(md, "# Multi-session pressure\n");
    let _ = writeln!(
        md,
        "{n} chitchat sessions × {} turns in round robin (answers of at most {} tokens, greedy), \
         SmolLM2-135M, f16 hot KV, blocks of 16, {} cold tier, `{}` eviction under a watermark \
         {}–{} of the budget (sink {}, window {}).\n",
        a.turns,
        a.answer_tokens,
        a.cold_bits()
            .map_or("no".to_string(), |b| format!("INT{b}")),
        a.policy,
        a.low,
        a.high,
        a.sink,
        a.window
    );
    let _ = writeln!(
        md,
        "| | pass 1 (no pressure) | pass 2 (budget {:.0}% of pass 1's peak) |",
        a.share * 100.0
    );
    let _ = writeln!(md, "|---|---:|---:|");
    let _ = writeln!(
        md,
        "| budget MiB | {} (capacity) | {} |",
        mib(free.budget),
        mib(tight.budget)
    );
    let _ = writeln!(
        md,
        "| peak KV MiB | {} | {} |",
        mib(free.peak),
        mib(peak_tight)
    );
    let done = |p: &Pass| p.rows.iter().filter(|r| r.error.is_empty()).count();
    let _ = writeln!(
        md,
        "| turns completed | {}/{} | {}/{} |",
        done(free),
        free.rows.len(),
        done(tight),
        tight.rows.len()
    );
    let end = |p: &Pass| {
        p.rows.last().map_or((0, 0, 0, 0), |r| {
            (r.hot_bytes, r.cold_bytes, r.evicted, r.demoted)
        })
    };
    let (fh, fc, fe, fd) = end(free);
    let (th, tc, te, td) = last.map_or((0, 0, 0, 0), |r| {
        (r.hot_bytes, r.cold_bytes, r.evicted, r.demoted)
    });
    let _ = writeln!(
        md,
        "| hot / cold MiB at the end | {} / {} | {} / {} |",
        mib(fh),
        mib(fc),
        mib(th),
        mib(tc)
    );
    let _ = writeln!(md, "| entries evicted | {fe} | {te} |");
    let idle = |p: &Pass| p.rows.last().map_or(0, |r| r.evicted_idle);
    let _ = writeln!(
        md,
        "| of which from idle sessions, for another's step | {} | {} |",
        idle(free),
        idle(tight)
    );
    let _ = writeln!(md, "| blocks demoted to the cold tier | {fd} | {td} |");
    let _ = writeln!(
        md,
        "| sessions that lost an entry | {} | {} |",
        free.evicted.iter().filter(|&&e| e).count(),
        tight.evicted.iter().filter(|&&e| e).count()
    );
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Turns after which their session still held every entry answer exactly as in pass 1: \
         **{intact_same}/{}**. Sessions that never lost an entry in pass 2 answer exactly as in \
         pass 1: {untouched_same}/{}; sessions that did: {touched_same}/{} still answer the same \
         in every turn.\n",
        intact.len(),
        untouched.len(),
        n - untouched.len()
    );
    if !failed.is_empty() {
        let _ = writeln!(
            md,
            "Turns refused in pass 2 (rolled back; the session went on):\n"
        );
        for r in failed.iter().take(10) {
            let _ = writeln!(md, "- session {} turn {}: {}", r.session, r.turn, r.error);
        }
        if failed.len() > 10 {
            let _ = writeln!(md, "- … {} more", failed.len() - 10);
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "Per turn: `turns.csv`.");
    out.report(&md)
}
