//! The report built from the records of measured items: `report.md`,
//! `results.csv`, `turns.csv` and the PNGs.

use std::fmt::Write as _;

use anyhow::Result;

use crate::config::{Experiment, Mechanisms};
use crate::inputs::median;
use crate::numbers::{MIB, max, mean, with_change, with_points};
use crate::output::Output;
use crate::plot;
use crate::record::Record;

/// Where and how the run happened (recorded in the report).
#[derive(Clone, Debug, Default)]
pub struct RunInfo {
    /// The experiment file.
    pub config_path: String,
    /// Its text.
    pub config_text: String,
    /// Seconds this invocation took (a resumed run measures only what was
    /// missing; the report also gives the sum of every item's time).
    pub wall_secs: f64,
}

/// Per-configuration aggregates of every workload (NaN where a workload
/// did not run or all its items failed).
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Configuration name.
    pub name: String,
    /// Its mechanisms in words.
    pub mechanisms: String,
    /// Chat: the largest KV bytes held during any turn, MiB.
    pub chat_peak_mib: f64,
    /// Chat: mean over turns of each turn's peak, MiB.
    pub chat_mean_mib: f64,
    /// Chat: fraction of planted facts recalled.
    pub recall: f64,
    /// Chat: prompt tokens whose KV came from the prefix index.
    pub hit_rate: f64,
    /// Chat: median time to first token, ms.
    pub ttft_ms: f64,
    /// Stream: perplexity over every scored token of every context.
    pub ppl: f64,
    /// Stream: peak KV at the longest context, MiB.
    pub stream_mib: f64,
    /// Stream: decode tokens/s at the longest context.
    pub decode_tok_s: f64,
    /// Passkey: fraction retrieved.
    pub passkey: f64,
    /// Passkey: mean peak KV, MiB.
    pub passkey_mib: f64,
    /// Items that failed.
    pub failed: usize,
}

/// Describes a configuration's mechanisms in a few words.
pub fn describe(exp: &Experiment, m: &Mechanisms) -> String {
    let words = m.describe(exp.block_size(m), &exp.registry);
    match m.target_kv {
        Some(t) => format!(
            "sized to {}% of the KV per item (budget and window set per item: knob_tokens in results.csv): {words}",
            t * 100.0
        ),
        None => words,
    }
}

/// Aggregates the records of each configuration of `exp`.
pub fn summarize(exp: &Experiment, records: &[Record]) -> Vec<Summary> {
    exp.matrix()
        .into_iter()
        .map(|m| {
            let of = |w: &str| -> Vec<&Record> {
                records
                    .iter()
                    .filter(|r| r.config == m.name() && r.workload == w && r.error.is_none())
                    .collect()
            };
            let chat = of("chat");
            let stream = of("stream");
            let pass = of("passkey");
            let sum = |rs: &[&Record], k: &str| rs.iter().map(|r| r.get(k)).sum::<f64>();
            // Every article's item at the longest context.
            let context = max(stream.iter().map(|r| r.get("context")));
            let longest: Vec<&Record> = stream
                .iter()
                .filter(|r| r.get("context") == context)
                .copied()
                .collect();
            Summary {
                name: m.name().to_string(),
                mechanisms: describe(exp, m),
                chat_peak_mib: max(chat.iter().map(|r| r.get("peak_kv_bytes") / MIB)),
                chat_mean_mib: mean(chat.iter().map(|r| r.get("mean_kv_bytes") / MIB)),
                recall: mean(chat.iter().map(|r| r.get("recalled"))),
                hit_rate: if chat.is_empty() {
                    f64::NAN
                } else {
                    sum(&chat, "index_hit_tokens") / sum(&chat, "prompt_tokens").max(1.0)
                },
                ttft_ms: median(
                    chat.iter()
                        .flat_map(|r| {
                            r.turns
                                .iter()
                                .map(|t| t.get("ttft_ms").copied().unwrap_or(f64::NAN))
                        })
                        .collect(),
                ),
                ppl: if stream.is_empty() {
                    f64::NAN
                } else {
                    (sum(&stream, "nll_sum") / sum(&stream, "scored").max(1.0)).exp()
                },
                stream_mib: mean(longest.iter().map(|r| r.get("kv_bytes") / MIB)),
                decode_tok_s: mean(longest.iter().map(|r| r.get("decode_tok_s"))),
                passkey: mean(pass.iter().map(|r| r.get("correct"))),
                passkey_mib: mean(pass.iter().map(|r| r.get("kv_bytes") / MIB)),
                failed: records
                    .iter()
                    .filter(|r| r.config == m.name() && r.error.is_some())
                    .count(),
            }
        })
        .collect()
}

