//! The report's quality with 95% intervals: per configuration, fact
//! recall and pass-key accuracy (Wilson) and every quality change against
//! the baseline (paired over the very same items, or the same scored
//! chunks for perplexity), in `report.md` and `intervals.csv`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::config::Experiment;
use crate::output::Csv;
use crate::record::Record;
use crate::stats::{self, Interval, PairedChunk};

/// One quality measure of one configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Quality {
    /// Configuration.
    pub config: String,
    /// `recall`, `passkey` or `ppl`.
    pub metric: &'static str,
    /// Items (chunks for `ppl`) it is measured on.
    pub n: usize,
    /// Its value (a share; for `ppl` the perplexity).
    pub value: f64,
    /// Wilson interval of a share (none for `ppl`).
    pub interval: Option<Interval>,
    /// Change against the baseline on the same items (points of a share;
    /// relative for `ppl`) and its paired interval; none for the baseline.
    pub change: Option<(f64, Interval)>,
    /// The items (chunks) the change pairs: those the baseline measured
    /// too.
    pub paired: usize,
}

/// 0/1 scores of `metric` by item, for configuration `config`.
fn scores(records: &[Record], config: &str, workload: &str, key: &str) -> BTreeMap<String, f64> {
    records
        .iter()
        .filter(|r| r.config == config && r.workload == workload && r.error.is_none())
        .map(|r| (r.item.clone(), r.get(key)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// The stream records of `config` with scored chunks: per article, the
/// one at its longest context. Every item of an article is a prefix of
/// the same tokens, so the chunks of a shorter context repeat the first
/// chunks of a longer one and must not be counted twice.
fn streams<'a>(records: &'a [Record], config: &str) -> Vec<&'a Record> {
    let mut by: BTreeMap<u64, &Record> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.config == config && r.workload == "stream" && r.error.is_none())
        .filter(|r| !r.chunks.is_empty())
    {
        // Records from before several articles have none: article 0.
        let a = article(r);
        if by
            .get(&a)
            .is_none_or(|o| r.get("context") > o.get("context"))
        {
            by.insert(a, r);
        }
    }
    by.into_values().collect()
}

fn article(r: &Record) -> u64 {
    let a = r.get("article");
    if a.is_finite() { a as u64 } else { 0 }
}

/// The chunks of `ours` beside the baseline's on the very same item, in
/// stream order; none when either left out a non-finite chunk (the
/// chunks after it would pair with the wrong tokens).
fn pair(ours: &Record, theirs: &Record) -> Vec<PairedChunk> {
    let dropped = |r: &Record| r.get("dropped_chunks") > 0.0;
    if dropped(ours) || dropped(theirs) || ours.chunks.len() != theirs.chunks.len() {
        return Vec::new();
    }
    ours.chunks
        .iter()
        .zip(&theirs.chunks)
        .filter(|(c, b)| c[0] == b[0])
        .map(|(c, b)| PairedChunk {
            tokens: c[0],
            ours: c[1],
            base: b[1],
        })
        .collect()
}

