//! The report's tables of each workload (the chat's KV per turn, every
//! stream, pass keys per length) and its CSV files (`results.csv`, one
//! row per item; `turns.csv`, one per chat turn).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::config::Experiment;
use crate::numbers::{MIB, mean, num};
use crate::output::Csv;
use crate::record::Record;
use crate::workloads::{ChatWorkload, PasskeyWorkload, StreamWorkload};

/// The sections of `report.md` that list each workload's items.
pub(crate) fn workload_sections(md: &mut String, exp: &Experiment, records: &[Record]) {
    let names: Vec<&str> = exp.matrix().iter().map(|m| m.name()).collect();
    let w = &exp.workloads;
    if let Some(w) = &w.chat {
        chat_section(md, w, &names, records);
    }
    if let Some(w) = &w.stream {
        stream_section(md, w, &names, records);
    }
    if let Some(w) = &w.passkey {
        passkey_section(md, w, &names, records);
    }
}

/// The records of configuration `c` on workload `w` that did not fail.
fn ok<'a>(records: &'a [Record], c: &str, w: &str) -> Vec<&'a Record> {
    records
        .iter()
        .filter(|r| r.config == c && r.workload == w && r.error.is_none())
        .collect()
}

/// The chat section: KV held after each turn of the first chat, and
/// fact recall.
fn chat_section(md: &mut String, w: &ChatWorkload, names: &[&str], records: &[Record]) {
    let _ = writeln!(
        md,
        "\n## Chat\n\n{} chitchat conversation(s) as sessions, {} user turns each plus the recall question, \
         greedy answers of at most {} tokens; a four-digit code is planted in the second user message. \
         KV MiB held at the end of each turn of the first chat (whole sequence, all tiers):\n",
        w.chats, w.turns, w.answer_tokens
    );
    let turns = w.turns + 1;
    let _ = write!(md, "| configuration |");
    for t in 1..=turns {
        let _ = write!(md, " {t} |");
    }
    let _ = write!(md, " recalled |\n|---|");
    for _ in 0..=turns {
        md.push_str("---:|");
    }
    md.push('\n');
    for c in names {
        let rs = ok(records, c, "chat");
        let Some(r) = rs.first() else { continue };
        let _ = write!(md, "| {c} |");
        for t in &r.turns {
            let _ = write!(
                md,
                " {} |",
                num(t.get("kv_bytes").copied().unwrap_or(f64::NAN) / MIB, 1)
            );
        }
        let recalled = rs.iter().filter(|r| r.get("recalled") > 0.5).count();
        let _ = writeln!(md, " {recalled}/{} |", rs.len());
    }
}

/// The streaming-perplexity section: every stream's item.
fn stream_section(md: &mut String, w: &StreamWorkload, names: &[&str], records: &[Record]) {
    let _ = writeln!(
        md,
        "\n## Streaming perplexity\n\n{} of the longest articles of `{}` (each article in one stream only, \
         concatenated up to the context: item `aN-ctxC`, or `ctxC` for one stream); prefix {} tokens, chunks of {}, \
         then {} greedy decode steps timed.\n\n| configuration | item | tokens | perplexity | KV MiB (hot + cold) | decode tok/s |\n|---|---|---:|---:|---:|---:|",
        match w.articles {
            1 => "One stream".to_string(),
            n => format!("{n} streams"),
        },
        w.data.display(),
        w.prefix,
        w.chunk,
        w.decode
    );
    for c in names {
        for r in ok(records, c, "stream") {
            let _ = writeln!(
                md,
                "| {c} | {} | {} | {} | {} ({} + {}) | {} |",
                r.item,
                r.get("context"),
                num(r.get("ppl"), 4),
                num(r.get("kv_bytes") / MIB, 1),
                num(r.get("hot_bytes") / MIB, 1),
                num(r.get("cold_bytes") / MIB, 1),
                num(r.get("decode_tok_s"), 2)
            );
        }
    }
}

/// The pass-key section: retrieved keys per prompt length.
fn passkey_section(md: &mut String, w: &PasskeyWorkload, names: &[&str], records: &[Record]) {
    let _ = writeln!(
        md,
        "\n## Pass key retrieval\n\nA five-digit key at each depth of a haystack of `{}` essays, prefilled in chunks of {} tokens, \
         then the question; exact match of the digits. Retrieved / items per prompt length:\n",
        w.data.display(),
        w.chunk
    );
    let _ = write!(md, "| configuration |");
    for l in &w.lengths {
        let _ = write!(md, " {l} |");
    }
    md.push_str(" mean KV MiB |\n|---|");
    for _ in 0..=w.lengths.len() {
        md.push_str("---:|");
    }
    md.push('\n');
    for c in names {
        let rs = ok(records, c, "passkey");
        if rs.is_empty() {
            continue;
        }
        let _ = write!(md, "| {c} |");
        for &l in &w.lengths {
            let at: Vec<&&Record> = rs.iter().filter(|r| r.get("length") == l as f64).collect();
            let hit = at.iter().filter(|r| r.get("correct") > 0.5).count();
            let _ = write!(md, " {hit}/{} |", at.len());
        }
        let _ = writeln!(
            md,
            " {} |",
            num(mean(rs.iter().map(|r| r.get("kv_bytes") / MIB)), 1)
        );
    }
}

/// A CSV: the `lead` columns, then the union of the rows' keys; each row
/// is its leading fields and its values, empty where absent.
fn csv_table(lead: &[&str], rows: &[(Vec<String>, &BTreeMap<String, f64>)]) -> Csv {
    let keys: std::collections::BTreeSet<&str> = rows
        .iter()
        .flat_map(|(_, v)| v.keys().map(String::as_str))
        .collect();
    let head: Vec<&str> = lead.iter().copied().chain(keys.iter().copied()).collect();
    let mut csv = Csv::new(&head);
    for (fields, values) in rows {
        let values = keys
            .iter()
            .map(|k| values.get(*k).map_or(String::new(), f64::to_string));
        csv.row(fields.iter().cloned().chain(values));
    }
    csv
}

pub(crate) fn results_csv(records: &[Record]) -> Csv {
    let rows: Vec<(Vec<String>, &BTreeMap<String, f64>)> = records
        .iter()
        .map(|r| {
            let lead = vec![
                r.config.clone(),
                r.workload.clone(),
                r.item.clone(),
                r.error.clone().unwrap_or_default(),
                format!("{:.3}", r.secs),
            ];
            (lead, &r.values)
        })
        .collect();
    csv_table(&["config", "workload", "item", "error", "secs"], &rows)
}

pub(crate) fn turns_csv(records: &[Record]) -> Csv {
    let rows: Vec<(Vec<String>, &BTreeMap<String, f64>)> = records
        .iter()
        .flat_map(|r| {
            r.turns.iter().enumerate().map(move |(i, t)| {
                let lead = vec![r.config.clone(), r.item.clone(), (i + 1).to_string()];
                (lead, t)
            })
        })
        .collect();
    csv_table(&["config", "item", "turn"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_has_the_union_of_the_keys_and_blanks_where_absent() {
        let a: BTreeMap<String, f64> = [("x".to_string(), 1.5)].into();
        let b: BTreeMap<String, f64> = [("y".to_string(), 2.0)].into();
        let rows = vec![(vec!["a,1".to_string()], &a), (vec!["b".to_string()], &b)];
        let csv = csv_table(&["name"], &rows);
        #[allow(clippy::unwrap_used)]
        let text = csv.text().unwrap();
        assert_eq!(text, "name,x,y\n\"a,1\",1.5,\nb,,2\n");
    }
}
