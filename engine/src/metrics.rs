//! Prometheus' text exposition format: [`Exposition`], the one writer of
//! the CLI's `--metrics-file` and the server's `/metrics`, and
//! [`prometheus`], any metrics snapshot as gauges.
//!
//! [`CacheManager::metrics`](crate::manager::CacheManager::metrics) is JSON; `prometheus`
//! turns any such snapshot into gauges: nested keys join with `_` under a
//! `kvforge_` prefix, booleans are 0/1, strings and nulls are left out,
//! and the entries of an array become one series each, labelled by their
//! `tier` (or `name`) field, else by their position.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

/// The rows of one series: labels (`{k="v",…}`, or empty) and value.
pub type Rows = Vec<(String, f64)>;

/// What a series is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// A value that goes up and down.
    Gauge,
    /// A value that only grows (its name ends in `_total`).
    Counter,
}

impl MetricKind {
    /// A counter when `name` ends in `_total` (Prometheus' convention),
    /// else a gauge.
    pub fn of(name: &str) -> Self {
        if name.ends_with("_total") {
            MetricKind::Counter
        } else {
            MetricKind::Gauge
        }
    }

    fn word(self) -> &'static str {
        match self {
            MetricKind::Gauge => "gauge",
            MetricKind::Counter => "counter",
        }
    }
}

/// Text in Prometheus' exposition format, written series by series.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
    /// Labels every row carries (`key="value",…`, escaped), first.
    common: String,
}

impl Exposition {
    /// Nothing written yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Nothing written yet; every row will carry `labels` (vLLM's
    /// `model_name`, say) before its own.
    pub fn with_labels(labels: &[(&str, &str)]) -> Self {
        let common = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
            .collect::<Vec<_>>()
            .join(",");
        Exposition {
            text: String::new(),
            common,
        }
    }

    /// A row's label set (`{…}` or empty) with the common labels first.
    fn labels(&self, own: &str) -> String {
        let inner = own.strip_prefix('{').and_then(|l| l.strip_suffix('}'));
        match (self.common.is_empty(), inner) {
            (true, _) => own.to_string(),
            (false, None | Some("")) => format!("{{{}}}", self.common),
            (false, Some(l)) => format!("{{{},{l}}}", self.common),
        }
    }

    /// One series: `# HELP` (unless `help` is empty), `# TYPE`, then a
    /// line per row.
    pub fn series(&mut self, name: &str, help: &str, kind: MetricKind, rows: &[(String, f64)]) {
        self.head(name, help, kind.word());
        for (labels, v) in rows {
            let labels = self.labels(labels);
            let _ = writeln!(self.text, "{name}{labels} {v}");
        }
    }

    /// A histogram: `buckets` are each upper bound with the observations
    /// in that bucket alone (written cumulatively), `count` every
    /// observation (those above the last bound too), `sum` their total.
    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        buckets: impl IntoIterator<Item = (f64, u64)>,
        count: u64,
        sum: f64,
    ) {
        self.head(name, help, "histogram");
        let mut acc = 0;
        for (bound, n) in buckets {
            acc += n;
            let le = self.labels(&format!("{{le=\"{bound}\"}}"));
            let _ = writeln!(self.text, "{name}_bucket{le} {acc}");
        }
        let le = self.labels("{le=\"+Inf\"}");
        let _ = writeln!(self.text, "{name}_bucket{le} {count}");
        let plain = self.labels("");
        let _ = writeln!(self.text, "{name}_sum{plain} {sum}");
        let _ = writeln!(self.text, "{name}_count{plain} {count}");
    }

    fn head(&mut self, name: &str, help: &str, kind: &str) {
        if !help.is_empty() {
            let _ = writeln!(self.text, "# HELP {name} {help}");
        }
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    /// The text written.
    pub fn into_text(self) -> String {
        self.text
    }
}

/// `{key="value"}`, the value escaped.
pub fn label(key: &str, value: &str) -> String {
    format!("{{{key}=\"{}\"}}", escape(value))
}

/// `snapshot` as Prometheus text (`# TYPE … gauge` then one line per
/// series), metric names sorted.
pub fn prometheus(snapshot: &Value) -> String {
    let mut series: BTreeMap<String, Rows> = BTreeMap::new();
    flatten("kvforge", "", snapshot, &mut series);
    let mut out = Exposition::new();
    for (name, rows) in series {
        out.series(&name, "", MetricKind::Gauge, &rows);
    }
    out.into_text()
}

fn flatten(name: &str, labels: &str, v: &Value, out: &mut BTreeMap<String, Rows>) {
    let num = match v {
        Value::Number(n) => n.as_f64(),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        _ => None,
    };
    if let Some(x) = num {
        out.entry(name.to_string())
            .or_default()
            .push((labels.to_string(), x));
        return;
    }
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                flatten(&format!("{name}_{}", sanitize(k)), labels, child, out);
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let (key, value) = match ["tier", "name"]
                    .iter()
                    .find_map(|k| Some((*k, item.get(*k)?.as_str()?.to_string())))
                {
                    Some(kv) => kv,
                    None => ("index", i.to_string()),
                };
                let label = label(key, &value);
                let labels = match labels.strip_suffix('}') {
                    Some(open) => format!("{open},{}", &label[1..]),
                    None => label,
                };
                flatten(name, &labels, item, out);
            }
        }
        _ => {}
    }
}

fn sanitize(key: &str) -> String {
    key.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_keys_arrays_and_booleans_become_labelled_gauges() {
        let j = serde_json::json!({
            "requests": 3,
            "index": { "hit_rate": 0.5, "enabled": true, "kind": "HashChain" },
            "tiers": [ { "tier": "hot", "bytes": 10 }, { "tier": "cold", "bytes": 4 } ],
            "last_turn": null,
        });
        let text = prometheus(&j);
        let want = "# TYPE kvforge_index_enabled gauge\nkvforge_index_enabled 1\n\
                    # TYPE kvforge_index_hit_rate gauge\nkvforge_index_hit_rate 0.5\n\
                    # TYPE kvforge_requests gauge\nkvforge_requests 3\n\
                    # TYPE kvforge_tiers_bytes gauge\nkvforge_tiers_bytes{tier=\"hot\"} 10\n\
                    kvforge_tiers_bytes{tier=\"cold\"} 4\n";
        assert_eq!(text, want);
    }

    #[test]
    fn a_histogram_is_written_cumulatively_with_its_help_and_a_counter_by_name() {
        let mut e = Exposition::new();
        e.histogram(
            "x_seconds",
            "Seconds.",
            [(0.1, 2), (1.0, 0), (10.0, 3)],
            6,
            12.5,
        );
        let name = "y_total";
        e.series(
            name,
            "Ys.",
            MetricKind::of(name),
            &[(label("k", "a\"b"), 3.0)],
        );
        let want = "# HELP x_seconds Seconds.\n# TYPE x_seconds histogram\n\
                    x_seconds_bucket{le=\"0.1\"} 2\nx_seconds_bucket{le=\"1\"} 2\n\
                    x_seconds_bucket{le=\"10\"} 5\nx_seconds_bucket{le=\"+Inf\"} 6\n\
                    x_seconds_sum 12.5\nx_seconds_count 6\n\
                    # HELP y_total Ys.\n# TYPE y_total counter\ny_total{k=\"a\\\"b\"} 3\n";
        assert_eq!(e.into_text(), want);
        assert_eq!(MetricKind::of("kv_bytes"), MetricKind::Gauge);
    }
}
