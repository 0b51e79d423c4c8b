//! The prefix benchmark's outputs: `per_turn.csv`, `sweep.csv`,
//! `report.md` (reuse per block size, per turn, and the index-only sweep)
//! and the PNGs.

use anyhow::Result;
use kvforge_bench::median;
use kvforge_bench::output::{Csv, Output};
use kvforge_bench::sealing::{self, TurnTail};
use kvforge_bench::smollm2_layout;

use crate::{Args, Row};

/// Writes every output to `out` and prints the report.
pub(crate) fn write_outputs(
    a: &Args,
    rows: &[Row],
    sweep: &[sealing::SealRun],
    out: &mut Output,
) -> Result<()> {
    out.csv("per_turn.csv", &per_turn_csv(rows))?;
    out.csv("sweep.csv", &sweep_csv(a, sweep))?;
    let bs0 = a.block_sizes[0];
    let mut md = block_table(a, rows);
    md.push_str(&turn_table(a, rows, bs0));
    md.push_str(&sweep_table(a, sweep));
    plots(a, rows, sweep, bs0, out)?;
    out.report(&md)?;
    println!("{md}");
    println!("written to {}", a.out().display());
    Ok(())
}

/// The median of `f` over the rows of `turn` at block size `bs`.
fn per_turn(rows: &[Row], bs: usize, turn: usize, f: &dyn Fn(&Row) -> f64) -> f64 {
    median(
        rows.iter()
            .filter(|r| r.turn == turn && r.block_size == bs)
            .map(f)
            .collect(),
    )
}

/// Every turn of every replay.
fn per_turn_csv(rows: &[Row]) -> Csv {
    let mut csv = Csv::new(&[
        "block_size",
        "repeat",
        "chat",
        "turn",
        "prompt_tokens",
        "reusable_tokens",
        "reused_tokens",
        "hit_rate",
        "ttft_reuse_ms",
        "ttft_recompute_ms",
        "kv_cached_bytes",
    ]);
    for r in rows {
        let hit = if r.reusable == 0 {
            f64::NAN
        } else {
            r.reused as f64 / r.reusable as f64
        };
        csv.row([
            r.block_size.to_string(),
            r.repeat.to_string(),
            r.chat.to_string(),
            r.turn.to_string(),
            r.prompt.to_string(),
            r.reusable.to_string(),
            r.reused.to_string(),
            format!("{hit:.4}"),
            format!("{:.2}", r.ttft_reuse * 1e3),
            format!("{:.2}", r.ttft_recompute * 1e3),
            r.kv_cached_bytes.to_string(),
        ]);
    }
    csv
}

/// The index-only sweep: hit rate and KV held per block size and tail.
fn sweep_csv(a: &Args, sweep: &[sealing::SealRun]) -> Csv {
    let mut scsv = Csv::new(&[
        "block_size",
        "tail",
        "hit_rate",
        "kv_held_mib_per_chat",
        "empty_slots",
    ]);
    for s in sweep {
        scsv.row([
            s.block_size.to_string(),
            format!("{:?}", s.tail),
            format!("{:.4}", s.replay.hit_rate()),
            format!("{:.3}", kv_mib(s, a.chats)),
            format!("{:.4}", s.waste()),
        ]);
    }
    scsv
}

/// The setting, then reuse and TTFT per block size.
fn block_table(a: &Args, rows: &[Row]) -> String {
    let mut md = format!(
        "Stateless replay of {} chitchat conversations x {} turns (SmolLM2-135M, {} weights, \
         hash-chain index, turn tails copied; answers {} greedy tokens), {} repeats per block size. \
         Time to first token with reuse and with a full recompute of the same prompt, measured \
         interleaved; medians over chats and repeats.\n\n\
         | block | hit rate | TTFT reuse, median (ms) | TTFT recompute, median (ms) | median ratio, turns 2+ | KV cached, last turn (MiB) |\n\
         |---:|---:|---:|---:|---:|---:|\n",
        a.chats, a.turns, a.weights, a.answer_tokens, a.repeats
    );
    for &bs in &a.block_sizes {
        let of: Vec<&Row> = rows.iter().filter(|r| r.block_size == bs).collect();
        let later: Vec<&&Row> = of.iter().filter(|r| r.turn > 1).collect();
        let reusable: usize = later.iter().map(|r| r.reusable).sum();
        let reused: usize = later.iter().map(|r| r.reused.min(r.reusable)).sum();
        let last: Vec<f64> = of
            .iter()
            .filter(|r| r.turn == a.turns)
            .map(|r| r.kv_cached_bytes as f64 / (1 << 20) as f64)
            .collect();
        md.push_str(&format!(
            "| {bs} | {:.1}% | {:.1} | {:.1} | {:.3} | {:.1} |\n",
            100.0 * reused as f64 / reusable.max(1) as f64,
            median(later.iter().map(|r| r.ttft_reuse * 1e3).collect()),
            median(later.iter().map(|r| r.ttft_recompute * 1e3).collect()),
            median(
                later
                    .iter()
                    .map(|r| r.ttft_reuse / r.ttft_recompute)
                    .collect()
            ),
            median(last),
        ));
    }
    md
}

