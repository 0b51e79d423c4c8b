//! The soak: kvforge alone under waves of conversations, clients leaving
//! mid-stream; the blocks it holds after each wave, and its RSS.

use anyhow::{Result, bail};

use super::replay::Load;
use super::run::{measure, series};
use super::{Common, progress};
use kvforge_ablate::output::{Csv, Output};
use kvforge_ablate::plot;

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
                .find(|r| r.0.contains("tier=\"hot\""))
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
    let totals = Totals {
        waves,
        errors,
        held_after,
        aborted,
        clean,
    };
    soak_report(c, sk, &rss, &totals, out)
}

/// What the soak's waves left.
struct Totals {
    waves: usize,
    errors: usize,
    held_after: usize,
    aborted: f64,
    clean: bool,
}

/// `soak_rss.png` and `report.md`.
fn soak_report(
    c: &Common,
    sk: &Soak,
    rss: &[(f64, f64)],
    t: &Totals,
    out: &mut Output,
) -> Result<()> {
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
            &[("RSS", rss.to_vec())],
        )
    })?;
    let first_last = (
        rss.first().map_or(0.0, |p| p.1),
        rss.last().map_or(0.0, |p| p.1),
    );
    let md = format!(
        "# Soak: {} minutes at concurrency {}\n\n{} waves of {} conversations ({} turns each, replies of at most {} tokens); in each \
         wave a client leaves mid-stream (after 3 chunks of its last turn) with probability {:.0}%. \n\n\
         - errors other than the intended disconnects: **{}**\n\
         - waves after which hot blocks were still in use (not back to the cached set): **{}**\n\
         - requests the server counted as aborted: {}\n\
         - RSS: {:.1} MiB after the first wave, {:.1} MiB after the last; min {lo:.1}, max {hi:.1} MiB\n\
         - exit after SIGTERM: {}\n\n![RSS](soak_rss.png)\n",
        sk.minutes,
        sk.concurrency,
        t.waves,
        sk.concurrency,
        c.turns,
        c.max_tokens,
        sk.leave * 100.0,
        t.errors,
        t.held_after,
        t.aborted,
        first_last.0,
        first_last.1,
        if t.clean { "0" } else { "not clean" }
    );
    out.report(&md)?;
    Ok(())
}
