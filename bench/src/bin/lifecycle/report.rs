//! The lifecycle experiment's outputs: every turn (`turns.csv`), each
//! configuration summarised (`results.csv`, `report.md`), recall against
//! peak KV and KV per turn (PNGs).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use kvforge_bench::output::{Csv, Output};

use crate::facts::Probe;
use crate::{Args, CONFIGS, Row};

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

/// Writes `turns.csv`, `results.csv`, `report.md` and the PNGs; the
/// report's path.
pub(crate) fn write_outputs(
    a: &Args,
    rows: &[Row],
    budget: u64,
    out: &mut Output,
) -> Result<PathBuf> {
    out.csv("turns.csv", &turns_csv(rows))?;
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
    out.csv("results.csv", &results_csv(&sums, full_peak))?;
    let md = report_md(a, &sums, budget, full_peak);
    plots(out, rows, &sums, &configs)?;
    out.report(&md)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Every turn of every configuration.
fn turns_csv(rows: &[Row]) -> Csv {
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
    csv
}

/// Each configuration summarised, its peak against `full`'s.
fn results_csv(sums: &[Summary], full_peak: u64) -> Csv {
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
    for s in sums {
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
    }
    res
}

/// `report.md`: the setting, then the configurations' table.
fn report_md(a: &Args, sums: &[Summary], budget: u64, full_peak: u64) -> String {
    let full_recall = sums.iter().find(|s| s.config == "full").map(|s| s.kept);
    let pct = |n: usize, d: usize| {
        if d == 0 {
            "–".to_string()
        } else {
            format!("{n}/{d}")
        }
    };
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
    for s in sums {
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
    md
}

/// `recall_vs_peak.png` and `kv_per_turn.png`.
fn plots(out: &mut Output, rows: &[Row], sums: &[Summary], configs: &[String]) -> Result<()> {
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
    Ok(())
}
