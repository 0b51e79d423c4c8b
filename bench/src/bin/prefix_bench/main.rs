//! Prefix reuse on real multi-turn chats (`cargo xtask prefix-bench`).
//!
//! 1. Replays conversations from `chitchat-dataset` (10–20 human turns; each
//!    human turn is a user message, SmolLM2 writes the answers) statelessly
//!    through the engine's `CacheManager` (partial turn tails copied), for
//!    each block size of `--block-sizes`, `--repeats` times. Per turn it
//!    times the first token with reuse and with a full recompute of the same
//!    prompt, the two interleaved (their order alternates), and reports
//!    medians over chats and repeats: single sequential runs on a busy
//!    2-core machine swing by 10x.
//! 2. Replays the same token streams through the prefix index alone for
//!    block sizes 16…512, with turn tails skipped, sealed or copied, for both
//!    index kinds (hit rate of reusable tokens, KV held).
//!
//! Writes `per_turn.csv`, `sweep.csv`, `report.md`, `ttft.png` and
//! `hit_rate.png` to the output directory.

#![allow(clippy::print_stdout)] // a report printer

mod report;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_bench::cli::{self, Chats, Common};
use kvforge_bench::output::Output;
use kvforge_bench::sealing::{self, Turn, TurnTail};
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, Message, ReuseConfig, Sampler, SamplingParams, Sequence,
    Tokenizer,
};

/// Prefix reuse across the turns of chats, per block size.
#[derive(Parser)]
#[command(name = "prefix-bench")]
struct Args {
    /// Chats.
    #[arg(long, default_value_t = 2, value_parser = cli::positive)]
    chats: usize,
    /// Turns per chat (10..=20).
    #[arg(long, default_value_t = 16, value_parser = cli::positive)]
    turns: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 32, value_parser = cli::positive)]
    answer_tokens: usize,
    /// Block sizes to compare.
    #[arg(long, value_delimiter = ',', default_values_t = [16, 32, 64, 128, 256, 512], value_parser = cli::positive)]
    block_sizes: Vec<usize>,
    /// Repeats (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = cli::positive)]
    repeats: usize,
    /// Weight dtype.
    #[arg(long, default_value = "f32")]
    weights: String,
    #[command(flatten)]
    chats_file: Chats,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/prefix-bench")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if !(10..=20).contains(&a.turns) {
        bail!("--turns must be within 10..=20 (the conversations this workload takes)");
    }
    Ok(a)
}

