//! `GET /metrics`: the server's counters and histograms in Prometheus'
//! text format, named after vLLM's (`kvforge:` instead of `vllm:`), and
//! the cache's own series derived from the coordinator's counters.
//!
//! Counters end in `_total`; latencies are histograms with buckets (not
//! summaries), so that a dashboard can aggregate them across instances.

use kvforge_engine::cache::CacheStats;
use kvforge_engine::metrics::{Exposition, MetricKind, Rows, label};

mod cache;
mod remote;
#[cfg(test)]
mod tests;

/// Bucket upper bounds in seconds for time to first token and request
/// latency (vLLM's, cut to what a CPU server sees).
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0,
];
/// Bucket upper bounds for the time between two tokens of a stream.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0,
];

/// A cumulative histogram.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when
    /// rendered).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The sum of the observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut Exposition, name: &str, help: &str) {
        let buckets = self.bounds.iter().copied().zip(self.counts.iter().copied());
        out.histogram(name, help, buckets, self.count, self.sum);
    }
}

/// How a request ended, for `kvforge:request_success_total` and the
/// aborted / failed counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// eos or a stop string.
    Stop,
    /// `max_tokens`, the context, or the KV budget.
    Length,
    /// The client went away.
    Aborted,
    /// The request failed (its generation panicked or erred).
    Failed,
}

/// One finished request, for the dashboard's table.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Finished {
    /// Seconds from arrival to the first token.
    pub ttft: f64,
    /// Seconds from arrival to the last token.
    pub seconds: f64,
    /// Prompt tokens.
    pub prompt: usize,
    /// Of those, found in the prefix cache.
    pub cached: usize,
    /// Tokens generated.
    pub tokens: usize,
}

/// Finished requests [`ServeMetrics::recent`] keeps.
pub const RECENT: usize = 32;

/// What the engine loop counts.
#[derive(Clone, Debug)]
pub struct ServeMetrics {
    /// Requests decoding or prefilling now.
    pub running: usize,
    /// Requests waiting to be admitted (new and preempted).
    pub waiting: usize,
    /// Seconds from arrival to the first token.
    pub ttft: Histogram,
    /// Seconds between two tokens of one request.
    pub itl: Histogram,
    /// Seconds from arrival to the last token.
    pub e2e: Histogram,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (first admission only).
    pub prefix_queries: u64,
    /// Of those, tokens whose KV was found there.
    pub prefix_hits: u64,
    /// Running requests released to make room (recomputed later).
    pub preemptions: u64,
    /// Tokens the forked choices of `n` > 1 requests read from their
    /// request's blocks instead of computing them.
    pub forked_tokens: u64,
    /// Finished with `stop`.
    pub finished_stop: u64,
    /// Finished with `length`.
    pub finished_length: u64,
    /// Ended because the client disconnected.
    pub aborted: u64,
    /// Failed inside the server.
    pub failed: u64,
    /// Engine steps run.
    pub steps: u64,
    /// The last [`RECENT`] requests finished, oldest first.
    pub recent: std::collections::VecDeque<Finished>,
}

impl Default for ServeMetrics {
    fn default() -> Self {
        ServeMetrics {
            running: 0,
            waiting: 0,
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            forked_tokens: 0,
            finished_stop: 0,
            finished_length: 0,
            aborted: 0,
            failed: 0,
            steps: 0,
            recent: std::collections::VecDeque::new(),
        }
    }
}

impl ServeMetrics {
    /// Keeps a finished request for the dashboard (the last [`RECENT`]).
    pub fn finished(&mut self, f: Finished) {
        self.recent.push_back(f);
        if self.recent.len() > RECENT {
            self.recent.pop_front();
        }
    }

    /// Counts a request that ended.
    pub fn ended(&mut self, how: Ended) {
        match how {
            Ended::Stop => self.finished_stop += 1,
            Ended::Length => self.finished_length += 1,
            Ended::Aborted => self.aborted += 1,
            Ended::Failed => self.failed += 1,
        }
    }
}

/// A series: its name (after `kvforge:`), help, and how to read its rows
/// (labels, value) from `T`. Its type follows from the name: a counter
/// ends in `_total`.
type Series<T> = (&'static str, &'static str, fn(&T) -> Rows);

fn one(v: impl Into<f64>) -> Rows {
    vec![(String::new(), v.into())]
}

/// A count as a value (exact below 2^53).
fn n(v: u64) -> Rows {
    one(v as f64)
}

/// The text `/metrics` answers: the server's series, then the cache's
/// (bytes and blocks per tier, what the policies did), the remote tier's,
/// and the latency histograms; every row labelled with `model_name` (as
/// vLLM labels its own).
pub fn render(m: &ServeMetrics, cache: &CacheStats, model_name: &str) -> String {
    let mut out = Exposition::with_labels(&[("model_name", model_name)]);
    write(&mut out, SERVER, m);
    write(&mut out, cache::SERIES, cache);
    if let Some(r) = &cache.remote {
        write(&mut out, remote::SERIES, r);
        remote::histogram(
            &mut out,
            &r.get_latency,
            "kvforge:remote_lookup_seconds",
            "Seconds per remote lookup round.",
        );
        remote::histogram(
            &mut out,
            &r.put_latency,
            "kvforge:remote_put_seconds",
            "Seconds per batched remote write.",
        );
    }
    m.ttft.render(
        &mut out,
        "kvforge:time_to_first_token_seconds",
        "Seconds from arrival to the first token.",
    );
    m.itl.render(
        &mut out,
        "kvforge:inter_token_latency_seconds",
        "Seconds between two tokens of a request.",
    );
    m.e2e.render(
        &mut out,
        "kvforge:e2e_request_latency_seconds",
        "Seconds from arrival to the last token.",
    );
    out.into_text()
}

fn write<T>(out: &mut Exposition, table: &[Series<T>], from: &T) {
    for (name, help, read) in table {
        let name = format!("kvforge:{name}");
        out.series(&name, help, MetricKind::of(&name), &read(from));
    }
}

/// The scheduler's series, with vLLM's names.
const SERVER: &[Series<ServeMetrics>] = &[
    (
        "num_requests_running",
        "Requests in the running batch.",
        |m| one(m.running as f64),
    ),
    (
        "num_requests_waiting",
        "Requests waiting to be admitted.",
        |m| one(m.waiting as f64),
    ),
    (
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        |m| n(m.prefix_queries),
    ),
    (
        "prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        |m| n(m.prefix_hits),
    ),
    (
        "prompt_tokens_total",
        "Prompt tokens of admitted requests.",
        |m| n(m.prompt_tokens),
    ),
    ("generation_tokens_total", "Tokens generated.", |m| {
        n(m.generation_tokens)
    }),
    (
        "num_preemptions_total",
        "Running requests released for room, recomputed later.",
        |m| n(m.preemptions),
    ),
    (
        "forked_prompt_tokens_total",
        "Prompt tokens the other choices of n > 1 requests share with the first (KV not recomputed).",
        |m| n(m.forked_tokens),
    ),
    (
        "request_success_total",
        "Requests finished, by finish reason.",
        |m| {
            vec![
                (label("finished_reason", "stop"), m.finished_stop as f64),
                (label("finished_reason", "length"), m.finished_length as f64),
            ]
        },
    ),
    (
        "request_aborted_total",
        "Requests whose client disconnected.",
        |m| n(m.aborted),
    ),
    (
        "request_failed_total",
        "Requests that failed inside the server.",
        |m| n(m.failed),
    ),
    (
        "engine_steps_total",
        "Engine loop steps that ran the model.",
        |m| n(m.steps),
    ),
];
