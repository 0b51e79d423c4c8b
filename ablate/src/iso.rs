//! Quality at equal memory: every configuration's KV share of the full
//! cache (measured item by item against the baseline's very same item),
//! beside its target and its quality with 95% intervals — the report's
//! first table, `iso.csv`, and the headline plot `headline.png` (quality
//! against KV share per workload, the Pareto front drawn, and kvpress's
//! presses on the same pass-key items when the run folder holds their
//! `kvpress.csv`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use crate::config::Experiment;
use crate::intervals::{Quality, change, share as accuracy};
use crate::output::{Csv, Output};
use crate::plot::{self, Panel, Point};
use crate::record::Record;
use crate::stats;

/// The bytes of a record its share is taken of: what the cache kept once
/// the item was compressed (after a chat's last turn, a stream's last
/// token, a pass key's answer: the axis kvpress reports on), and the
/// peak while it ran (what memory must be provisioned for: it includes
/// the chunk or turn being prefilled before its compression).
pub fn bytes(r: &Record) -> (f64, f64) {
    match r.workload.as_str() {
        "chat" => (
            r.turns
                .last()
                .and_then(|t| t.get("kv_bytes").copied())
                .unwrap_or(f64::NAN),
            r.get("peak_kv_bytes"),
        ),
        "passkey" => (r.get("end_kv_bytes"), r.get("kv_bytes")),
        _ => (r.get("kv_bytes"), r.get("kv_bytes")),
    }
}

/// A configuration's measured KV share on one workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Share {
    /// Items measured by both it and the baseline.
    pub items: usize,
    /// Mean over those items of the bytes it kept over the baseline's.
    pub kept: f64,
    /// The same of its peak bytes over the baseline's peak.
    pub peak: f64,
}

/// The KV share of `config` on `workload`, item by item against `base`.
pub fn share(records: &[Record], config: &str, base: &str, workload: &str) -> Option<Share> {
    let of = |c: &str| -> BTreeMap<&str, (f64, f64)> {
        records
            .iter()
            .filter(|r| r.config == c && r.workload == workload && r.error.is_none())
            .map(|r| (r.item.as_str(), bytes(r)))
            .collect()
    };
    let (ours, theirs) = (of(config), of(base));
    let pairs: Vec<((f64, f64), (f64, f64))> = ours
        .iter()
        .filter_map(|(item, &o)| theirs.get(item).map(|&t| (o, t)))
        .filter(|(o, t)| o.0.is_finite() && o.1.is_finite() && t.0 > 0.0 && t.1 > 0.0)
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let n = pairs.len() as f64;
    Some(Share {
        items: pairs.len(),
        kept: pairs.iter().map(|(o, t)| o.0 / t.0).sum::<f64>() / n,
        peak: pairs.iter().map(|(o, t)| o.1 / t.1).sum::<f64>() / n,
    })
}

/// Workloads, the quality measure each is read by, and its label.
const WORKLOADS: [(&str, &str, &str); 3] = [
    ("stream", "ppl", "perplexity change %"),
    ("passkey", "passkey", "pass-key accuracy"),
    ("chat", "recall", "fact recall"),
];

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.0}%", x * 100.0)
    } else {
        "–".into()
    }
}

/// The configurations in table order: the untargeted ones first (matrix
/// order), then by target, largest first.
fn ordered(exp: &Experiment) -> Vec<(&str, Option<f64>)> {
    let mut v: Vec<(&str, Option<f64>)> = exp
        .matrix()
        .iter()
        .map(|m| (m.name(), m.target_kv))
        .collect();
    v.sort_by(|a, b| {
        let key = |t: Option<f64>| t.map_or(f64::INFINITY, |x| x);
        key(b.1).total_cmp(&key(a.1))
    });
    v
}

