//! The engine loop: continuous batching on a thread of its own.
//!
//! The HTTP side hands in [`Job`]s through a channel and gets [`Event`]s
//! back on each job's own channel; it never waits on the loop. Each step
//! the loop
//!
//! 1. takes new jobs in and drops those whose client has gone (its blocks
//!    go back within the step);
//! 2. admits waiting requests, oldest first, up to `max_batch` running:
//!    each opens a sequence in the coordinator with the longest cached
//!    prefix of its prompt (the prefix index, namespaced per tenant and
//!    `cache_salt`); with a remote tier, the blocks after it were looked
//!    up on a thread of the request's own while it waited, and only a
//!    request whose lookup has answered is admitted — a slow or paused
//!    store delays that request only;
//! 3. decodes every request that has its prompt in the cache as one
//!    batch (`Engine::decode`: the weights are read once per step);
//! 4. spends what is left of the step's token budget (`max_step_tokens`)
//!    on prompt chunks (chunked prefill: a long prompt takes several steps
//!    and never stalls the running decodes);
//! 5. streams each new token to its client and, when a request ends,
//!    registers its KV in the prefix index and frees its sequence at once.
//!
//! When a step does not fit the coordinator's byte budget, the configured
//! mechanisms have already acted inside the coordinator (cold tier,
//! eviction across idle sequences); then the newest running request is
//! preempted: its KV is registered in the prefix index and freed, and it
//! goes back to the front of the queue, to be recomputed (mostly found in
//! the prefix cache) when there is room. No new request is admitted until
//! one finishes. A request that does not fit even alone ends: with
//! `finish_reason: length` if it has produced tokens, else with a 400.
//!
//! A panic in one request's work (its sampling, its prompt chunk) fails
//! that request only; a batched decode that fails or panics is run again
//! one request at a time, so that only the one at fault fails.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvforge_engine::cache::RemoteFetched;
use kvforge_engine::{Engine, Sampler, Sequence, TokenLogprob};

use crate::error::ApiError;
use crate::metrics::Ended;

mod admit;
mod fork;
mod job;
mod probe;
mod shared;
mod step;
#[cfg(test)]
mod tests;
mod text;
mod watch;

/// The scheduler's knobs.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Requests in the running batch at most.
    pub max_batch: usize,
    /// Tokens one step computes at most (decodes count one each; prompt
    /// chunks fill the rest).
    pub max_step_tokens: usize,
    /// Requests waiting at most; more are refused with 429.
    pub max_waiting: usize,
    /// The quality probe, if any.
    pub probe: Option<ProbeConfig>,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            max_batch: 16,
            max_step_tokens: 256,
            max_waiting: 256,
            probe: None,
        }
    }
}

pub use job::{Alt, Event, Job, Outcome, Scored, Text};
pub use probe::{MAX_EVERY, PROBE_CHUNK, PROBE_PREFIX, ProbeConfig, ProbePoint, ProbeReading};
pub use shared::{Msg, Shared, lock};
pub use watch::Strip;

/// A test's hook, called before each token of a request is sampled, with
/// the request's `user`; a panic there fails that request only.
pub type Fault = Arc<dyn Fn(Option<&str>) + Send + Sync>;

/// A request in the loop, waiting or running.
struct Req {
    job: Job,
    /// What the sequence must hold before the next sample: the prompt and
    /// every token generated so far.
    context: Vec<u32>,
    /// Tokens generated.
    generated: Vec<u32>,
    seq: Sequence,
    sampler: Sampler,
    reply: text::Reply,
    /// Prompt tokens found in the prefix cache at first admission
    /// (`None`: never admitted).
    cached: Option<usize>,
    /// Order of admission (the newest is preempted first).
    admitted: u64,
    /// Its remote lookup while it waits: it is admitted once `Ready`.
    lookup: Lookup,
    last_token: Option<Instant>,
    /// Seconds from arrival to its first token.
    ttft: Option<f64>,
    /// Set when the request has ended in this step.
    end: Option<End>,
    /// With `echo` and `logprobs`: the prompt's scores by position, until
    /// the echo goes out.
    prompt_scores: Vec<Option<TokenLogprob>>,
    /// The echo went out (a preempted request's prompt is not scored
    /// again).
    echoed: bool,
    /// Scores of generated tokens not sent yet.
    unsent: Vec<Scored>,
    /// With `n` > 1: the logits its prompt ended with, until the other
    /// choices are forked from it (after the step).
    fork_logits: Option<Vec<f32>>,
}

