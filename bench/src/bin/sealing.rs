//! Turn-tail experiment: hit rate of reusable tokens and KV memory held, per
//! block size, with the last block of each turn not cached, sealed, or
//! copied by the request that continues it.
//!
//! `cargo run -p kvforge-bench --release --bin sealing [CHATS] [TURNS] [OUT]`
//! (defaults: 200 chats of 16 turns, `target/sealing`). Prints a Markdown
//! table and writes it, with `sealing.csv`, to OUT. Both index kinds
//! replay the same chats and must agree exactly.

#![allow(clippy::print_stdout)] // a report printer

use anyhow::{Context, bail};
use kvforge_bench::output::{Csv, Output};
use kvforge_bench::sealing::{IndexKind, TurnTail, replay, synthetic_chat};
use kvforge_bench::smollm2_layout;

fn arg(args: &[String], i: usize, name: &str, default: usize) -> anyhow::Result<usize> {
    match args.get(i) {
        None => Ok(default),
        Some(s) => {
            let v: usize = s
                .parse()
                .with_context(|| format!("{name} must be a positive integer, got {s:?}"))?;
            if v == 0 {
                bail!("{name} must be at least 1");
            }
            Ok(v)
        }
    }
}

/// The most turns (all chats together) the replay builds.
const MAX_TURNS: usize = 1_000_000;

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("sealing", run)
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() > 4 {
        bail!("usage: sealing [CHATS] [TURNS] [OUT]");
    }
    let chats = arg(&args, 1, "CHATS", 200)?;
    let turns = arg(&args, 2, "TURNS", 16)?;
    // Every chat is held in memory at once: bounded, not an OOM.
    if chats.saturating_mul(turns) > MAX_TURNS {
        bail!(
            "CHATS × TURNS = {chats} × {turns} is above the {MAX_TURNS} turns this replay holds in memory"
        );
    }
    let mut output = Output::create(args.get(3).map_or("target/sealing", String::as_str))?;
    let mut csv = Csv::new(&[
        "block_size",
        "tail",
        "hit_rate",
        "blocks_held",
        "empty_slots",
    ]);
    let data: Vec<_> = (0..chats as u64)
        .map(|s| synthetic_chat(turns, s))
        .collect();
    let mut out = String::new();
    out.push_str(&format!(
        "Synthetic chats: {chats} x {turns} turns (user 16-160, answer 32-400 tokens). \
         KV in SmolLM2-135M f16 (23,040 B/token).\n\n"
    ));
    out.push_str("| block | hit rate (skip) | hit rate (sealed) | hit rate (copy) | KV held (skip) | KV held (sealed) | KV held (copy) | copy vs skip | empty slots (sealed) |\n");
    out.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for bs in [16usize, 32, 64, 128, 256, 512] {
        let mut rows = Vec::new();
        for tail in [TurnTail::Skip, TurnTail::Seal, TurnTail::Copy] {
            let a = replay(&data, bs, tail, IndexKind::HashChain)?;
            let b = replay(&data, bs, tail, IndexKind::Radix)?;
            if a.replay != b.replay {
                bail!("hash chain and radix disagree at block {bs}, {tail:?}: {a:?} vs {b:?}");
            }
            csv.row([
                bs.to_string(),
                format!("{tail:?}"),
                format!("{:.4}", a.replay.hit_rate()),
                a.replay.blocks_held.to_string(),
                format!("{:.4}", a.waste()),
            ]);
            rows.push(a);
        }
        let (skip, sealed, copy) = (rows[0], rows[1], rows[2]);
        let bytes = |r: &kvforge_bench::sealing::SealRun| {
            r.replay.blocks_held as f64 * smollm2_layout(bs as u32).block_bytes() as f64
                / chats as f64
                / (1 << 20) as f64
        };
        out.push_str(&format!(
            "| {bs} | {:.1}% | {:.1}% | {:.1}% | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.3}x | {:.1}% |\n",
            100.0 * skip.replay.hit_rate(),
            100.0 * sealed.replay.hit_rate(),
            100.0 * copy.replay.hit_rate(),
            bytes(&skip),
            bytes(&sealed),
            bytes(&copy),
            copy.replay.blocks_held as f64 / skip.replay.blocks_held as f64,
            100.0 * sealed.waste(),
        ));
    }
    output.csv("sealing.csv", &csv)?;
    output.report(&out)?;
    print!("{out}");
    Ok(())
}