/// The section of `report.md`, `iso.csv`, and the headline plot's panels.
pub fn section(
    exp: &Experiment,
    records: &[Record],
    qualities: &[Quality],
    kvpress: &[Point],
) -> (String, Csv, Vec<Panel>) {
    let base = exp.baseline();
    let mut csv = Csv::new(&[
        "config",
        "target_kv",
        "workload",
        "items",
        "kv_share",
        "peak_kv_share",
    ]);
    let mut md = format!(
        "\n## Quality at equal memory\n\n![quality against KV share](headline.png)\n\n\
         A configuration's KV share is the KV bytes it kept over what `{base}` kept on the very same \
         item, averaged over the items: after a chat's last turn, a stream's last token, a pass key's \
         answer (the axis kvpress reports on; the plot's x). In brackets the same of the peak while the \
         item ran, which includes the chunk or turn being prefilled before it was compressed. A \
         `target_kv` configuration is sized item by item to keep that share (its eviction budget, or \
         the hot window when it only quantizes: `ablate/src/target.rs`); the shares beside it \
         are what it held. Quality as in the section with intervals below; **bold**: the interval \
         excludes zero.\n\n\
         | configuration | target | stream KV kept (peak) | perplexity change | passkey KV kept (peak) | pass key (n) | pass-key change | chat KV kept (peak) | fact recall (n) |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let mut panels: Vec<Panel> = WORKLOADS
        .iter()
        .map(|(w, _, label)| Panel {
            title: w.to_string(),
            y_label: (*label).into(),
            higher_better: *w != "stream",
            points: Vec::new(),
        })
        .collect();
    for (name, target) in ordered(exp) {
        let q = |metric: &str| {
            qualities
                .iter()
                .find(|q| q.config == name && q.metric == metric)
        };
        let mut cells = Vec::new();
        for (i, (w, metric, _)) in WORKLOADS.iter().enumerate() {
            let s = exp
                .runs(name, w)
                .then(|| share(records, name, base, w))
                .flatten();
            if let Some(s) = s {
                csv.row([
                    name.to_string(),
                    target.map_or(String::new(), |t| t.to_string()),
                    w.to_string(),
                    s.items.to_string(),
                    s.kept.to_string(),
                    s.peak.to_string(),
                ]);
            }
            let kept = s.map_or(f64::NAN, |s| s.kept);
            cells.push(match s {
                Some(s) => format!("{} ({})", pct(s.kept), pct(s.peak)),
                None => "–".into(),
            });
            let Some(q) = q(metric) else {
                cells.push("–".into());
                if *w == "passkey" {
                    cells.push("–".into());
                }
                continue;
            };
            panels[i].points.push(point(name, name == base, w, kept, q));
            match *w {
                "stream" => cells.push(change(q, "%", 2)),
                "passkey" => {
                    cells.push(accuracy(q));
                    cells.push(change(q, " pt", 0));
                }
                _ => cells.push(accuracy(q)),
            }
        }
        // Column order: stream share, ppl, passkey share, accuracy,
        // change, chat share, recall.
        let _ = writeln!(
            md,
            "| {name} | {} | {} |",
            target.map_or("–".into(), |t| format!("{}%", t * 100.0)),
            cells.join(" | ")
        );
    }
    panels[1].points.extend(kvpress.iter().cloned());
    if !kvpress.is_empty() {
        md.push_str(
            "\nGrey squares in the pass-key panel: NVIDIA kvpress's presses on the very same items \
             (`scripts/kvpress_passkey.py` over this run's `passkey_items.jsonl`, its `kvpress.csv`), \
             at the share of the context's tokens they keep (f16, as the full cache).\n",
        );
    }
    (md, csv, panels)
}

/// Row `name`'s point in workload `w`'s panel: its KV share kept against
/// its quality (a stream's perplexity change in percent, the baseline at
/// zero; accuracy otherwise), with the interval.
fn point(name: &str, is_base: bool, w: &str, kept: f64, q: &Quality) -> Point {
    if w == "stream" {
        // The baseline is the zero; a row without a change (no paired
        // chunks) is no point at all.
        let none = if is_base { 0.0 } else { f64::NAN };
        let (c, i) = q.change.map_or((none, None), |(c, i)| (c, Some(i)));
        Point {
            label: name.into(),
            x: kept,
            y: c * 100.0,
            lo: i.map_or(f64::NAN, |i| i.lo * 100.0),
            hi: i.map_or(f64::NAN, |i| i.hi * 100.0),
            reference: false,
        }
    } else {
        Point {
            label: name.into(),
            x: kept,
            y: q.value,
            lo: q.interval.map_or(f64::NAN, |i| i.lo),
            hi: q.interval.map_or(f64::NAN, |i| i.hi),
            reference: false,
        }
    }
}

/// kvpress's presses from `dir/kvpress.csv`, on the items `items` (this
/// run's pass-key items): accuracy and its Wilson interval against the
/// mean share of the context's tokens kept. None when there is no file.
pub fn kvpress_points(dir: &Path, items: &[&str]) -> Vec<Point> {
    let Ok(text) = kvforge_engine::input::read_text(
        &dir.join("kvpress.csv"),
        kvforge_engine::input::MAX_CONFIG_BYTES * 16,
    ) else {
        return Vec::new();
    };
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split(',').collect();
    let col = |n: &str| header.iter().position(|h| *h == n);
    let (Some(press), Some(kept), Some(item), Some(correct), Some(kv), Some(ctx)) = (
        col("press"),
        col("kv_kept"),
        col("item"),
        col("correct"),
        col("kv_tokens"),
        col("context_tokens"),
    ) else {
        return Vec::new();
    };
    // (press, kv_kept) -> (correct, items, share sum)
    let mut groups: BTreeMap<(String, String), (usize, usize, f64)> = BTreeMap::new();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        let get = |i: usize| f.get(i).copied().unwrap_or("");
        if !items.contains(&get(item)) {
            continue;
        }
        let (Ok(k), Ok(c)) = (get(kv).parse::<f64>(), get(ctx).parse::<f64>()) else {
            continue;
        };
        let g = groups
            .entry((get(press).to_string(), get(kept).to_string()))
            .or_default();
        g.0 += usize::from(get(correct) == "1");
        g.1 += 1;
        g.2 += k / c.max(1.0);
    }
    groups
        .into_iter()
        .filter(|(_, g)| g.1 > 0)
        .map(|((press, kept), (k, n, s))| {
            let i = stats::wilson(k, n);
            Point {
                label: format!("kvpress {press} {kept}"),
                x: s / n as f64,
                y: k as f64 / n as f64,
                lo: i.map_or(f64::NAN, |i| i.lo),
                hi: i.map_or(f64::NAN, |i| i.hi),
                reference: true,
            }
        })
        .collect()
}

