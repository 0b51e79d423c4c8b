//! The logs of measured errors, and the table of every comparison across
//! settings with the rows that fail the check.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};

use super::settings::Setting;

/// One recorded comparison: the worst error of a (test, case) under a
/// setting, its bound, and whether it is lossy.
#[derive(Clone, Debug)]
pub(super) struct Record {
    pub(super) err: f64,
    pub(super) bound: f64,
    pub(super) loss: bool,
}

/// Recorded comparisons: (test, case) → the worst.
pub(super) type Records = BTreeMap<(String, String), Record>;

/// The records of one log: (test, case) → worst.
pub(super) fn read_log(path: &Path) -> Result<Records> {
    let mut out = Records::new();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    for (i, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split('\t').collect();
        let [test, what, err, bound, kind] = f[..] else {
            bail!(
                "{}:{}: not test, case, error, bound, kind",
                path.display(),
                i + 1
            );
        };
        let num = |s: &str| -> Result<f64> {
            s.parse()
                .with_context(|| format!("{}:{}: {s:?}", path.display(), i + 1))
        };
        let r = Record {
            err: num(err)?,
            bound: num(bound)?,
            loss: kind == "loss",
        };
        let e = out
            .entry((test.to_string(), what.to_string()))
            .or_insert(r.clone());
        if r.err > e.err {
            *e = r;
        }
    }
    Ok(out)
}

/// Across settings: the worst and the least error of one (test, case).
struct Across {
    worst: f64,
    least: f64,
    bound: f64,
    loss: bool,
    under: Setting,
    settings: usize,
}

/// The markdown table of every (test, case): its bound, its worst error and
/// the setting it was met under, the margin (for a lossy one: the room
/// left under the bound against how far the kernels moved the error); and
/// the rows that fail the check.
pub(super) fn table(all: &[(Setting, Records)]) -> (String, Vec<String>) {
    let mut rows: BTreeMap<&(String, String), Across> = BTreeMap::new();
    for (s, recs) in all {
        for (k, r) in recs {
            let e = rows.entry(k).or_insert(Across {
                worst: r.err,
                least: r.err,
                bound: r.bound,
                loss: r.loss,
                under: *s,
                settings: 0,
            });
            e.settings += 1;
            e.least = e.least.min(r.err);
            if r.err > e.worst {
                (e.worst, e.bound, e.under) = (r.err, r.bound, *s);
            }
        }
    }
    let mut out = String::from(
        "| test | case | kind | bound | worst error | under | settings | margin |\n|---|---|---|---:|---:|---|---:|---:|\n",
    );
    let mut over = Vec::new();
    for ((test, what), a) in &rows {
        let (margin, text) = if a.loss {
            // How many times the kernels' spread fits in the room left.
            let spread = a.worst - a.least;
            let m = (a.bound - a.worst) / spread.max(f64::MIN_POSITIVE);
            (
                m,
                format!("room {:.2e} / spread {spread:.1e}", a.bound - a.worst),
            )
        } else {
            let m = a.bound / a.worst.max(f64::MIN_POSITIVE);
            (m, String::new())
        };
        if margin < 4.0 {
            over.push(format!(
                "{test} [{what}]: {:.3e} of {:.1e} {text}",
                a.worst, a.bound
            ));
        }
        let shown = if a.worst == 0.0 && !a.loss {
            "exact".into()
        } else if margin > 1e6 {
            format!("> 10^6× {text}")
        } else {
            format!("{margin:.0}× {text}")
        };
        out.push_str(&format!(
            "| `{test}` | {what} | {} | {:.1e} | {:.2e} | {} | {} | {} |\n",
            if a.loss { "loss" } else { "order" },
            a.bound,
            a.worst,
            a.under.name(),
            a.settings,
            shown.trim_end()
        ));
    }
    (out, over)
}
