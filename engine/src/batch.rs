//! One step of continuous batching, which every batching front end drives
//! ([`Engine::generate_batch`], the server's scheduler): each request whose
//! sequence holds its whole context but the token it sampled last is
//! decoded in one batch (the weights read once for all), then prompt
//! chunks fill what is left of the step's token budget (chunked prefill:
//! a long prompt takes several steps and never stalls the decodes).
//!
//! The caller owns its requests behind [`Batch`]: it samples (streams,
//! stops, counts), hears of each request's failure, and decides what a step
//! that does not fit the KV budget costs (whom to preempt). A failure is
//! one request's: a panic in a request's prompt chunk fails that request,
//! and a batched decode that fails or panics is run again one request at
//! a time, so that only the one at fault fails.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::EngineError;
use crate::logprobs::TokenLogprob;

/// The running requests of a caller, as a step sees them.
pub trait Batch {
    /// Requests in the batch (ended ones included: they are skipped).
    fn requests(&self) -> usize;
    /// Whether request `i` has ended (in this step or before).
    fn ended(&self, i: usize) -> bool;
    /// The tokens request `i`'s sequence does not hold yet: the rest of its
    /// prompt, or the one token it sampled last (then it is decoded).
    fn pending(&self, i: usize) -> &[u32];
    /// The sequences of `which` (ascending, distinct), in that order.
    fn sequences(&mut self, which: &[usize]) -> Vec<&mut Sequence>;
    /// Request `i`'s next-token logits: its sequence holds everything it
    /// had pending. The caller samples and makes the token pending, or
    /// ends the request.
    fn sample(&mut self, i: usize, logits: &[f32]);
    /// Request `i` failed: it must end.
    fn fail(&mut self, i: usize, why: Failure);
    /// How many alternatives request `i` wants beside each token it runs
    /// as a prompt chunk (`None`, the default: it wants no scores).
    fn prompt_logprobs(&self, i: usize) -> Option<usize> {
        let _ = i;
        None
    }
    /// The scores of request `i`'s tokens at positions `from..` of its
    /// context, from a prompt chunk (see
    /// [`Engine::prefill_scored`]); called before that chunk's `sample`.
    fn scored(&mut self, i: usize, from: usize, scores: Vec<TokenLogprob>) {
        let _ = (i, from, scores);
    }
}

/// Why one request of a step failed.
pub enum Failure {
    /// The engine refused or failed its work.
    Engine(EngineError),
    /// Its work panicked (the payload).
    Panic(Box<dyn Any + Send>),
    /// A batched decode failed after this request's step was written, so
    /// its logits are lost.
    Lost,
    /// It has nothing pending and has not ended: nothing would ever run
    /// for it (the caller's bookkeeping is wrong).
    Stalled,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Engine(e) => write!(f, "{e}"),
            Failure::Panic(p) => write!(f, "{}", panic_text(p.as_ref())),
            Failure::Lost => {
                f.write_str("a batched decode step failed after this request's KV was written")
            }
            Failure::Stalled => {
                f.write_str("the request has nothing left to run and has not ended")
            }
        }
    }
}

/// What a panic said (its `&str` or `String` payload).
pub fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// What a step did.
#[derive(Debug)]
pub enum Stepped {
    /// Nothing to run: every request has ended or waits for nothing.
    Idle,
    /// Decodes or prompt chunks ran.
    Ran,
    /// A call did not fit the KV budget (its error): nothing of that call
    /// was written, and the step stopped there. The caller makes room
    /// (ends or preempts a request) before the next step.
    Full(EngineError),
}