impl Req {
    fn new(job: Job, sampler: Sampler) -> Req {
        Req {
            context: job.prompt.clone(),
            job,
            generated: Vec::new(),
            seq: Sequence::default(),
            sampler,
            reply: text::Reply::default(),
            cached: None,
            admitted: 0,
            lookup: Lookup::New,
            last_token: None,
            ttft: None,
            end: None,
            prompt_scores: Vec::new(),
            echoed: false,
            unsent: Vec::new(),
            fork_logits: None,
        }
    }

    /// Whether the request's counters are kept by this choice (the first:
    /// a request of `n` choices counts once).
    fn counts(&self) -> bool {
        self.job.index == 0
    }

    /// Whether its prompt must run (and be scored) whole: an echo with
    /// scores not sent yet. Such a request takes nothing from the prefix
    /// cache or the remote tier.
    fn scores_prompt(&self) -> bool {
        self.job.echo && self.job.logprobs.is_some() && !self.echoed
    }
}

/// Where a waiting request's remote lookup stands.
enum Lookup {
    /// Not looked at yet.
    New,
    /// Something to ask, not asked yet: the lookups in flight or answered
    /// and waiting are at their cap ([`SchedConfig::max_batch`]).
    Pending,
    /// In flight; its answer comes back with this ticket.
    Asking(u64),
    /// Answered (what it brought, imported at admission), or nothing to
    /// ask: the request can be admitted.
    Ready(Option<RemoteFetched>),
}

impl Lookup {
    /// Whether it holds a lookup's place (in flight, or an answer held).
    fn held(&self) -> bool {
        matches!(self, Lookup::Asking(_) | Lookup::Ready(Some(_)))
    }
}

#[derive(Debug)]
enum End {
    Finished {
        stopped: bool,
    },
    /// Released for room; back to the queue.
    Preempted,
    Aborted,
    Failed(ApiError),
}

/// The loop's state.
pub struct Scheduler {
    engine: Arc<Engine>,
    cfg: SchedConfig,
    shared: Arc<Shared>,
    fault: Option<Fault>,
    waiting: VecDeque<Req>,
    running: Vec<Req>,
    admissions: u64,
    /// A step did not fit: admit nothing until a request finishes.
    pressure: bool,
    deadline: Option<Instant>,
    /// Remote lookups answer here, with their tickets.
    fetched_tx: mpsc::Sender<(u64, Option<RemoteFetched>)>,
    fetched: mpsc::Receiver<(u64, Option<RemoteFetched>)>,
    tickets: u64,
    /// When the next quality probe runs (`None`: no probe).
    probe_next: Option<Instant>,
}

/// How often a loop with nothing to do but wait for remote lookups (of
/// requests waiting for admission) looks for their answers and for new
/// requests.
const LOOKUP_POLL: Duration = Duration::from_millis(2);

impl Scheduler {
    /// A loop over `engine` (whose cache has prefix reuse configured).
    pub fn new(
        engine: Arc<Engine>,
        cfg: SchedConfig,
        shared: Arc<Shared>,
        fault: Option<Fault>,
    ) -> Self {
        let (fetched_tx, fetched) = mpsc::channel();
        let probe_next = cfg.probe.as_ref().map(|_| Instant::now());
        Scheduler {
            probe_next,
            fetched_tx,
            fetched,
            tickets: 0,
            engine,
            cfg,
            shared,
            fault,
            waiting: VecDeque::new(),
            running: Vec::new(),
            admissions: 0,
            pressure: false,
            deadline: None,
        }
    }

