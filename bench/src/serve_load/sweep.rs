//! The concurrency sweep: kvforge and llama-server interleaved, repeated.

use std::fmt::Write as _;

use anyhow::Result;

use super::replay::Load;
use super::run::{Summary, measure, median};
use super::servers::LlamaSpec;
use super::{Common, progress};
use kvforge_ablate::output::{Csv, Output};
use kvforge_ablate::plot;

/// `sweep`'s own flags.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// Concurrency levels.
    pub levels: Vec<usize>,
    /// Runs per server and level (interleaved).
    pub reps: usize,
    /// Conversations per level at least (more when the level is higher).
    pub min_convs: usize,
    /// Hot KV tokens of kvforge, and llama-server's context per slot × slots.
    pub ctx_per_slot: usize,
}

/// A plot: file, axis label, what of a run it shows.
type Metric<'a> = (&'a str, &'a str, &'a dyn Fn(&Summary) -> f64);

const HEAD: &[&str] = &[
    "server",
    "concurrency",
    "rep",
    "requests",
    "errors",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tok_s",
    "prefix_hit",
    "hot_peak_bytes",
    "cold_peak_bytes",
    "wall_s",
];

fn row(csv: &mut Csv, server: &str, c: usize, rep: usize, s: &Summary) {
    csv.row([
        server.to_string(),
        c.to_string(),
        rep.to_string(),
        s.requests.to_string(),
        s.errors.len().to_string(),
        format!("{:.1}", s.ttft_ms(0.5)),
        format!("{:.1}", s.ttft_ms(0.99)),
        format!("{:.2}", s.itl_ms(0.5)),
        format!("{:.2}", s.itl_ms(0.99)),
        format!("{:.2}", s.tok_s()),
        format!("{:.4}", s.hit_share()),
        format!("{:.0}", s.peak("hot")),
        format!("{:.0}", s.cold_peak()),
        format!("{:.2}", s.wall),
    ]);
}

/// Each server's runs at each concurrency level.
type Runs = Vec<(&'static str, usize, Vec<Summary>)>;

/// The median of `f` over the runs of `name` at `level`.
fn med(runs: &Runs, name: &str, level: usize, f: &dyn Fn(&Summary) -> f64) -> f64 {
    runs.iter()
        .find(|r| r.0 == name && r.1 == level)
        .map_or(f64::NAN, |r| median(&r.2.iter().map(f).collect::<Vec<_>>()))
}

/// Runs the sweep and writes `sweep.csv`, the plots and `report.md`.
pub fn sweep(c: &Common, sw: &Sweep, llama: Option<&LlamaSpec>, out: &mut Output) -> Result<()> {
    let most = sw.levels.iter().copied().max().unwrap_or(1);
    let convs = c.chats(most.max(sw.min_convs))?;
    let mut csv = Csv::new(HEAD);
    let runs = levels(c, sw, llama, &convs, &mut csv)?;
    out.csv("sweep.csv", &csv)?;
    let names: Vec<&str> = if llama.is_some() {
        vec!["kvforge", "llama-server"]
    } else {
        vec!["kvforge"]
    };
    plots(sw, &names, &runs, most, out)?;
    let md = table(c, sw, &names, &runs, llama.is_some());
    out.report(&md)?;
    Ok(())
}

/// Every level, every rep, the servers' order alternating rep by rep, a
/// fresh server per run; each run a row of `csv`.
fn levels(
    c: &Common,
    sw: &Sweep,
    llama: Option<&LlamaSpec>,
    convs: &[Vec<String>],
    csv: &mut Csv,
) -> Result<Runs> {
    let load = Load {
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        disconnect_after: None,
    };
    // (server, level) -> the reps' summaries
    let mut runs: Runs = Vec::new();
    for &level in &sw.levels {
        let convs = &convs[..level.max(sw.min_convs)];
        for rep in 0..sw.reps {
            let mut order: Vec<&'static str> = vec!["kvforge"];
            if llama.is_some() {
                order.push("llama-server");
            }
            if rep % 2 == 1 {
                order.reverse();
            }
            for name in order {
                let log = c.log(&format!("{name}-c{level}-r{rep}.log"));
                let server = match (name, llama) {
                    ("llama-server", Some(l)) => l.start(level, sw.ctx_per_slot * level, &log)?,
                    _ => c
                        .kvforge(&[
                            "--max-batch".into(),
                            level.max(1).to_string(),
                            "--kv-tokens".into(),
                            (sw.ctx_per_slot * level).to_string(),
                        ])
                        .start(&log)?,
                };
                super::warm_up(&server);
                let s = measure(&server, convs, level, &load, &|_| false);
                server.stop();
                progress(&format!(
                    "{name} c={level} rep {rep}: {:.1} tok/s, TTFT p50 {:.0} ms, {} errors",
                    s.tok_s(),
                    s.ttft_ms(0.5),
                    s.errors.len()
                ));
                row(csv, name, level, rep, &s);
                match runs.iter_mut().find(|r| r.0 == name && r.1 == level) {
                    Some(r) => r.2.push(s),
                    None => runs.push((name, level, vec![s])),
                }
            }
        }
    }
    Ok(runs)
}

/// A PNG per metric: each server's median against concurrency.
fn plots(sw: &Sweep, names: &[&str], runs: &Runs, most: usize, out: &mut Output) -> Result<()> {
    let metrics: [Metric; 4] = [
        ("tokens_per_s.png", "aggregate tokens/s", &|s: &Summary| {
            s.tok_s()
        }),
        ("ttft_p50.png", "TTFT p50 (ms)", &|s: &Summary| {
            s.ttft_ms(0.5)
        }),
        ("ttft_p99.png", "TTFT p99 (ms)", &|s: &Summary| {
            s.ttft_ms(0.99)
        }),
        (
            "itl_p50.png",
            "inter-token latency p50 (ms)",
            &|s: &Summary| s.itl_ms(0.5),
        ),
    ];
    for (file, label, f) in metrics {
        let series: Vec<(&str, Vec<(f64, f64)>)> = names
            .iter()
            .map(|&n| {
                (
                    n,
                    sw.levels
                        .iter()
                        .map(|&l| (l as f64, med(runs, n, l, f)))
                        .collect(),
                )
            })
            .collect();
        let top = series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| p.1))
            .filter(|v| v.is_finite())
            .fold(1.0, f64::max);
        out.png(file, |p| {
            plot::line_plot(
                p,
                &format!("{label} against concurrency"),
                "concurrent chats",
                label,
                (0.0, most as f64 + 1.0),
                (0.0, top * 1.1),
                &series,
            )
        })?;
    }
    Ok(())
}

