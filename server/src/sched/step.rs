//! One step of the loop: the engine's batch step ([`Engine::step`]: the
//! batched decode, prompt chunks, one request's failure its own) over the
//! running requests, their sampling and streaming, making room when a step
//! does not fit, and the end of requests.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

pub(super) use kvforge_engine::batch::panic_text;
use kvforge_engine::batch::{Batch, Failure, Stepped};
use kvforge_engine::logprobs::{TokenLogprob, token_logprob};
use kvforge_engine::{Engine, EngineError, Sequence, Tokenizer};
use kvforge_prefix::ExtraKeys;

use super::{End, Event, Fault, Outcome, Req, Scheduler, Scored, Shared, Text, lock};
use crate::error::ApiError;
use crate::metrics::{Ended, Finished};

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    format!("the generation failed inside the server: {}", panic_text(p))
}

fn failure(e: &EngineError) -> ApiError {
    match e {
        EngineError::Request(m) | EngineError::Sampling(m) => ApiError::invalid(m.clone()),
        other => ApiError::internal(other.to_string()),
    }
}

/// The running requests as the engine's batch step sees them.
struct Running<'a> {
    engine: &'a Engine,
    shared: &'a Shared,
    fault: Option<&'a Fault>,
    reqs: &'a mut [Req],
}

impl Batch for Running<'_> {
    fn requests(&self) -> usize {
        self.reqs.len()
    }

    fn ended(&self, i: usize) -> bool {
        self.reqs[i].end.is_some()
    }

    fn pending(&self, i: usize) -> &[u32] {
        let r = &self.reqs[i];
        r.context.get(r.seq.len()..).unwrap_or_default()
    }

    fn sequences(&mut self, which: &[usize]) -> Vec<&mut Sequence> {
        self.reqs
            .iter_mut()
            .enumerate()
            .filter(|(j, _)| which.binary_search(j).is_ok())
            .map(|(_, r)| &mut r.seq)
            .collect()
    }

    fn sample(&mut self, i: usize, logits: &[f32]) {
        sample(
            self.engine,
            self.shared,
            self.fault,
            &mut self.reqs[i],
            logits,
        );
    }

    fn fail(&mut self, i: usize, why: Failure) {
        let e = match why {
            Failure::Engine(e) => failure(&e),
            Failure::Panic(p) => ApiError::internal(panic_message(&*p)),
            other => ApiError::internal(other.to_string()),
        };
        self.reqs[i].end = Some(End::Failed(e));
    }

    fn prompt_logprobs(&self, i: usize) -> Option<usize> {
        let r = &self.reqs[i];
        r.job.logprobs.filter(|_| r.scores_prompt())
    }

    fn scored(&mut self, i: usize, from: usize, scores: Vec<TokenLogprob>) {
        let r = &mut self.reqs[i];
        let n = r.job.prompt.len();
        r.prompt_scores.resize(n, None);
        for (at, s) in (from..n).zip(scores) {
            r.prompt_scores[at] = Some(s);
        }
    }
}

impl Scheduler {
    /// Decodes every request whose prompt is in the cache, then prompt
    /// chunks within the step's token budget; makes room when it did not
    /// fit.
    pub(super) fn step(&mut self) {
        let engine = Arc::clone(&self.engine);
        let mut running = Running {
            engine: &engine,
            shared: &self.shared,
            fault: self.fault.as_ref(),
            reqs: &mut self.running,
        };
        match engine.step(&mut running, self.cfg.max_step_tokens) {
            Stepped::Idle => return,
            Stepped::Ran => {}
            Stepped::Full(_) => self.make_room(),
        }
        self.fork_choices();
        lock(&self.shared.metrics).steps += 1;
    }