/// Writes `results.csv`, `turns.csv`, the PNGs and `report.md` to `out`
/// (the commit and machine of this invocation from its provenance).
pub fn write(out: &mut Output, exp: &Experiment, records: &[Record], info: &RunInfo) -> Result<()> {
    let now = out.provenance().clone();
    let summary = summarize(exp, records);
    let base = summary
        .iter()
        .find(|s| s.name == exp.baseline())
        .cloned()
        .unwrap_or_default();
    let mut md = String::new();
    let _ = writeln!(md, "# Ablation `{}`\n", exp.name);
    let _ = writeln!(
        md,
        "Measured at commit {}; configuration `{}`; {}, CPU run; items measured in {:.0} s (their sum), \
         this invocation took {:.0} s. \
         Changes are against `{}`. Model: {}.\n",
        commits(records, &now.commit),
        info.config_path,
        now.machine,
        records.iter().map(|r| r.secs).sum::<f64>(),
        info.wall_secs,
        exp.baseline(),
        model_words(exp)
    );
    let qualities = crate::intervals::qualities(exp, records);
    md.push_str(&crate::iso::write(out, exp, records, &qualities)?);
    md.push_str("\n## Every measure\n\n");
    md.push_str(
        "| configuration | mechanisms | chat peak KV MiB | chat mean KV MiB | fact recall | prefix hit | TTFT ms (median) | stream KV MiB | perplexity | decode tok/s | passkey | passkey KV MiB | failed |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in &summary {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.name,
            s.mechanisms,
            with_change(s.chat_peak_mib, base.chat_peak_mib, 1),
            with_change(s.chat_mean_mib, base.chat_mean_mib, 1),
            with_points(s.recall, base.recall),
            if s.hit_rate.is_finite() {
                format!("{:.0}%", s.hit_rate * 100.0)
            } else {
                "–".into()
            },
            with_change(s.ttft_ms, base.ttft_ms, 0),
            with_change(s.stream_mib, base.stream_mib, 1),
            with_change(s.ppl, base.ppl, 3),
            with_change(s.decode_tok_s, base.decode_tok_s, 1),
            with_points(s.passkey, base.passkey),
            with_change(s.passkey_mib, base.passkey_mib, 1),
            s.failed,
        );
    }
    let (quality, intervals) = crate::intervals::section(exp, records);
    md.push_str(&format!(
        "\nKV MiB are bytes held by blocks in use in all tiers (hot {} pool blocks and \
         quantized cold blocks, each shared block once), at their peak. Speed columns \
         (TTFT, decode) are single sequential runs on a shared machine: indicative only; \
         `cargo xtask decode-ab` measures decode speed interleaved.\n",
        crate::HOT_KV
    ));
    md.push_str(&quality);
    crate::tables::workload_sections(&mut md, exp, records);
    let failures: Vec<&Record> = records.iter().filter(|r| r.error.is_some()).collect();
    if !failures.is_empty() {
        md.push_str(
            "\n## Failures\n\n| configuration | workload | item | error |\n|---|---|---|---|\n",
        );
        for r in failures {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                r.config,
                r.workload,
                r.item,
                r.error.as_deref().unwrap_or("").replace('|', "/")
            );
        }
    }
    let _ = write!(
        md,
        "\n## The experiment file\n\n```toml\n{}\n```\n",
        info.config_text.trim_end()
    );
    out.csv("results.csv", &crate::tables::results_csv(records))?;
    out.csv("turns.csv", &crate::tables::turns_csv(records))?;
    out.csv("intervals.csv", &intervals)?;
    plots(out, exp, records, &summary)?;
    out.report(&md)?;
    Ok(())
}

/// The commits that measured `records`, in order of first appearance.
fn commits(records: &[Record], now: &str) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for r in records {
        let c = if r.commit.is_empty() {
            now
        } else {
            r.commit.as_str()
        };
        if !seen.contains(&c) {
            seen.push(c);
        }
    }
    if seen.is_empty() {
        seen.push(now);
    }
    seen.iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn model_words(exp: &Experiment) -> String {
    let m = &exp.model;
    let what = match &m.random {
        Some(r) => format!(
            "random weights ({} layers, d_model {}, {} KV heads), tokenizer of `{}`",
            r.layers,
            r.d_model,
            r.kv_heads,
            m.path.display()
        ),
        None => format!("`{}`", m.path.display()),
    };
    format!(
        "{what}, {} weights, f32 compute, {} hot KV, block {}",
        m.weights,
        crate::HOT_KV,
        m.block_size
    )
}

fn plots(
    out: &mut Output,
    exp: &Experiment,
    records: &[Record],
    summary: &[Summary],
) -> Result<()> {
    let pts = |f: fn(&Summary) -> (f64, f64)| -> Vec<(String, f64, f64)> {
        summary
            .iter()
            .map(|s| {
                let (x, y) = f(s);
                (s.name.clone(), x, y)
            })
            .collect()
    };
    if exp.workloads.stream.is_some() {
        out.png("pareto.png", |path| {
            plot::scatter_plot(
                path,
                "Memory against quality (streaming perplexity)",
                "peak KV MiB at the longest context",
                "perplexity",
                &pts(|s| (s.stream_mib, s.ppl)),
                true,
            )
        })?;
    }
    if exp.workloads.passkey.is_some() {
        out.png("passkey.png", |path| {
            plot::scatter_plot(
                path,
                "Pass key accuracy against KV budget",
                "mean peak KV MiB",
                "accuracy",
                &pts(|s| (s.passkey_mib, s.passkey)),
                false,
            )
        })?;
    }
    if exp.workloads.chat.is_some() {
        let mut series: Vec<(&str, Vec<(f64, f64)>)> = Vec::new();
        for m in exp.matrix() {
            let first = records
                .iter()
                .find(|r| r.config == m.name() && r.workload == "chat" && r.error.is_none());
            if let Some(r) = first {
                let line = r
                    .turns
                    .iter()
                    .enumerate()
                    .filter_map(|(i, t)| Some(((i + 1) as f64, t.get("kv_bytes")? / MIB)))
                    .collect();
                series.push((m.name(), line));
            }
        }
        let turns = series.iter().map(|s| s.1.len()).max().unwrap_or(1) as f64;
        let top = series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| p.1))
            .fold(0.0f64, f64::max);
        out.png("chat_kv.png", |path| {
            plot::line_plot(
                path,
                "KV held over a conversation (first chat)",
                "turn",
                "KV MiB",
                (1.0, turns.max(2.0)),
                (0.0, (top * 1.1).max(1e-3)),
                &series,
            )
        })?;
    }
    Ok(())
}
