//! What every request goes through: the checks before anything changes,
//! and a generation timed to its first token, a panic caught so that the
//! caller gives back what the request holds.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::generate::{Generation, SamplingParams};

/// Checks a request before anything changes: empty, ids outside the
/// vocabulary, context, and a request larger than the whole pool.
pub(super) fn check_request(
    engine: &Engine,
    cached: usize,
    tokens: &[u32],
    params: &SamplingParams,
) -> Result<()> {
    params.validate()?;
    if tokens.is_empty() {
        return Err(EngineError::Request("empty prompt".into()));
    }
    let vocab = engine.model.cfg.vocab;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Request(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let ctx = engine.model.cfg.max_ctx;
    if cached + tokens.len() >= ctx {
        return Err(EngineError::Request(format!(
            "prompt of {} tokens leaves no room in the {ctx}-token context",
            cached + tokens.len()
        )));
    }
    let bs = engine.cache.block_size();
    let need = (cached + tokens.len() + params.max_tokens)
        .min(ctx)
        .div_ceil(bs);
    let have = engine.cache.hot_blocks();
    // A cold tier or eviction keeps a long sequence in fewer hot blocks:
    // then only its steps can tell (a full cache is a clean error there).
    let bounded = engine.cache.grows_only_hot();
    if bounded && need > have {
        return Err(EngineError::Request(format!(
            "request needs up to {need} KV blocks but the whole pool has {have}"
        )));
    }
    Ok(())
}

/// How a generation ended.
pub(super) enum Timed {
    /// With the seconds from the request to its first new token.
    Done(Generation, Option<f64>),
    Failed(EngineError),
    /// The model or the caller's `on_token` panicked: the caller cleans up,
    /// then resumes the panic.
    Panicked(Box<dyn Any + Send>),
}

/// `Engine::generate`, timing the first token and catching a panic so that
/// the caller can give back what the request holds before it goes on.
pub(super) fn generate_timed(
    engine: &Engine,
    seq: &mut Sequence,
    tokens: &[u32],
    params: &SamplingParams,
    on_token: &mut dyn FnMut(u32, &str) -> bool,
    start: Instant,
) -> Timed {
    let mut ttft = None;
    let run = catch_unwind(AssertUnwindSafe(|| {
        engine.generate(seq, tokens, params, &mut |t, piece| {
            ttft.get_or_insert_with(|| start.elapsed().as_secs_f64());
            on_token(t, piece)
        })
    }));
    match run {
        Ok(Ok(g)) => Timed::Done(g, ttft),
        Ok(Err(e)) => Timed::Failed(e),
        Err(payload) => Timed::Panicked(payload),
    }
}