    /// A step did not fit: preempt the newest running request, or, if one
    /// is left alone, end it.
    fn make_room(&mut self) {
        if self.running.iter().any(|r| r.end.is_some()) {
            return; // their blocks come back at the sweep: retry then
        }
        match self.running.len() {
            0 => {}
            1 => {
                let r = &mut self.running[0];
                r.end = Some(if r.generated.is_empty() {
                    End::Failed(
                        ApiError::invalid(format!(
                            "the request does not fit the server's KV budget ({} context tokens)",
                            r.context.len()
                        ))
                        .with_code("kv_budget_exceeded"),
                    )
                } else {
                    End::Finished { stopped: false }
                });
            }
            _ => {
                let newest = (0..self.running.len())
                    .max_by_key(|&i| self.running[i].admitted)
                    .unwrap_or(0);
                self.running[newest].end = Some(End::Preempted);
                self.pressure = true;
            }
        }
    }

    /// Gives back what `r`'s sequence holds; registers its KV in the
    /// prefix index first when it is worth keeping.
    fn release(&self, r: &mut Req, register: bool) {
        if r.seq.id().is_none() {
            return;
        }
        let cache = self.engine.cache();
        if register {
            let extra = ExtraKeys::namespace(&r.job.namespace);
            let held = &r.context[..r.seq.len()];
            if let Err(e) = cache.register(&r.seq, held, &extra) {
                tracing::warn!("registering a finished request's KV failed: {e}");
            }
        }
        if let Err(e) = cache.free(&mut r.seq) {
            tracing::error!("freeing a request's sequence failed: {e}");
        }
        r.seq = Sequence::default();
        // What the index took goes out before the reply ends: a router
        // that routes the next turn at once knows where its prefix is.
        if let Some(log) = &self.shared.kv_events {
            log.commit();
        }
    }

    /// Ends, preempts or keeps each running request, as its step decided.
    pub(super) fn sweep(&mut self) {
        let running = std::mem::take(&mut self.running);
        for mut r in running {
            let Some(end) = r.end.take() else {
                self.running.push(r);
                continue;
            };
            match end {
                End::Preempted => {
                    self.release(&mut r, true);
                    self.shared.queued.fetch_add(1, Ordering::SeqCst);
                    lock(&self.shared.metrics).preemptions += 1;
                    r.lookup = super::Lookup::New;
                    self.waiting.push_front(r);
                    self.start_lookups();
                    continue;
                }
                End::Finished { stopped } => {
                    // Text held back for a stop string or an unfinished
                    // character goes out now (a reply the budget ended).
                    let tok = self.engine.tokenizer();
                    if let Ok(p) = r.reply.piece(tok, None, &r.job.stop, true)
                        && (!p.text.is_empty() || !r.unsent.is_empty())
                    {
                        let logprobs = std::mem::take(&mut r.unsent);
                        let _ = r.job.events.send(Event::Token(Text {
                            index: r.job.index,
                            text: p.text,
                            logprobs,
                        }));
                    }
                    self.release(&mut r, true);
                    let _ = r.job.events.send(Event::Done(Outcome {
                        index: r.job.index,
                        stopped,
                        prompt_tokens: r.job.prompt.len(),
                        completion_tokens: r.generated.len(),
                        cached_tokens: r.cached.unwrap_or(0),
                    }));
                    if r.counts() {
                        let mut m = lock(&self.shared.metrics);
                        m.ended(if stopped { Ended::Stop } else { Ended::Length });
                        let seconds = r.job.arrived.elapsed().as_secs_f64();
                        m.e2e.observe(seconds);
                        m.finished(Finished {
                            ttft: r.ttft.unwrap_or(seconds),
                            seconds,
                            prompt: r.job.prompt.len(),
                            cached: r.cached.unwrap_or(0),
                            tokens: r.generated.len(),
                        });
                    }
                }
                End::Aborted => {
                    self.release(&mut r, true);
                    if r.counts() {
                        lock(&self.shared.metrics).ended(Ended::Aborted);
                    }
                }
                End::Failed(e) => {
                    self.release(&mut r, false);
                    let _ = r.job.events.send(Event::Failed(e));
                    if r.counts() {
                        lock(&self.shared.metrics).ended(Ended::Failed);
                    }
                }
            }
            self.pressure = false;
        }
        if self.running.is_empty() {
            self.pressure = false;
        }
    }
}

