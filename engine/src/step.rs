//! The engine's two step primitives, which every front end drives (the
//! single and batched `generate`, the server's scheduler): a prompt chunk
//! after what a sequence holds, and one decode step over many sequences at
//! once (the weights read once for all). Logits come back as f32 rows, so
//! a caller names no tensor.

use tch::{Kind, Tensor};

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::kv::KvStore;
use crate::logprobs::{MAX_TOP_LOGPROBS, TokenLogprob};

/// Row `i` of `logits` (`[rows, vocab]`) as f32.
fn logits_row(logits: &Tensor, i: i64) -> Result<Vec<f32>> {
    let row = logits.f_get(i)?.f_to_kind(Kind::Float)?;
    Vec::<f32>::try_from(row).map_err(EngineError::from)
}

/// The scores of `targets[i]` under row `i` of `logits` (`[rows, vocab]`,
/// at least as many rows): a log-softmax over the vocabulary where the
/// logits are (one pass over all rows on the device), then only each
/// target's value and the `top` largest come back — not `rows × vocab`
/// values.
fn scores(logits: &Tensor, targets: &[u32], top: usize) -> Result<Vec<TokenLogprob>> {
    let k = targets.len() as i64;
    if k == 0 {
        return Ok(Vec::new());
    }
    let lp = logits
        .f_narrow(0, 0, k)?
        .f_to_kind(Kind::Float)?
        .f_log_softmax(-1, Kind::Float)?;
    let ids: Vec<i64> = targets.iter().map(|&t| i64::from(t)).collect();
    let index = Tensor::from_slice(&ids)
        .f_to_device(lp.device())?
        .f_view([k, 1])?;
    let chosen = Vec::<f32>::try_from(lp.f_gather(1, &index, false)?.f_view([-1])?)?;
    let top = top.min(MAX_TOP_LOGPROBS).min(lp.size()[1] as usize);
    let (values, which) = if top > 0 {
        let (v, i) = lp.f_topk(top as i64, -1, true, true)?;
        (
            Vec::<f32>::try_from(v.f_view([-1])?)?,
            Vec::<i64>::try_from(i.f_view([-1])?)?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(targets
        .iter()
        .zip(chosen)
        .enumerate()
        .map(|(r, (&token, logprob))| TokenLogprob {
            token,
            logprob,
            top: (r * top..(r + 1) * top)
                .map(|j| (which[j] as u32, values[j]))
                .collect(),
        })
        .collect())
}

impl Engine {
    /// Runs `tokens` after what `seq` holds (a prompt, or a chunk of one);
    /// the next token's logits over the vocabulary. On an error the step
    /// is aborted: `seq` holds what it held.
    pub fn prefill(&self, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
        let out = self
            .model
            .forward(tokens, &mut self.cache.view(seq), false)?;
        logits_row(&out, 0)
    }

    /// [`prefill`](Self::prefill) that also scores what it ran: the
    /// log-probability (and the `top` most likely tokens) of each of
    /// `tokens` after the first, then of `next` (the token that will
    /// follow them, when known) — one [`TokenLogprob`] per token with a
    /// row before it in this call. The next token's logits as `prefill`.
    pub fn prefill_scored(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        next: Option<u32>,
        top: usize,
    ) -> Result<(Vec<f32>, Vec<TokenLogprob>)> {
        let out = self
            .model
            .forward(tokens, &mut self.cache.view(seq), true)?;
        let targets: Vec<u32> = tokens.iter().skip(1).copied().chain(next).collect();
        let scores = scores(&out, &targets, top)?;
        Ok((logits_row(&out, tokens.len() as i64 - 1)?, scores))
    }

    /// One decode step: `tokens[i]` appended to `seqs[i]`, for all of them
    /// in one batched forward pass; each one's next-token logits, in order.
    /// On an error the step is aborted for every sequence.
    pub fn decode(&self, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let mut views: Vec<_> = seqs.iter_mut().map(|s| self.cache.view(s)).collect();
        let mut stores: Vec<&mut dyn KvStore> =
            views.iter_mut().map(|v| v as &mut dyn KvStore).collect();
        let out = self.model.forward_batch(tokens, &mut stores)?;
        (0..tokens.len() as i64)
            .map(|i| logits_row(&out, i))
            .collect()
    }
}