/// `report.md`'s table: medians per level and server, and kvforge over
/// llama-server when both ran.
fn table(c: &Common, sw: &Sweep, names: &[&str], runs: &Runs, both: bool) -> String {
    let med = |name: &str, level: usize, f: &dyn Fn(&Summary) -> f64| med(runs, name, level, f);
    let mut md = format!(
        "# kvforge serve under load\n\nEach client replays a chitchat conversation turn by turn, resending the whole \
         history every turn and streaming a reply of at most {} tokens (greedy; ignore_eos {}); {} runs per server and level, the \
         servers interleaved, a fresh server per run; medians below (every run in `sweep.csv`).\n\n\
         | concurrency | server | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | prefix hit | peak KV MiB (hot + cold) | errors |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        c.max_tokens, c.ignore_eos, sw.reps
    );
    for &l in &sw.levels {
        for &n in names {
            let errs = med(n, l, &|s: &Summary| s.errors.len() as f64);
            let kv = med(n, l, &|s: &Summary| {
                s.peak_bytes.iter().map(|p| p.1).sum::<f64>()
            });
            let kv = if kv > 0.0 {
                format!("{:.1}", kv / f64::from(1u32 << 20))
            } else {
                "–".into()
            };
            let _ = writeln!(
                md,
                "| {l} | {n} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1}% | {kv} | {errs:.0} |",
                med(n, l, &|s| s.tok_s()),
                med(n, l, &|s| s.ttft_ms(0.5)),
                med(n, l, &|s| s.ttft_ms(0.99)),
                med(n, l, &|s| s.itl_ms(0.5)),
                med(n, l, &|s| s.itl_ms(0.99)),
                100.0 * med(n, l, &|s| s.hit_share())
            );
        }
        if both {
            let ratio =
                |f: &dyn Fn(&Summary) -> f64| med("kvforge", l, f) / med("llama-server", l, f);
            let _ = writeln!(
                md,
                "| {l} | kvforge / llama-server | {:.2}× | {:.2}× | {:.2}× | {:.2}× | {:.2}× | | | |",
                ratio(&|s| s.tok_s()),
                ratio(&|s| s.ttft_ms(0.5)),
                ratio(&|s| s.ttft_ms(0.99)),
                ratio(&|s| s.itl_ms(0.5)),
                ratio(&|s| s.itl_ms(0.99))
            );
        }
    }
    md.push_str("\n![tokens/s](tokens_per_s.png)\n![TTFT p50](ttft_p50.png)\n![TTFT p99](ttft_p99.png)\n![ITL p50](itl_p50.png)\n");
    md
}
