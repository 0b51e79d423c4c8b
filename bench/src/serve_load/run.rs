//! One measured run: a replay against a started server, with the
//! server's KV bytes per tier sampled while it runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::replay::{self, Load, Turn, quantile};
use super::servers::Spawned;

/// What a run measured.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Seconds from the first request to the last reply.
    pub wall: f64,
    /// Turns sent.
    pub requests: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Time to first token of every turn.
    pub ttft: Vec<f64>,
    /// Every gap between two tokens.
    pub itl: Vec<f64>,
    /// Prompt tokens, and those found in the prefix cache.
    pub prompt_tokens: usize,
    /// See `prompt_tokens`.
    pub cached_tokens: usize,
    /// Failed turns (not the intended disconnects).
    pub errors: Vec<String>,
    /// Intended disconnects.
    pub disconnects: usize,
    /// Conversations that completed every turn.
    pub completed: usize,
    /// Peak KV bytes in use per tier (kvforge's metrics; empty for others).
    pub peak_bytes: Vec<(String, f64)>,
    /// Per conversation, the tokens of its last turn (prompt and reply):
    /// what its KV holds at the end.
    pub final_tokens: Vec<usize>,
}

impl Summary {
    /// Aggregate tokens per second.
    pub fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.wall.max(1e-9)
    }
    /// Quantile of time to first token, in ms.
    pub fn ttft_ms(&self, q: f64) -> f64 {
        quantile(&self.ttft, q) * 1e3
    }
    /// Quantile of inter-token latency, in ms.
    pub fn itl_ms(&self, q: f64) -> f64 {
        quantile(&self.itl, q) * 1e3
    }
    /// Share of prompt tokens found in the prefix cache.
    pub fn hit_share(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
    /// Peak bytes of the cold tiers together (0 if none).
    pub fn cold_peak(&self) -> f64 {
        self.peak_bytes
            .iter()
            .filter(|p| p.0 != "hot")
            .fold(0.0, |a, p| a + p.1)
    }
    /// Peak bytes of one tier (0 if unknown).
    pub fn peak(&self, tier: &str) -> f64 {
        self.peak_bytes
            .iter()
            .find(|(t, _)| t == tier)
            .map_or(0.0, |p| p.1)
    }
}

/// Rows of a Prometheus series: (labels, value).
pub fn series(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, v) = rest.rsplit_once(' ')?;
            if !(labels.is_empty() || labels.starts_with('{')) {
                return None;
            }
            Some((labels.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The `tier="…"` of a label set.
fn tier(labels: &str) -> String {
    labels
        .split("tier=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or("")
        .to_string()
}

/// Replays `convs` on `concurrency` clients against `server`.
pub fn measure(
    server: &Spawned,
    convs: &[Vec<String>],
    concurrency: usize,
    load: &Load,
    leave: &(dyn Fn(usize) -> bool + Sync),
) -> Summary {
    let done = AtomicBool::new(false);
    let mut peaks: Vec<(String, f64)> = Vec::new();
    let start = Instant::now();
    let turns = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak: Vec<(String, f64)> = Vec::new();
            while !done.load(Ordering::SeqCst) && server.name == "kvforge" {
                for (labels, v) in series(&server.metrics(), "kvforge:kv_bytes_in_use") {
                    let t = tier(&labels);
                    match peak.iter_mut().find(|p| p.0 == t) {
                        Some(p) => p.1 = p.1.max(v),
                        None => peak.push((t, v)),
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            peak
        });
        let turns = replay::replay(
            &server.addr,
            &server.model_id,
            convs,
            concurrency,
            load,
            leave,
        );
        done.store(true, Ordering::SeqCst);
        peaks = sampler.join().unwrap_or_default();
        turns
    });
    let mut s = Summary {
        wall: start.elapsed().as_secs_f64(),
        peak_bytes: peaks,
        ..Summary::default()
    };
    for (conv, ts) in convs.iter().zip(&turns) {
        s.final_tokens
            .push(ts.last().map_or(0, |t| t.prompt_tokens + t.tokens));
        if ts.len() == conv.len() && ts.iter().all(|t| t.error.is_none() && !t.disconnected) {
            s.completed += 1;
        }
        for t in ts {
            add(&mut s, t);
        }
    }
    s
}

fn add(s: &mut Summary, t: &Turn) {
    s.requests += 1;
    if t.disconnected {
        s.disconnects += 1;
        return;
    }
    if let Some(e) = &t.error {
        s.errors.push(e.clone());
        return;
    }
    s.tokens += t.tokens;
    s.ttft.push(t.ttft);
    s.itl.extend(&t.itl);
    s.prompt_tokens += t.prompt_tokens;
    s.cached_tokens += t.cached_tokens;
}

/// The median of `xs` (NaN when empty).
pub fn median(xs: &[f64]) -> f64 {
    quantile(xs, 0.5)
}
