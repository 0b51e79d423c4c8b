//! The quality probe (seed 004's sliding-window perplexity, `--probe`):
//! every `every`, the engine loop streams a fixed held-out slice through
//! the live paged cache — its mechanisms and its budget, shared with the
//! requests running — in chunks of [`PROBE_CHUNK`] tokens, and records its
//! perplexity; the dashboard plots it against the slice's full-cache
//! perplexity (one pass into a dense cache of its own, f32 KV, computed
//! when the server starts). A rise is KV that mattered, dropped or
//! over-quantized. The loop is busy for the probe's time (reported), so
//! running requests wait that long once per period.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvforge_engine::Engine;

use super::{Scheduler, lock};

/// Tokens streamed before scoring starts.
pub const PROBE_PREFIX: usize = 32;
/// Tokens per streamed chunk (the mechanisms act between chunks).
pub const PROBE_CHUNK: usize = 16;

/// The longest period between two probes (a day).
pub const MAX_EVERY: Duration = Duration::from_secs(86_400);

/// What to probe and how often.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// The held-out slice's token ids.
    pub tokens: Vec<u32>,
    /// Time between two probes.
    pub every: Duration,
}

impl ProbeConfig {
    /// Refuses a slice too short to score or a zero period.
    pub fn check(&self) -> Result<(), String> {
        if self.tokens.len() < PROBE_PREFIX + PROBE_CHUNK {
            return Err(format!(
                "--probe: the slice has {} tokens; the probe needs at least {}",
                self.tokens.len(),
                PROBE_PREFIX + PROBE_CHUNK
            ));
        }
        if self.every.is_zero() || self.every > MAX_EVERY {
            return Err(format!(
                "--probe-every must be between 1 and {} seconds",
                MAX_EVERY.as_secs()
            ));
        }
        Ok(())
    }

    /// The slice's full-cache perplexity.
    pub fn full_cache(&self, engine: &Engine) -> Result<f64, String> {
        engine
            .full_cache_ppl(&self.tokens, PROBE_PREFIX)
            .map(|r| r.ppl)
            .map_err(|e| format!("--probe: scoring the slice failed: {e}"))
    }
}

/// One probe.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct ProbePoint {
    /// When it ran (Unix seconds).
    pub t: f64,
    /// Its perplexity through the live cache.
    pub ppl: f64,
    /// KV bytes the slice held at its peak.
    pub kv_bytes: u64,
    /// How long the loop spent on it.
    pub seconds: f64,
}

/// What the dashboard reads.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ProbeReading {
    /// The slice's perplexity with nothing touching its KV.
    pub full_cache: Option<f64>,
    /// The latest probe.
    pub last: Option<ProbePoint>,
    /// Probes run.
    pub runs: u64,
    /// Why the latest probe failed (the budget full, say), if it did.
    pub error: Option<String>,
}

impl Scheduler {
    /// How long until the next probe (`None`: no probe configured).
    pub(super) fn probe_wait(&self) -> Option<Duration> {
        self.probe_next
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// Runs the probe when it is due (never while stopping). A probe that
    /// fails or panics records why; the loop goes on.
    pub(super) fn probe_if_due(&mut self) {
        let (Some(cfg), Some(at)) = (&self.cfg.probe, self.probe_next) else {
            return;
        };
        if Instant::now() < at || self.deadline.is_some() {
            return;
        }
        let t0 = Instant::now();
        let run = std::panic::AssertUnwindSafe(|| {
            self.engine
                .streaming_ppl(&cfg.tokens, PROBE_PREFIX, PROBE_CHUNK, 0)
                .map_err(|e| e.to_string())
        });
        let r = std::panic::catch_unwind(run).unwrap_or_else(|p| {
            let what = super::step::panic_text(&*p);
            Err(format!("the probe panicked: {what}"))
        });
        let seconds = t0.elapsed().as_secs_f64();
        self.probe_next = Instant::now().checked_add(cfg.every);
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut p = lock(&self.shared.probe);
        p.runs += 1;
        match r {
            Ok(r) => {
                p.last = Some(ProbePoint {
                    t,
                    ppl: r.ppl,
                    kv_bytes: r.kv_bytes,
                    seconds,
                });
                p.error = None;
            }
            Err(e) => p.error = Some(e),
        }
    }
}
