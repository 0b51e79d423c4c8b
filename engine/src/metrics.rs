//! The metrics snapshot in Prometheus' text exposition format.
//!
//! [`CacheManager::metrics`](crate::manager::CacheManager::metrics) is JSON; this
//! turns any such snapshot into gauges: nested keys join with `_` under a
//! `kvforge_` prefix, booleans are 0/1, strings and nulls are left out,
//! and the entries of an array become one series each, labelled by their
//! `tier` (or `name`) field, else by their position.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

/// `snapshot` as Prometheus text (`# TYPE … gauge` then one line per
/// series), metric names sorted.
pub fn prometheus(snapshot: &Value) -> String {
    let mut series: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    flatten("kvforge", "", snapshot, &mut series);
    let mut out = String::new();
    for (name, rows) in series {
        let _ = writeln!(out, "# TYPE {name} gauge");
        for (labels, v) in rows {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    }
    out
}

fn flatten(name: &str, labels: &str, v: &Value, out: &mut BTreeMap<String, Vec<(String, f64)>>) {
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
                let label = format!("{key}=\"{}\"", escape(&value));
                let labels = match labels.strip_suffix('}') {
                    Some(open) => format!("{open},{label}}}"),
                    None => format!("{{{label}}}"),
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
}
