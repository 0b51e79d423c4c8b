//! One step of the loop: the batched decode, prompt chunks, sampling,
//! making room when a step does not fit, and the end of requests.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvforge_engine::{EngineError, Sequence};
use kvforge_prefix::ExtraKeys;

use super::{End, Event, Outcome, Req, Scheduler, lock};
use crate::error::ApiError;
use crate::metrics::Ended;

/// What a panic said (its `&str` or `String` payload).
pub(super) fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    format!("the generation failed inside the server: {}", panic_text(p))
}

fn failure(e: &EngineError) -> ApiError {
    match e {
        EngineError::Request(m) | EngineError::Sampling(m) => ApiError::invalid(m.clone()),
        other => ApiError::internal(other.to_string()),
    }
}

impl Scheduler {
    /// Decodes every request whose prompt is in the cache, then prompt
    /// chunks within the step's token budget.
    pub(super) fn step(&mut self) {
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                r.end.is_none() && r.context.len() == r.seq.len() + 1
            })
            .collect();
        let mut budget = self.cfg.max_step_tokens;
        let mut ran = !ready.is_empty();
        let mut fits = true;
        if !ready.is_empty() {
            fits = self.decode(&ready);
            budget = budget.saturating_sub(ready.len());
        }
        for i in 0..self.running.len() {
            let r = &self.running[i];
            let left = r.context.len() - r.seq.len();
            if !fits || budget == 0 {
                break;
            }
            if r.end.is_some() || left <= 1 {
                continue;
            }
            let n = left.min(budget);
            budget -= n;
            ran = true;
            fits = self.prefill(i, n);
        }
        if ran {
            lock(&self.shared.metrics).steps += 1;
        }
    }

    /// One batched decode step over `ready` (ascending indices); whether
    /// it fitted.
    fn decode(&mut self, ready: &[usize]) -> bool {
        let tokens: Vec<u32> = ready
            .iter()
            .map(|&i| self.running[i].context[self.running[i].seq.len()])
            .collect();
        let engine = Arc::clone(&self.engine);
        let running = &mut self.running;
        let out = catch_unwind(AssertUnwindSafe(|| {
            let mut seqs: Vec<&mut Sequence> = running
                .iter_mut()
                .enumerate()
                .filter(|(j, _)| ready.binary_search(j).is_ok())
                .map(|(_, r)| &mut r.seq)
                .collect();
            engine.decode(&mut seqs, &tokens)
        }));
        match out {
            Ok(Ok(rows)) => {
                for (&i, row) in ready.iter().zip(&rows) {
                    self.sample(i, row);
                }
                true
            }
            Ok(Err(EngineError::CacheFull(_))) => {
                self.make_room();
                false
            }
            // Something in the batch failed: run each alone, so that only
            // the one at fault fails. A request whose step was committed
            // before the failure lost its logits: it fails.
            _ => ready.iter().all(|&i| {
                let r = &mut self.running[i];
                if r.context.len() != r.seq.len() + 1 {
                    r.end = Some(End::Failed(ApiError::internal(
                        "a batched decode step failed after this request's KV was written",
                    )));
                    return true;
                }
                self.prefill(i, 1)
            }),
        }
    }

    /// Runs the next `n` context tokens of request `i` (sampling if they
    /// reach its end); whether the step fitted.
    fn prefill(&mut self, i: usize, n: usize) -> bool {
        let engine = Arc::clone(&self.engine);
        let r = &mut self.running[i];
        let start = r.seq.len();
        let Some(chunk) = r.context.get(start..start + n).map(<[u32]>::to_vec) else {
            r.end = Some(End::Failed(ApiError::internal(format!(
                "the sequence holds {start} positions of a {}-token context",
                r.context.len()
            ))));
            return true;
        };
        let reaches_end = start + n == r.context.len();
        let seq = &mut r.seq;
        let out = catch_unwind(AssertUnwindSafe(|| engine.prefill(seq, &chunk)));
        match out {
            Ok(Ok(logits)) => {
                // A chunk before the prompt's end: nothing to sample yet.
                if reaches_end {
                    self.sample(i, &logits);
                }
                true
            }
            Ok(Err(EngineError::CacheFull(_))) => {
                self.make_room();
                false
            }
            Ok(Err(e)) => {
                r.end = Some(End::Failed(failure(&e)));
                true
            }
            Err(p) => {
                r.end = Some(End::Failed(ApiError::internal(panic_message(&*p))));
                true
            }
        }
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

    /// Samples request `i`'s next token from `logits`, streams its text
    /// and decides whether it ends.
    fn sample(&mut self, i: usize, logits: &[f32]) {
        let engine = Arc::clone(&self.engine);
        let fault = self.fault.clone();
        let r = &mut self.running[i];
        let picked = catch_unwind(AssertUnwindSafe(|| {
            if let Some(f) = &fault {
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
            let mut m = lock(&self.shared.metrics);
            match r.last_token {
                None => m.ttft.observe((now - r.job.arrived).as_secs_f64()),
                Some(t) => m.itl.observe((now - t).as_secs_f64()),
            }
            m.generation_tokens += 1;
        }
        r.last_token = Some(now);
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
        if (!piece.text.is_empty() || r.generated.len() == 1)
            && r.job.events.send(Event::Token(piece.text)).is_err()
        {
            r.end = Some(End::Aborted);
        } else if piece.stopped || eos {
            r.end = Some(End::Finished { stopped: true });
        } else if full {
            r.end = Some(End::Finished { stopped: false });
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
                        && !p.text.is_empty()
                    {
                        let _ = r.job.events.send(Event::Token(p.text));
                    }
                    self.release(&mut r, true);
                    let _ = r.job.events.send(Event::Done(Outcome {
                        stopped,
                        prompt_tokens: r.job.prompt.len(),
                        completion_tokens: r.generated.len(),
                        cached_tokens: r.cached.unwrap_or(0),
                    }));
                    let mut m = lock(&self.shared.metrics);
                    m.ended(if stopped { Ended::Stop } else { Ended::Length });
                    m.e2e.observe(r.job.arrived.elapsed().as_secs_f64());
                }
                End::Aborted => {
                    self.release(&mut r, true);
                    lock(&self.shared.metrics).ended(Ended::Aborted);
                }
                End::Failed(e) => {
                    self.release(&mut r, false);
                    let _ = r.job.events.send(Event::Failed(e));
                    lock(&self.shared.metrics).ended(Ended::Failed);
                }
            }
            self.pressure = false;
        }
        if self.running.is_empty() {
            self.pressure = false;
        }
    }
}