/// Turn by turn at block size `bs0`.
fn turn_table(a: &Args, rows: &[Row], bs0: usize) -> String {
    let mut md = String::new();
    md.push_str(&format!(
        "\nPer turn at block {bs0} (medians over chats and repeats):\n\n\
         | turn | prompt tokens | reused tokens | TTFT reuse (ms) | TTFT recompute (ms) | ratio |\n\
         |---:|---:|---:|---:|---:|---:|\n"
    ));
    for t in 1..=a.turns {
        let (tr, tc) = (
            per_turn(rows, bs0, t, &|r| r.ttft_reuse * 1e3),
            per_turn(rows, bs0, t, &|r| r.ttft_recompute * 1e3),
        );
        md.push_str(&format!(
            "| {t} | {:.0} | {:.0} | {tr:.1} | {tc:.1} | {:.3} |\n",
            per_turn(rows, bs0, t, &|r| r.prompt as f64),
            per_turn(rows, bs0, t, &|r| r.reused as f64),
            per_turn(rows, bs0, t, &|r| r.ttft_reuse / r.ttft_recompute),
        ));
    }
    md
}

/// The index-only sweep, each tail side by side.
fn sweep_table(a: &Args, sweep: &[sealing::SealRun]) -> String {
    let mut md = String::new();
    md.push_str(
        "\nSweep: the same token streams through the prefix index alone (hash chain and radix agree exactly). \
         KV held: the blocks the live conversation holds after its last turn.\n\n\
         | block | hit rate, skip | sealed | copy | KV held per chat, skip (MiB) | sealed | copy | copy / skip |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for tri in sweep.chunks(3) {
        md.push_str(&format!(
            "| {} | {:.1}% | {:.1}% | {:.1}% | {:.2} | {:.2} | {:.2} | {:.3}x |\n",
            tri[0].block_size,
            100.0 * tri[0].replay.hit_rate(),
            100.0 * tri[1].replay.hit_rate(),
            100.0 * tri[2].replay.hit_rate(),
            kv_mib(&tri[0], a.chats),
            kv_mib(&tri[1], a.chats),
            kv_mib(&tri[2], a.chats),
            tri[2].replay.blocks_held as f64 / tri[0].replay.blocks_held.max(1) as f64,
        ));
    }
    md
}

/// `ttft.png` and `hit_rate.png`.
fn plots(
    a: &Args,
    rows: &[Row],
    sweep: &[sealing::SealRun],
    bs0: usize,
    out: &mut Output,
) -> Result<()> {
    let turns: Vec<usize> = (1..=a.turns).collect();
    let reuse: Vec<(f64, f64)> = turns
        .iter()
        .map(|&t| (t as f64, per_turn(rows, bs0, t, &|r| r.ttft_reuse * 1e3)))
        .collect();
    let full: Vec<(f64, f64)> = turns
        .iter()
        .map(|&t| {
            (
                t as f64,
                per_turn(rows, bs0, t, &|r| r.ttft_recompute * 1e3),
            )
        })
        .collect();
    let ymax = full.iter().chain(&reuse).map(|p| p.1).fold(1.0, f64::max) * 1.1;
    out.png("ttft.png", |path| {
        kvforge_bench::plot::line_plot(
            path,
            &format!("Time to first token per turn (block {bs0}, medians)"),
            "turn",
            "ms",
            (1.0, a.turns as f64),
            (0.0, ymax),
            &[("full recompute", full), ("prefix reuse", reuse)],
        )
    })?;
    let xs = |tail: TurnTail| -> Vec<(f64, f64)> {
        sweep
            .iter()
            .filter(|s| s.tail == tail)
            .map(|s| ((s.block_size as f64).log2(), 100.0 * s.replay.hit_rate()))
            .collect()
    };
    out.png("hit_rate.png", |path| {
        kvforge_bench::plot::line_plot(
            path,
            "Hit rate of reusable tokens vs log2(block size)",
            "log2(block size)",
            "%",
            (4.0, 9.0),
            (0.0, 100.0),
            &[
                ("tail not cached", xs(TurnTail::Skip)),
                ("sealed", xs(TurnTail::Seal)),
                ("copied", xs(TurnTail::Copy)),
            ],
        )
    })?;
    Ok(())
}

fn kv_mib(s: &sealing::SealRun, chats: usize) -> f64 {
    s.replay.blocks_held as f64 * smollm2_layout(s.block_size as u32).block_bytes() as f64
        / chats as f64
        / (1 << 20) as f64
}
