//! The outputs: `kv_stats.csv`, `simulated.csv`, `report.md` and a PNG per
//! text of the share of vectors whose best match reaches each cosine.

use std::fmt::Write as _;

use anyhow::Result;
use kvforge_bench::output::{Csv, Output};

use crate::measure::{KINDS, Stat};
use crate::sharing::Simulated;
use crate::{Args, THRESHOLDS, Text};

/// Writes `simulated.csv` and appends its section to `md`.
pub(crate) fn write_simulated(sims: &[Simulated], md: &mut String, out: &mut Output) -> Result<()> {
    let mut csv = Csv::new(&[
        "text",
        "shared",
        "threshold",
        "ppl",
        "ppl_change",
        "vectors_shared",
        "simhash_us_per_token",
    ]);
    md.push_str(
        "\n## Token-level sharing, simulated\n\n\
         Each new value (`v`), or value and pre-RoPE key (`k+v`), whose best cosine among the vectors already stored \
         for its layer and head reaches the threshold is replaced by that vector (keys rotated at their own position), \
         which is exactly what attention reads from a cache that stores it once. `shared` is the share of all K and V \
         vectors stored once instead: the KV bytes an ideal token-level store saves, before the cost of its index \
         (≈ 2 bytes per shared vector against ≈ 36 for an INT4 head vector with its group parameters). \
         `v` searches every stored value exhaustively; `v (SimHash)` offers each value to a `SimHashDedup` per layer \
         and head (16 bits × 4 tables; the first candidate that verifies, not the best, and earlier tokens of the \
         same chunk count too), whose time per token (all layers and heads) is the last column.\n\n\
         | text | shared | cosine ≥ | perplexity | change | vectors shared | SimHash µs / token |\n|---|---|---|---|---|---|---|\n",
    );
    for s in sims {
        let base = sims
            .iter()
            .find(|b| b.text == s.text && b.threshold.is_none())
            .map_or(f64::NAN, |b| b.ppl);
        let change = 100.0 * (s.ppl / base - 1.0);
        let th = s.threshold.map_or("–".into(), |t| format!("{t}"));
        let what = if s.threshold.is_none() {
            "none"
        } else {
            s.what
        };
        let us = s.lsh_us.map_or(String::new(), |u| format!("{u:.0}"));
        csv.row([
            s.text.clone(),
            what.to_string(),
            th.clone(),
            format!("{:.4}", s.ppl),
            format!("{change:.3}"),
            format!("{:.4}", s.shared),
            us.clone(),
        ]);
        let _ = writeln!(
            md,
            "| {} | {what} | {th} | {:.3} | {change:+.2}% | {:.1}% | {} |",
            s.text,
            s.ppl,
            100.0 * s.shared,
            if us.is_empty() { "–" } else { &us }
        );
    }
    out.csv("simulated.csv", &csv)?;
    Ok(())
}

pub(crate) fn write_csv(stats: &[Stat], out: &mut Output) -> Result<()> {
    let mut csv = Csv::new(&[
        "text",
        "axis",
        "granularity",
        "kind",
        "layer",
        "vectors",
        "frac_ge_0.90",
        "frac_ge_0.95",
        "frac_ge_0.99",
        "mean_best_cos",
        "int4_identical",
    ]);
    for s in stats {
        let layer = s.layer.map_or("all".into(), |l| l.to_string());
        let dup = s.int4_dup.map_or(String::new(), |d| format!("{d:.4}"));
        csv.row([
            s.text.clone(),
            s.axis.to_string(),
            s.granularity.to_string(),
            s.kind.to_string(),
            layer,
            s.best.len().to_string(),
            format!("{:.4}", s.frac(0.90)),
            format!("{:.4}", s.frac(0.95)),
            format!("{:.4}", s.frac(0.99)),
            format!("{:.4}", s.mean()),
            dup,
        ]);
    }
    out.csv("kv_stats.csv", &csv)?;
    Ok(())
}

/// Pools the best cosines of `stats` rows matching the filter.
pub(crate) fn pooled<'a>(stats: &'a [Stat], keep: impl Fn(&Stat) -> bool) -> (Vec<f32>, Vec<f64>) {
    let rows: Vec<&'a Stat> = stats.iter().filter(|s| keep(s)).collect();
    let best = rows.iter().flat_map(|s| s.best.iter().copied()).collect();
    let dups = rows.iter().filter_map(|s| s.int4_dup).collect();
    (best, dups)
}