impl Engine {
    /// One step over `batch`: the batched decode of every request with one
    /// token pending, then prompt chunks in request order within
    /// `max_step_tokens` (a decode counts one).
    pub fn step(&self, batch: &mut dyn Batch, max_step_tokens: usize) -> Stepped {
        let live = |b: &dyn Batch, i| !b.ended(i);
        for i in 0..batch.requests() {
            if live(batch, i) && batch.pending(i).is_empty() {
                batch.fail(i, Failure::Stalled);
            }
        }
        let ready: Vec<usize> = (0..batch.requests())
            .filter(|&i| live(batch, i) && batch.pending(i).len() == 1)
            .collect();
        let mut budget = max_step_tokens;
        let mut ran = !ready.is_empty();
        if !ready.is_empty() {
            if let Err(full) = self.decode_ready(batch, &ready) {
                return Stepped::Full(full);
            }
            budget = budget.saturating_sub(ready.len());
        }
        for i in 0..batch.requests() {
            if budget == 0 {
                break;
            }
            let left = batch.pending(i).len();
            if !live(batch, i) || left <= 1 {
                continue;
            }
            let n = left.min(budget);
            budget -= n;
            ran = true;
            if let Err(full) = self.chunk(batch, i, n) {
                return Stepped::Full(full);
            }
        }
        if ran { Stepped::Ran } else { Stepped::Idle }
    }

    /// The batched decode over `ready` (ascending, one token pending
    /// each); `Err` when it did not fit. One request alone steps as a
    /// prompt of one token (the unbatched forward pass).
    fn decode_ready(&self, batch: &mut dyn Batch, ready: &[usize]) -> Result<(), EngineError> {
        if let [i] = *ready {
            return self.chunk(batch, i, 1);
        }
        let tokens: Vec<u32> = ready.iter().map(|&i| batch.pending(i)[0]).collect();
        let out = catch_unwind(AssertUnwindSafe(|| {
            let mut seqs = batch.sequences(ready);
            self.decode(&mut seqs, &tokens)
        }));
        match out {
            Ok(Ok(rows)) => {
                for (&i, row) in ready.iter().zip(&rows) {
                    batch.sample(i, row);
                }
                Ok(())
            }
            Ok(Err(e @ EngineError::CacheFull(_))) => Err(e),
            // Something in the batch failed: run each alone, so that only
            // the one at fault fails. A request whose step was committed
            // before the failure lost its logits: it fails.
            _ => {
                for (&i, &t) in ready.iter().zip(&tokens) {
                    if batch.ended(i) {
                        continue;
                    }
                    if batch.pending(i) != [t] {
                        batch.fail(i, Failure::Lost);
                        continue;
                    }
                    self.chunk(batch, i, 1)?;
                }
                Ok(())
            }
        }
    }

    /// Runs the next `n` pending tokens of request `i`, sampling when they
    /// are all it had pending; `Err` when they did not fit.
    fn chunk(&self, batch: &mut dyn Batch, i: usize, n: usize) -> Result<(), EngineError> {
        let pending = batch.pending(i);
        let tokens = pending[..n.min(pending.len())].to_vec();
        let next = pending.get(tokens.len()).copied();
        let reaches_end = next.is_none();
        let top = batch.prompt_logprobs(i);
        let out = catch_unwind(AssertUnwindSafe(|| {
            let mut seqs = batch.sequences(&[i]);
            match (seqs.first_mut(), top) {
                (Some(seq), None) => Ok((0, self.prefill(seq, &tokens)?, Vec::new())),
                (Some(seq), Some(top)) => {
                    let from = seq.len() + 1;
                    let (logits, scores) = self.prefill_scored(seq, &tokens, next, top)?;
                    Ok((from, logits, scores))
                }
                (None, _) => Err(EngineError::Request(format!("no request {i} in the batch"))),
            }
        }));
        match out {
            Ok(Ok((from, logits, scores))) => {
                if top.is_some() {
                    batch.scored(i, from, scores);
                }
                // A chunk before the prompt's end: nothing to sample yet.
                if reaches_end {
                    batch.sample(i, &logits);
                }
                Ok(())
            }
            Ok(Err(e @ EngineError::CacheFull(_))) => Err(e),
            Ok(Err(e)) => {
                batch.fail(i, Failure::Engine(e));
                Ok(())
            }
            Err(p) => {
                batch.fail(i, Failure::Panic(p));
                Ok(())
            }
        }
    }
}