    /// Runs until the channel closes or a shutdown's work is done (then
    /// waits at most [`REMOTE_FLUSH`] for the remote tier's writes).
    pub fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            if self.idle() {
                if self.deadline.is_some() {
                    break;
                }
                self.publish();
                // Idle, the loop still wakes for the quality probe.
                let got = match self.probe_wait() {
                    None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                    Some(wait) => rx.recv_timeout(wait),
                };
                match got {
                    Ok(m) => self.take(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else if self.only_lookups() {
                match rx.recv_timeout(LOOKUP_POLL) {
                    Ok(m) => self.take(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    // No more requests can come; the lookups still answer.
                    Err(mpsc::RecvTimeoutError::Disconnected) => std::thread::sleep(LOOKUP_POLL),
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.take(m);
            }
            self.take_fetched();
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.cancel_all();
            }
            let ticked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.tick()));
            if let Err(p) = ticked {
                // A defect outside any one request's work: fail them all,
                // give their blocks back, and go on serving.
                let what = step::panic_text(&*p);
                tracing::error!("the engine loop's step panicked: {what}");
                self.fail_all(ApiError::internal(format!(
                    "the engine step failed: {what}"
                )));
            }
            self.probe_if_due();
        }
        // Blocks queued for the remote tier get a short, bounded chance.
        if !self.engine.cache().remote_flush(REMOTE_FLUSH) {
            tracing::warn!("stopping with remote writes still queued: they are dropped");
        }
        self.publish();
    }

    /// Ends every request with `e`, waiting or running.
    fn fail_all(&mut self, e: ApiError) {
        for r in self.waiting.drain(..) {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = r.job.events.send(Event::Failed(e.clone()));
            if r.counts() {
                lock(&self.shared.metrics).ended(Ended::Failed);
            }
        }
        for r in &mut self.running {
            r.end = Some(End::Failed(e.clone()));
        }
        self.sweep();
        self.pressure = false;
    }

    /// One step: drop the requests whose client is gone, admit, run the
    /// model, end what ended, publish the counters.
    fn tick(&mut self) {
        self.drop_gone();
        self.admit();
        self.step();
        self.sweep();
        self.publish();
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn take(&mut self, m: Msg) {
        match m {
            Msg::Submit(job) => {
                let sampler = match Sampler::new(job.params.clone()) {
                    Ok(s) => s,
                    Err(e) => {
                        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                        let _ = job
                            .events
                            .send(Event::Failed(ApiError::invalid(e.detail())));
                        return;
                    }
                };
                self.waiting.push_back(Req::new(job, sampler));
                self.start_lookups();
            }
            Msg::Shutdown(at) => self.deadline = Some(at),
        }
    }

    /// Requests whose client went away end now, waiting or running.
    fn drop_gone(&mut self) {
        let (mut gone, mut requests) = (0, 0);
        self.waiting.retain(|r| {
            let keep = !r.job.events.is_closed();
            gone += usize::from(!keep);
            requests += u64::from(!keep && r.counts());
            keep
        });
        if gone > 0 {
            self.shared.queued.fetch_sub(gone, Ordering::SeqCst);
            lock(&self.shared.metrics).aborted += requests;
        }
        for r in &mut self.running {
            if r.job.events.is_closed() && r.end.is_none() {
                r.end = Some(End::Aborted);
            }
        }
        self.sweep();
    }

    fn cancel_all(&mut self) {
        self.fail_all(ApiError::shutting_down());
    }
}

/// How long a shutdown waits for running requests by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// How long a stopping server waits for its remote writes.
pub const REMOTE_FLUSH: Duration = Duration::from_secs(3);