/// Samples `r`'s next token from `logits`, streams its text and decides
/// whether it ends.
pub(super) fn sample(
    engine: &Engine,
    shared: &Shared,
    fault: Option<&Fault>,
    r: &mut Req,
    logits: &[f32],
) {
    let picked = catch_unwind(AssertUnwindSafe(|| {
        if let Some(f) = fault {
            f(r.job.user.as_deref());
        }
        r.sampler.sample(logits)
    }));
    let next = match picked {
        Ok(t) => t,
        Err(p) => {
            r.end = Some(End::Failed(ApiError::internal(panic_message(&*p))));
            return;
        }
    };
    let now = Instant::now();
    {
        let mut m = lock(&shared.metrics);
        match r.last_token {
            None if r.counts() => {
                let ttft = (now - r.job.arrived).as_secs_f64();
                m.ttft.observe(ttft);
                r.ttft.get_or_insert(ttft);
            }
            None => {}
            Some(t) => m.itl.observe((now - t).as_secs_f64()),
        }
        m.generation_tokens += 1;
    }
    r.last_token = Some(now);
    let tok = engine.tokenizer();
    if r.generated.is_empty() && r.job.echo && !r.echoed {
        r.echoed = true;
        if echo(tok, r).is_err() {
            r.end = Some(End::Aborted);
            return;
        }
    }
    if r.generated.is_empty() && r.job.n > 1 && r.counts() && r.fork_logits.is_none() {
        r.fork_logits = Some(logits.to_vec());
    }
    if let Some(top) = r.job.logprobs {
        r.unsent
            .push(Scored::generated(tok, &token_logprob(logits, next, top)));
    }
    r.generated.push(next);
    r.context.push(next);
    let eos = next == engine.tokenizer().eos && !r.job.params.ignore_eos;
    let full = r.generated.len() >= r.job.params.max_tokens
        || r.context.len() >= engine.model_config().max_ctx;
    let piece = match r
        .reply
        .piece(engine.tokenizer(), Some(next), &r.job.stop, eos || full)
    {
        Ok(p) => p,
        Err(e) => {
            r.end = Some(End::Failed(failure(&e)));
            return;
        }
    };
    if !piece.text.is_empty() || r.generated.len() == 1 {
        let logprobs = std::mem::take(&mut r.unsent);
        let t = Text {
            index: r.job.index,
            text: piece.text,
            logprobs,
        };
        if r.job.events.send(Event::Token(t)).is_err() {
            r.end = Some(End::Aborted);
            return;
        }
    }
    if piece.stopped || eos {
        r.end = Some(End::Finished { stopped: true });
    } else if full {
        r.end = Some(End::Finished { stopped: false });
    }
}

/// Sends `r`'s prompt as its reply's start: its text (special tokens
/// included, as a prompt of token ids holds them) and, when asked for,
/// its tokens' scores (the first one has none). `Err`: the client is gone.
fn echo(tok: &Tokenizer, r: &mut Req) -> Result<(), ()> {
    let text = tok.decode(&r.job.prompt).unwrap_or_default();
    let logprobs = if r.job.logprobs.is_some() {
        let mut scores = std::mem::take(&mut r.prompt_scores);
        scores.resize(r.job.prompt.len(), None);
        let ids = r.job.prompt.iter();
        ids.zip(&scores)
            .map(|(&id, s)| match s {
                Some(s) => Scored::new(tok, s),
                None => Scored::unscored(tok, id),
            })
            .collect()
    } else {
        Vec::new()
    };
    let e = Event::Echo(Text {
        index: r.job.index,
        text,
        logprobs,
    });
    r.job.events.send(e).map_err(|_| ())
}