/// Every configuration's quality measures with their intervals.
pub fn qualities(exp: &Experiment, records: &[Record]) -> Vec<Quality> {
    let base = exp.baseline();
    let seed = exp.model.seed;
    let mut out = Vec::new();
    for m in exp.matrix() {
        let name = m.name();
        let is_base = name == base;
        for (metric, workload, key) in [
            ("recall", "chat", "recalled"),
            ("passkey", "passkey", "correct"),
        ] {
            let ours = scores(records, name, workload, key);
            if ours.is_empty() {
                continue;
            }
            let k = ours.values().filter(|&&v| v > 0.5).count();
            let theirs = scores(records, base, workload, key);
            let (a, b): (Vec<f64>, Vec<f64>) = ours
                .iter()
                .filter_map(|(item, &v)| theirs.get(item).map(|&w| (v, w)))
                .unzip();
            out.push(Quality {
                config: name.to_string(),
                metric,
                n: ours.len(),
                paired: a.len(),
                value: k as f64 / ours.len() as f64,
                interval: stats::wilson(k, ours.len()),
                change: if is_base {
                    None
                } else {
                    stats::paired_difference(&a, &b)
                },
            });
        }
        let ours = streams(records, name);
        if ours.is_empty() {
            continue;
        }
        let mut paired = Vec::new();
        for r in &ours {
            // The baseline's record of the very same item (context).
            let theirs = records.iter().find(|b| {
                b.config == base && b.workload == "stream" && b.item == r.item && b.error.is_none()
            });
            if let Some(b) = theirs {
                paired.extend(pair(r, b));
            }
        }
        let (n, nll) = ours
            .iter()
            .flat_map(|r| &r.chunks)
            .fold((0.0, 0.0), |(n, s), c| (n + c[0], s + c[1]));
        let chunks: usize = ours.iter().map(|r| r.chunks.len()).sum();
        out.push(Quality {
            config: name.to_string(),
            metric: "ppl",
            n: chunks,
            paired: paired.len(),
            value: (nll / n.max(1.0)).exp(),
            interval: None,
            change: if is_base {
                None
            } else {
                stats::ppl_change(&paired, seed)
            },
        });
    }
    out
}

/// A share and its Wilson interval, in percent, and `n`.
pub(super) fn share(q: &Quality) -> String {
    match q.interval {
        Some(i) => format!(
            "{:.0}% [{:.0}–{:.0}%] ({})",
            q.value * 100.0,
            i.lo * 100.0,
            i.hi * 100.0,
            q.n
        ),
        None => "–".into(),
    }
}

/// A change and its interval (`scale` 100: points or percent); bold when
/// the interval excludes zero, with two more digits when the change would
/// read as zero at `digits` (a significant +0.00% says nothing).
pub(super) fn change(q: &Quality, unit: &str, digits: usize) -> String {
    match q.change {
        Some((c, i)) => {
            let digits =
                if i.excludes_zero() && (c * 100.0).abs() < 0.5 * 10f64.powi(-(digits as i32)) {
                    digits + 2
                } else {
                    digits
                };
            let s = format!(
                "{:+.digits$}{unit} [{:+.digits$}, {:+.digits$}]",
                c * 100.0,
                i.lo * 100.0,
                i.hi * 100.0
            );
            // Fewer pairs than items: the baseline lost some of them.
            let s = if q.paired == q.n {
                s
            } else {
                format!("{s} (paired {})", q.paired)
            };
            if i.excludes_zero() {
                format!("**{s}**")
            } else {
                s
            }
        }
        None => "–".into(),
    }
}