struct Row {
    block_size: usize,
    repeat: usize,
    chat: usize,
    turn: usize,
    prompt: usize,
    reusable: usize,
    reused: usize,
    ttft_reuse: f64,
    ttft_recompute: f64,
    kv_cached_bytes: u64,
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("prefix-bench", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let chats = kvforge_bench::load_chats(&a.chats_file.data, a.turns, a.chats, 10..=20)?;
    let mut out = Output::create(a.out())?;
    let total = (a.repeats * a.block_sizes.len() * a.chats * a.turns) as u64;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} turns {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    let mut streams: Vec<Vec<Turn>> = Vec::new();
    for repeat in 0..a.repeats {
        for &bs in &a.block_sizes {
            bar.set_message(format!("block {bs}, repeat {}", repeat + 1));
            let got = replay_chats(&a, &chats, bs, repeat, &mut rows, &bar)?;
            if streams.is_empty() {
                streams = got;
            } else if got
                .iter()
                .zip(&streams)
                .any(|(x, y)| x.iter().map(|t| &t.answer).ne(y.iter().map(|t| &t.answer)))
            {
                bail!("greedy answers differ between runs (block {bs}, repeat {repeat})");
            }
        }
    }
    bar.finish_and_clear();

    // The sweep: the same token streams through the index alone.
    let mut sweep = Vec::new();
    for bs in [16usize, 32, 64, 128, 256, 512] {
        for tail in [TurnTail::Skip, TurnTail::Seal, TurnTail::Copy] {
            let chain = sealing::replay(&streams, bs, tail, sealing::IndexKind::HashChain)?;
            let radix = sealing::replay(&streams, bs, tail, sealing::IndexKind::Radix)?;
            if chain.replay != radix.replay {
                bail!("hash chain and radix disagree at block {bs}, {tail:?}");
            }
            sweep.push(chain);
        }
    }
    report::write_outputs(&a, &rows, &sweep, &mut out)?;
    Ok(())
}

/// One stateless replay of every chat at block size `bs`; returns the token
/// streams (user messages and answers).
fn replay_chats(
    a: &Args,
    chats: &[Vec<String>],
    bs: usize,
    repeat: usize,
    rows: &mut Vec<Row>,
    bar: &ProgressBar,
) -> Result<Vec<Vec<Turn>>> {
    let cfg = EngineConfig {
        weight_kind: Some(kvforge_engine::parse_dtype(&a.weights)?),
        block_size: bs,
        ..Default::default()
    };
    let engine = Engine::load(&a.common.model, &cfg)
        .with_context(|| format!("loading {}", a.common.model.display()))?;
    let reuse = ReuseConfig {
        seed: Some(0),
        ..Default::default()
    };
    let m = CacheManager::new(engine, reuse)?;
    let params = SamplingParams {
        max_tokens: a.answer_tokens,
        ..Default::default()
    };
    let eos = m.with_engine(|e| e.tokenizer().eos);
    let recompute = |prompt: &[u32]| {
        m.with_engine(|e| -> Result<f64> {
            let t0 = Instant::now();
            let mut seq = Sequence::default();
            let logits = e
                .model()
                .forward(prompt, &mut e.cache().view(&mut seq), false)?;
            let row: Vec<f32> = Vec::<f32>::try_from(logits.flatten(0, -1))?;
            let _first = Sampler::new(SamplingParams::default())?.sample(&row);
            let secs = t0.elapsed().as_secs_f64();
            e.cache().free(&mut seq)?;
            Ok(secs)
        })
    };
    let mut streams = Vec::new();
    for (c, chat) in chats.iter().enumerate() {
        let mut prompt: Vec<u32> = Vec::new();
        let mut forwarded = 0usize;
        let mut stream = Vec::new();
        for (t, msg) in chat.iter().enumerate() {
            let text = if t == 0 {
                Tokenizer::chat_prompt(&[Message::new("user", msg.as_str())])
            } else {
                format!("<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n")
            };
            let user = m.with_engine(|e| e.tokenizer().encode(&text))?;
            prompt.extend(&user);
            // Interleaved: the recompute runs before or after the request,
            // alternating, so neither always meets a warmer machine.
            let first = (repeat + t) % 2 == 0;
            let before = if first {
                Some(recompute(&prompt)?)
            } else {
                None
            };
            let r = m.complete(&prompt, &format!("chat-{c}"), &params, &mut |_, _| true)?;
            let ttft_recompute = match before {
                Some(x) => x,
                None => recompute(&prompt)?,
            };
            let kv_cached_bytes = m.with_engine(|e| {
                e.cache()
                    .tier_stats()
                    .iter()
                    .map(|t| (t.pool.in_use + t.pool.cached_free) as u64 * t.pool.block_bytes)
                    .sum::<u64>()
            });
            rows.push(Row {
                block_size: bs,
                repeat,
                chat: c,
                turn: t + 1,
                prompt: prompt.len(),
                reusable: forwarded,
                reused: r.reused_tokens,
                ttft_reuse: r.ttft_secs,
                ttft_recompute,
                kv_cached_bytes,
            });
            // The model ran the prompt and every sampled token but the last.
            forwarded = prompt.len() + r.generation.tokens.len().saturating_sub(1);
            let mut answer = r.generation.tokens;
            if answer.last() == Some(&eos) {
                answer.pop(); // the next turn's template re-adds <|im_end|>
            }
            prompt.extend(&answer);
            stream.push(Turn { user, answer });
            bar.inc(1);
        }
        streams.push(stream);
    }
    Ok(streams)
}