/// Writes the section's CSV and plot into `out`; returns its Markdown.
pub fn write(
    out: &mut Output,
    exp: &Experiment,
    records: &[Record],
    qualities: &[Quality],
) -> Result<String> {
    let items: Vec<&str> = records
        .iter()
        .filter(|r| r.config == exp.baseline() && r.workload == "passkey")
        .map(|r| r.item.as_str())
        .collect();
    let kvpress = kvpress_points(out.dir(), &items);
    let (md, csv, panels) = section(exp, records, qualities, &kvpress);
    out.csv("iso.csv", &csv)?;
    let panels: Vec<Panel> = panels
        .into_iter()
        .filter(|p| p.points.iter().any(|q| q.x.is_finite()))
        .collect();
    if !panels.is_empty() {
        out.png("headline.png", |path| {
            plot::panels(path, "KV share of the full cache", &panels)
        })?;
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(config: &str, item: &str, kv: f64) -> Record {
        Record {
            config: config.into(),
            workload: "passkey".into(),
            item: item.into(),
            values: BTreeMap::from([("kv_bytes".into(), kv), ("end_kv_bytes".into(), kv)]),
            ..Record::default()
        }
    }

    #[test]
    fn a_share_is_item_by_item_against_the_baseline() {
        let rs = [
            rec("baseline", "a", 100.0),
            rec("baseline", "b", 200.0),
            rec("x", "a", 50.0),
            rec("x", "b", 20.0),
            rec("x", "c", 1.0),
        ];
        let s = share(&rs, "x", "baseline", "passkey").unwrap();
        assert_eq!(s.items, 2);
        assert!((s.kept - 0.3).abs() < 1e-12, "{s:?}");
        assert!((s.peak - 0.3).abs() < 1e-12, "{s:?}");
        assert!(share(&rs, "y", "baseline", "passkey").is_none());
    }

    #[test]
    fn kvpress_points_keep_the_runs_items_only() {
        let dir = std::env::temp_dir().join(format!("kvforge-iso-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("kvpress.csv"),
            "press,kv_kept,item,depth,correct,kv_tokens,context_tokens,answer\n\
             SnapKV,0.25,i1,0.1,1,250,1000,1\n\
             SnapKV,0.25,i2,0.1,0,500,1000,2\n\
             SnapKV,0.25,other,0.1,0,1,1000,3\n",
        )
        .unwrap();
        let p = kvpress_points(&dir, &["i1", "i2"]);
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].y, p[0].x), (0.5, 0.375));
        assert!(p[0].reference && p[0].lo < 0.5 && p[0].hi > 0.5);
        assert!(kvpress_points(&dir.join("none"), &["i1"]).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
