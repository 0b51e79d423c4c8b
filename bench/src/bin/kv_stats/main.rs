//! How often does the KV cache hold near-duplicate vectors?
//! (`cargo xtask kv-stats`)
//!
//! Runs real texts through the model (the longest Wikipedia articles, the
//! setup's source code and technical manuals, a chitchat conversation whose
//! messages quote earlier ones), records every layer's keys (after RoPE, and
//! before: RoPE is undone exactly, it is a rotation) and values, and for
//! each vector finds its best cosine match:
//!
//! * `positions`: among the earlier vectors of the same layer and KV head;
//! * `layers`: the same position and head one layer down (MiniCache's axis);
//! * `sequences`: among all vectors of another text, same layer and head.
//!
//! at token granularity (one head vector) and block granularity (a block
//! of `--block` tokens of one head, flattened; and the whole cold block —
//! every layer's K and V — which is what the cache aliases today). Also the
//! exact duplicates after INT4 quantization (group 32 per token; per-channel
//! keys over the block at block granularity, as the cold tier stores them).
//!
//! Writes `kv_stats.csv` (one row per text × axis × granularity × kind ×
//! layer), `report.md` (the summary) and `best_cos_<text>.png` (the share of
//! vectors whose best match reaches each cosine) to `--out`.

#![allow(clippy::print_stdout)] // a report printer

mod measure;
mod report;
mod sharing;
mod vectors;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvforge_bench::cli::{self, Common};
use kvforge_bench::load_chats;
use kvforge_bench::output::Output;
use kvforge_engine::ppl::articles;
use kvforge_engine::{Engine, EngineConfig, Message};

const THRESHOLDS: [f64; 3] = [0.90, 0.95, 0.99];

/// How often KV vectors repeat: best cosines across positions, layers and
/// texts, INT4 code duplicates, and token-level sharing simulated.
#[derive(Parser)]
#[command(name = "kv-stats")]
struct Args {
    /// Tokens per text.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// The data folder `cargo xtask setup` fills.
    #[arg(long, default_value = "data")]
    data: PathBuf,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/kv-stats")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if a.block < 2 || a.tokens < 4 * a.block || a.tokens % a.block != 0 {
        bail!(
            "--tokens ({}) must be a multiple of --block ({}) and at least 4 blocks; --block at least 2",
            a.tokens,
            a.block
        );
    }
    Ok(a)
}

struct Text {
    name: String,
    tokens: Vec<u32>,
    /// The text whose vectors this one is matched against on the
    /// `sequences` axis.
    other: Option<Vec<u32>>,
}

fn texts(e: &Engine, a: &Args) -> Result<Vec<Text>> {
    let read = |f: &str| -> Result<String> {
        let p = a.data.join("exllamav2").join(f);
        std::fs::read_to_string(&p)
            .with_context(|| format!("reading {} (run `cargo xtask setup`)", p.display()))
    };
    let n = a.tokens;
    let cut = |name: &str, ids: Vec<u32>| -> Result<Vec<u32>> {
        if ids.len() < n {
            bail!("{name}: only {} tokens, {n} asked", ids.len());
        }
        Ok(ids[..n].to_vec())
    };
    let wiki = articles(&read("wiki.utf8")?);
    let (w0, w1) = match (wiki.first(), wiki.get(1)) {
        (Some(a), Some(b)) => (a, b),
        _ => bail!("wiki.utf8 holds fewer than two articles"),
    };
    let enc = |s: &str| e.tokenizer().encode_text(s);
    let code = enc(&read("code.utf8")?)?;
    let tech = enc(&read("technical.utf8")?)?;
    // A chat whose every third message quotes the message before last.
    let chats = load_chats(&a.data.join("chitchat/dataset.json"), 10, 40, 10..=40)?;
    let mut msgs = Vec::new();
    for chat in &chats {
        for (i, text) in chat.iter().enumerate() {
            let content = if i >= 2 && i % 3 == 2 {
                format!("You said: \"{}\"\n{text}", chat[i - 2])
            } else {
                text.clone()
            };
            let role = if msgs.len() % 2 == 0 {
                "user"
            } else {
                "assistant"
            };
            msgs.push(Message::new(role, content));
        }
        if e.tokenizer().chat_ids(&msgs)?.len() > 2 * n {
            break;
        }
    }
    let chat = e.tokenizer().chat_ids(&msgs)?;
    Ok(vec![
        Text {
            name: "wiki".into(),
            tokens: cut("wiki", enc(w0)?)?,
            other: Some(cut("wiki (2nd article)", enc(w1)?)?),
        },
        Text {
            name: "code".into(),
            tokens: cut("code", code.clone())?,
            other: code.get(n..2 * n).map(<[u32]>::to_vec),
        },
        Text {
            name: "technical".into(),
            tokens: cut("technical", tech.clone())?,
            other: tech.get(n..2 * n).map(<[u32]>::to_vec),
        },
        Text {
            name: "chat-quote".into(),
            tokens: cut("chat-quote", chat.clone())?,
            other: chat.get(n..2 * n).map(<[u32]>::to_vec),
        },
    ])
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("kv-stats", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let e = Engine::load(&a.common.model, &EngineConfig::default()).with_context(|| {
        format!(
            "loading {} (run `cargo xtask setup`)",
            a.common.model.display()
        )
    })?;
    let texts = texts(&e, &a)?;
    let mut out = Output::create(a.out())?;
    let t0 = std::time::Instant::now();
    let mut stats = Vec::new();
    for t in &texts {
        println!("{}: {} tokens", t.name, t.tokens.len());
        stats.extend(measure::measure(&e, &a, t)?);
    }
    let mut sims = Vec::new();
    for t in &texts {
        sims.push(sharing::simulate(
            &e, &t.name, &t.tokens, false, None, false,
        )?);
        for (keys, lsh) in [(false, false), (false, true), (true, false)] {
            for th in [0.99, 0.95, 0.90] {
                let what = match (keys, lsh) {
                    (true, _) => "k+v",
                    (false, false) => "v",
                    (false, true) => "v (SimHash)",
                };
                println!("{}: sharing {what} at cosine {th}", t.name);
                sims.push(sharing::simulate(
                    &e,
                    &t.name,
                    &t.tokens,
                    keys,
                    Some(th),
                    lsh,
                )?);
            }
        }
    }
    report::write_csv(&stats, &mut out)?;
    let mut md = report::report(&a, &texts, &stats, t0.elapsed().as_secs_f64());
    report::write_simulated(&sims, &mut md, &mut out)?;
    for t in &texts {
        report::plot(&t.name, &stats, &mut out)?;
    }
    let report = out.report(&md)?;
    println!("wrote {}", report.display());
    Ok(())
}