/// The report's main table.
pub(crate) fn report(a: &Args, texts: &[Text], stats: &[Stat], secs: f64) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Near-duplicate KV vectors\n");
    let _ = writeln!(
        md,
        "`cargo xtask kv-stats` — model `{}`, {} tokens per text, blocks of {} tokens; {:.0} s. \
         A row gives the share of vectors whose best cosine match (on that axis) reaches 0.90 / 0.95 / 0.99, \
         pooled over the layers named; `int4 =` is the share whose INT4 codes equal an earlier vector's exactly.\n",
        a.common.model.display(),
        a.tokens,
        a.block,
        secs
    );
    let _ = writeln!(
        md,
        "| text | axis | granularity | kind | layers | ≥ 0.90 | ≥ 0.95 | ≥ 0.99 | mean best | int4 = |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    let fmt = |v: f64| format!("{:.1}%", 100.0 * v);
    for t in texts {
        for (axis, gran) in [
            ("positions", "token"),
            ("positions", "block"),
            ("layers", "token"),
            ("sequences", "token"),
        ] {
            for kind in KINDS {
                for (label, pick) in [
                    ("0", (|l: usize| l == 0) as fn(usize) -> bool),
                    ("1–", |l: usize| l > 0),
                ] {
                    let (best, dups) = pooled(stats, |s| {
                        s.text == t.name
                            && s.axis == axis
                            && s.granularity == gran
                            && s.kind == kind
                            && s.layer.is_some_and(pick)
                    });
                    if best.is_empty() {
                        continue;
                    }
                    let s = Stat {
                        text: String::new(),
                        axis,
                        granularity: gran,
                        kind: kind.into(),
                        layer: None,
                        best,
                        int4_dup: None,
                    };
                    let dup = if dups.is_empty() {
                        "–".into()
                    } else {
                        fmt(dups.iter().sum::<f64>() / dups.len() as f64)
                    };
                    let _ = writeln!(
                        md,
                        "| {} | {axis} | {gran} | {kind} | {label} | {} | {} | {} | {:.3} | {dup} |",
                        t.name,
                        fmt(s.frac(THRESHOLDS[0])),
                        fmt(s.frac(THRESHOLDS[1])),
                        fmt(s.frac(THRESHOLDS[2])),
                        s.mean()
                    );
                }
            }
        }
        for s in stats
            .iter()
            .filter(|s| s.text == t.name && s.granularity == "cold-block")
        {
            let _ = writeln!(
                md,
                "| {} | {} | cold-block | {} | all | {} | {} | {} | {:.3} | – |",
                t.name,
                s.axis,
                s.kind,
                fmt(s.frac(THRESHOLDS[0])),
                fmt(s.frac(THRESHOLDS[1])),
                fmt(s.frac(THRESHOLDS[2])),
                s.mean()
            );
        }
    }
    md
}

/// The share of vectors whose best earlier match reaches each cosine, per
/// kind, token granularity, layers pooled.
pub(crate) fn plot(text: &str, stats: &[Stat], out: &mut Output) -> Result<()> {
    let mut series = Vec::new();
    for kind in KINDS {
        for (label, first) in [("layer 0", true), ("layers 1+", false)] {
            let (mut best, _) = pooled(stats, |s| {
                s.text == text
                    && s.axis == "positions"
                    && s.granularity == "token"
                    && s.kind == kind
                    && s.layer.is_some_and(|l| (l == 0) == first)
            });
            best.sort_by(f32::total_cmp);
            let n = best.len().max(1) as f64;
            let pts: Vec<(f64, f64)> = (0..=50)
                .map(|i| {
                    let x = 0.5 + f64::from(i) / 100.0;
                    let above = best.len() - best.partition_point(|&c| f64::from(c) < x);
                    (x, above as f64 / n)
                })
                .collect();
            series.push((format!("{kind}, {label}"), pts));
        }
    }
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    out.png(&format!("best_cos_{text}.png"), |path| {
        kvforge_bench::plot::line_plot(
            path,
            &format!("{text}: best cosine with an earlier vector (same layer, head)"),
            "cosine",
            "share of vectors at or above",
            (0.5, 1.0),
            (0.0, 1.0),
            &named,
        )
    })?;
    Ok(())
}
