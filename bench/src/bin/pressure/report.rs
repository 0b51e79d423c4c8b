//! The pressure experiment's outputs: every turn of both passes in
//! `turns.csv`, and `report.md` comparing the passes.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use kvforge_bench::output::{Csv, Output};

use crate::{Args, Pass, Row};

/// Session `s`'s answers in `p`, turn by turn.
fn answers(p: &Pass, s: usize) -> Vec<&[u32]> {
    p.rows
        .iter()
        .filter(|r| r.session == s)
        .map(|r| r.answer.as_slice())
        .collect()
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

/// Writes `turns.csv` and `report.md`; the report's path.
pub(crate) fn write_outputs(
    a: &Args,
    free: &Pass,
    tight: &Pass,
    out: &mut Output,
) -> Result<PathBuf> {
    out.csv("turns.csv", &turns_csv(free, tight))?;

    let n = a.sessions;
    let same: Vec<bool> = (0..n)
        .map(|s| answers(free, s) == answers(tight, s))
        .collect();
    let untouched: Vec<usize> = (0..n).filter(|&s| !tight.evicted[s]).collect();
    let untouched_same = untouched.iter().filter(|&&s| same[s]).count();
    let touched_same = (0..n).filter(|&s| tight.evicted[s] && same[s]).count();
    let failed: Vec<&Row> = tight.rows.iter().filter(|r| !r.error.is_empty()).collect();
    // Turns after which the session still had every entry: nothing it read
    // changed, so its answer must be pass 1's.
    let intact: Vec<(&Row, &Row)> = tight
        .rows
        .iter()
        .zip(&free.rows)
        .filter(|(t, _)| !t.lost && t.error.is_empty())
        .collect();
    let intact_same = intact.iter().filter(|(t, f)| t.answer == f.answer).count();
    let mut md = String::new();
    let _ = writeln!(md, "# Multi-session pressure\n");
    let _ = writeln!(
        md,
        "{n} chitchat sessions × {} turns in round robin (answers of at most {} tokens, greedy), \
         SmolLM2-135M, f16 hot KV, blocks of 16, {} cold tier, `{}` eviction under a watermark \
         {}–{} of the budget (sink {}, window {}).\n",
        a.turns,
        a.answer_tokens,
        a.cold_bits()
            .map_or("no".to_string(), |b| format!("INT{b}")),
        a.policy,
        a.low,
        a.high,
        a.sink,
        a.window
    );
    passes_table(&mut md, a, free, tight);
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Turns after which their session still held every entry answer exactly as in pass 1: \
         **{intact_same}/{}**. Sessions that never lost an entry in pass 2 answer exactly as in \
         pass 1: {untouched_same}/{}; sessions that did: {touched_same}/{} still answer the same \
         in every turn.\n",
        intact.len(),
        untouched.len(),
        n - untouched.len()
    );
    if !failed.is_empty() {
        let _ = writeln!(
            md,
            "Turns refused in pass 2 (rolled back; the session went on):\n"
        );
        for r in failed.iter().take(10) {
            let _ = writeln!(md, "- session {} turn {}: {}", r.session, r.turn, r.error);
        }
        if failed.len() > 10 {
            let _ = writeln!(md, "- … {} more", failed.len() - 10);
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "Per turn: `turns.csv`.");
    out.report(&md)
}

/// Every turn of both passes: bytes per tier, evictions, demotions.
fn turns_csv(free: &Pass, tight: &Pass) -> Csv {
    let mut csv = Csv::new(&[
        "pass",
        "session",
        "turn",
        "error",
        "answer_tokens",
        "kv_bytes",
        "hot_bytes",
        "cold_bytes",
        "evicted_entries",
        "evicted_idle_entries",
        "demoted_blocks",
        "lost",
    ]);
    for r in free.rows.iter().chain(&tight.rows) {
        csv.row([
            r.pass.to_string(),
            r.session.to_string(),
            r.turn.to_string(),
            r.error.clone(),
            r.answer.len().to_string(),
            r.kv_bytes.to_string(),
            r.hot_bytes.to_string(),
            r.cold_bytes.to_string(),
            r.evicted.to_string(),
            r.evicted_idle.to_string(),
            r.demoted.to_string(),
            u8::from(r.lost).to_string(),
        ]);
    }
    csv
}

/// The table of the two passes side by side: budget, peak, turns
/// completed, bytes per tier at the end, evictions and demotions.
fn passes_table(md: &mut String, a: &Args, free: &Pass, tight: &Pass) {
    let _ = writeln!(
        md,
        "| | pass 1 (no pressure) | pass 2 (budget {:.0}% of pass 1's peak) |",
        a.share * 100.0
    );
    let _ = writeln!(md, "|---|---:|---:|");
    let _ = writeln!(
        md,
        "| budget MiB | {} (capacity) | {} |",
        mib(free.budget),
        mib(tight.budget)
    );
    let _ = writeln!(
        md,
        "| peak KV MiB | {} | {} |",
        mib(free.peak),
        mib(tight.peak)
    );
    let done = |p: &Pass| p.rows.iter().filter(|r| r.error.is_empty()).count();
    let _ = writeln!(
        md,
        "| turns completed | {}/{} | {}/{} |",
        done(free),
        free.rows.len(),
        done(tight),
        tight.rows.len()
    );
    let end = |p: &Pass| {
        p.rows.last().map_or((0, 0, 0, 0), |r| {
            (r.hot_bytes, r.cold_bytes, r.evicted, r.demoted)
        })
    };
    let (fh, fc, fe, fd) = end(free);
    let (th, tc, te, td) = tight.rows.last().map_or((0, 0, 0, 0), |r| {
        (r.hot_bytes, r.cold_bytes, r.evicted, r.demoted)
    });
    let _ = writeln!(
        md,
        "| hot / cold MiB at the end | {} / {} | {} / {} |",
        mib(fh),
        mib(fc),
        mib(th),
        mib(tc)
    );
    let _ = writeln!(md, "| entries evicted | {fe} | {te} |");
    let idle = |p: &Pass| p.rows.last().map_or(0, |r| r.evicted_idle);
    let _ = writeln!(
        md,
        "| of which from idle sessions, for another's step | {} | {} |",
        idle(free),
        idle(tight)
    );
    let _ = writeln!(md, "| blocks demoted to the cold tier | {fd} | {td} |");
    let _ = writeln!(
        md,
        "| sessions that lost an entry | {} | {} |",
        free.evicted.iter().filter(|&&e| e).count(),
        tight.evicted.iter().filter(|&&e| e).count()
    );
}