/// The section of `report.md` and the rows of `intervals.csv`.
pub fn section(exp: &Experiment, records: &[Record]) -> (String, Csv) {
    let all = qualities(exp, records);
    let mut csv = Csv::new(&[
        "config",
        "metric",
        "n",
        "paired",
        "value",
        "lo",
        "hi",
        "change",
        "change_lo",
        "change_hi",
        "significant",
    ]);
    let f = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v}"));
    for q in &all {
        let (c, ci) = q.change.map_or((None, None), |(c, i)| (Some(c), Some(i)));
        csv.row([
            q.config.clone(),
            q.metric.into(),
            q.n.to_string(),
            q.paired.to_string(),
            format!("{}", q.value),
            f(q.interval.map(|i| i.lo)),
            f(q.interval.map(|i| i.hi)),
            f(c),
            f(ci.map(|i| i.lo)),
            f(ci.map(|i| i.hi)),
            ci.map_or(String::new(), |i| i.excludes_zero().to_string()),
        ]);
    }
    let mut md = format!(
        "\n## Quality with 95% intervals\n\nFact recall and pass-key accuracy with Wilson intervals and their item counts; \
         changes against `{}` on the same items with Tango's score interval for paired proportions (it excludes \
         zero exactly when McNemar's test rejects); the perplexity change with a paired moving-block bootstrap over the same \
         scored chunks of each article's longest stream, the articles' chunks in turn (blocks of {} chunks, {} resamples, seeded). **Bold**: the interval excludes zero — the only changes this run tells \
         apart from noise.\n\n\
         | configuration | fact recall (n) | recall change | pass key (n) | pass-key change | perplexity (chunks) | perplexity change |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
        exp.baseline(),
        stats::PPL_BLOCK,
        stats::RESAMPLES
    );
    for m in exp.matrix() {
        let of = |metric: &str| {
            all.iter()
                .find(|q| q.config == m.name() && q.metric == metric)
        };
        let (recall, pass, ppl) = (of("recall"), of("passkey"), of("ppl"));
        let dash = || "–".to_string();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            m.name(),
            recall.map_or_else(dash, share),
            recall.map_or_else(dash, |q| change(q, " pt", 0)),
            pass.map_or_else(dash, share),
            pass.map_or_else(dash, |q| change(q, " pt", 0)),
            ppl.map_or_else(dash, |q| format!("{:.3} ({})", q.value, q.n)),
            ppl.map_or_else(dash, |q| change(q, "%", 2)),
        );
    }
    (md, csv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(change: f64, lo: f64, hi: f64, n: usize, paired: usize) -> Quality {
        Quality {
            config: "x".into(),
            metric: "ppl",
            n,
            value: 1.0,
            interval: None,
            change: Some((change, Interval { lo, hi })),
            paired,
        }
    }

    #[test]
    fn a_significant_change_never_reads_as_zero_and_missing_pairs_are_named() {
        assert_eq!(
            change(&q(0.00002, 0.00001, 0.00003, 10, 10), "%", 2),
            "**+0.0020% [+0.0010, +0.0030]**"
        );
        assert_eq!(
            change(&q(0.00002, -0.00001, 0.00003, 10, 10), "%", 2),
            "+0.00% [-0.00, +0.00]"
        );
        assert_eq!(
            change(&q(-0.25, -0.5, 0.1, 22, 20), " pt", 0),
            "-25 pt [-50, +10] (paired 20)"
        );
    }

    fn stream(config: &str, article: usize, context: usize, nll: f64, dropped: f64) -> Record {
        Record {
            config: config.into(),
            workload: "stream".into(),
            item: format!("a{article}-ctx{context}"),
            values: BTreeMap::from([
                ("article".into(), article as f64),
                ("context".into(), context as f64),
                ("dropped_chunks".into(), dropped),
            ]),
            chunks: vec![[32.0, nll]; context / 32],
            ..Record::default()
        }
    }

    #[test]
    fn streams_pair_per_article_at_its_longest_context_and_skip_a_dropped_chunk() {
        let records = vec![
            stream("base", 0, 64, 32.0, 0.0),
            stream("base", 0, 128, 32.0, 0.0),
            stream("base", 1, 128, 64.0, 0.0),
            stream("x", 0, 64, 99.0, 0.0),
            stream("x", 0, 128, 32.0, 0.0),
            stream("x", 1, 128, 64.0, 0.0),
        ];
        // Per article the longest context: 4 + 4 chunks, none counted twice.
        let s = streams(&records, "x");
        assert_eq!(
            s.iter().map(|r| r.item.as_str()).collect::<Vec<_>>(),
            ["a0-ctx128", "a1-ctx128"]
        );
        assert_eq!(pair(s[0], streams(&records, "base")[0]).len(), 4);
        // A record that left out a non-finite chunk pairs nothing: the
        // chunks after it would meet the baseline's next ones (whether or
        // not the counts happen to agree).
        let dropped = stream("x", 1, 128, 64.0, 1.0);
        assert!(pair(&dropped, &records[2]).is_empty());
        assert!(pair(&records[5], &dropped).is_empty());
        let mut short = stream("x", 1, 128, 64.0, 0.0);
        short.chunks.pop();
        assert!(pair(&short, &records[2]).is_empty());
        assert_eq!(pair(&records[5], &records[2]).len(), 4);
    }
}
