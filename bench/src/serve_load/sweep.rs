//! The concurrency sweep (kvforge and llama-server interleaved, repeated)
//! and the soak (kvforge alone, clients leaving mid-stream).

use std::fmt::Write as _;

use anyhow::{Result, bail};

use super::replay::Load;
use super::run::{Summary, measure, median, series};
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

/// Runs the sweep and writes `sweep.csv`, the plots and `report.md`.
pub fn sweep(c: &Common, sw: &Sweep, llama: Option<&LlamaSpec>, out: &mut Output) -> Result<()> {
    let most = sw.levels.iter().copied().max().unwrap_or(1);
    let convs = c.chats(most.max(sw.min_convs))?;
    let load = Load {
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        disconnect_after: None,
    };
    let mut csv = Csv::new(HEAD);
    // (server, level) -> the reps' summaries
    let mut runs: Vec<(&str, usize, Vec<Summary>)> = Vec::new();
    for &level in &sw.levels {
        let convs = &convs[..level.max(sw.min_convs)];
        for rep in 0..sw.reps {
            let mut order: Vec<&str> = vec!["kvforge"];
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
                row(&mut csv, name, level, rep, &s);
                match runs.iter_mut().find(|r| r.0 == name && r.1 == level) {
                    Some(r) => r.2.push(s),
                    None => runs.push((name, level, vec![s])),
                }
            }
        }
    }
    out.csv("sweep.csv", &csv)?;
    let med = |name: &str, level: usize, f: &dyn Fn(&Summary) -> f64| {
        runs.iter()
            .find(|r| r.0 == name && r.1 == level)
            .map_or(f64::NAN, |r| median(&r.2.iter().map(f).collect::<Vec<_>>()))
    };
    let names: Vec<&str> = if llama.is_some() {
        vec!["kvforge", "llama-server"]
    } else {
        vec!["kvforge"]
    };
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
                        .map(|&l| (l as f64, med(n, l, f)))
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
    let mut md = format!(
        "# kvforge serve under load\n\nEach client replays a chitchat conversation turn by turn, resending the whole \
         history every turn and streaming a reply of at most {} tokens (greedy; ignore_eos {}); {} runs per server and level, the \
         servers interleaved, a fresh server per run; medians below (every run in `sweep.csv`).\n\n\
         | concurrency | server | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | prefix hit | peak KV MiB (hot + cold) | errors |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        c.max_tokens, c.ignore_eos, sw.reps
    );
    for &l in &sw.levels {
        for &n in &names {
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
        if llama.is_some() {
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
    out.report(&md)?;
    Ok(())
}

/// `soak`'s own flags.
#[derive(Clone, Debug)]
pub struct Soak {
    /// Minutes to run.
    pub minutes: f64,
    /// Clients at once.
    pub concurrency: usize,
    /// Share of conversations whose client leaves mid-stream.
    pub leave: f64,
}

/// Waves of `concurrency` conversations until the time is up; after each
/// wave, the server's blocks in use (back to the cached set: none held),
/// its RSS and the errors.
pub fn soak(c: &Common, sk: &Soak, out: &mut Output) -> Result<()> {
    if !(0.0..1.0).contains(&sk.leave) {
        bail!("--leave takes a share in [0, 1)");
    }
    let pool = c.chats(400)?;
    let log = c.log("kvforge-soak.log");
    let server = c
        .kvforge(&[
            "--max-batch".into(),
            sk.concurrency.to_string(),
            "--kv-tokens".into(),
            (1024 * sk.concurrency).to_string(),
        ])
        .start(&log)?;
    super::warm_up(&server);
    let load = Load {
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        disconnect_after: Some(3),
    };
    let mut csv = Csv::new(&[
        "wave",
        "t_s",
        "rss_mib",
        "hot_blocks_in_use",
        "cached_free_blocks",
        "requests",
        "errors",
        "disconnects",
        "tok_s",
    ]);
    let start = std::time::Instant::now();
    let (mut errors, mut waves, mut held_after) = (0usize, 0usize, 0usize);
    let mut rss: Vec<(f64, f64)> = Vec::new();
    while start.elapsed().as_secs_f64() < sk.minutes * 60.0 {
        let from = (waves * sk.concurrency) % (pool.len() - sk.concurrency);
        let convs = &pool[from..from + sk.concurrency];
        // Conversation i's client leaves on its last turn when its draw falls under the share.
        let leave = |i: usize| ((i * 7919 + waves * 104_729) % 1000) as f64 / 1000.0 < sk.leave;
        let s = measure(&server, convs, sk.concurrency, &load, &leave);
        let m = server.metrics();
        let get = |name: &str| {
            series(&m, name)
                .iter()
                .find(|r| r.0.contains("hot"))
                .map_or(f64::NAN, |r| r.1)
        };
        let in_use = get("kvforge:kv_blocks_in_use");
        let mib = server.rss_bytes().unwrap_or(0) as f64 / (1u64 << 20) as f64;
        let t = start.elapsed().as_secs_f64();
        rss.push((t / 60.0, mib));
        errors += s.errors.len();
        if in_use != 0.0 {
            held_after += 1;
        }
        csv.row([
            waves.to_string(),
            format!("{t:.1}"),
            format!("{mib:.1}"),
            format!("{in_use}"),
            format!("{}", get("kvforge:kv_blocks_cached_free")),
            s.requests.to_string(),
            s.errors.len().to_string(),
            s.disconnects.to_string(),
            format!("{:.2}", s.tok_s()),
        ]);
        for e in s.errors.iter().take(3) {
            progress(&format!("wave {waves}: error {e}"));
        }
        progress(&format!(
            "wave {waves}: {:.0} s, RSS {mib:.1} MiB, {in_use} hot blocks in use, {} disconnects, {} errors",
            t,
            s.disconnects,
            s.errors.len()
        ));
        waves += 1;
    }
    let aborted = series(&server.metrics(), "kvforge:request_aborted_total")
        .first()
        .map_or(0.0, |r| r.1);
    let clean = server.stop();
    out.csv("soak.csv", &csv)?;
    let (lo, hi) = rss
        .iter()
        .fold((f64::INFINITY, 0.0f64), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    out.png("soak_rss.png", |p| {
        plot::line_plot(
            p,
            "kvforge-serve RSS during the soak",
            "minutes",
            "RSS (MiB)",
            (0.0, sk.minutes.max(0.1) * 1.05),
            (0.0, hi * 1.2),
            &[("RSS", rss.clone())],
        )
    })?;
    let first_last = (
        rss.first().map_or(0.0, |p| p.1),
        rss.last().map_or(0.0, |p| p.1),
    );
    let md = format!(
        "# Soak: {} minutes at concurrency {}\n\n{waves} waves of {} conversations ({} turns each, replies of at most {} tokens); in each \
         wave a client leaves mid-stream (after 3 chunks of its last turn) with probability {:.0}%. \n\n\
         - errors other than the intended disconnects: **{errors}**\n\
         - waves after which hot blocks were still in use (not back to the cached set): **{held_after}**\n\
         - requests the server counted as aborted: {aborted}\n\
         - RSS: {:.1} MiB after the first wave, {:.1} MiB after the last; min {lo:.1}, max {hi:.1} MiB\n\
         - exit after SIGTERM: {}\n\n![RSS](soak_rss.png)\n",
        sk.minutes,
        sk.concurrency,
        sk.concurrency,
        c.turns,
        c.max_tokens,
        sk.leave * 100.0,
        first_last.0,
        first_last.1,
        if clean { "0" } else { "not clean" }
    );
    out.report(&md)?;
    Ok(())
}
