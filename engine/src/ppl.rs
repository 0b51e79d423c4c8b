//! Perplexity: full-window (llama.cpp style) and streaming through the cache.
//!
//! * **Window**: cut the tokens into windows of `window` tokens, run each
//!   from an empty cache, score the second half of each window (every scored
//!   token sees at least `window / 2` tokens of context).
//! * **Streaming**: prefill the first `prefix` tokens, then feed the rest in
//!   chunks of `chunk` tokens through the same paged cache and score every
//!   token after the prefix. Whatever the cache does to old tokens (a
//!   quantized cold tier, eviction) really affects the scored tokens.
//!
//! Both report the mean negative log-likelihood as a perplexity, KV bytes
//! (hot pool blocks and quantized cold tier), and tokens per second;
//! streaming can also time greedy decode steps at the final context.
//!
//! Window perplexity runs each window in one step from an empty cache, so a
//! cold tier never engages there: use streaming to judge it.

use std::time::Instant;

use tch::{Kind, Tensor};

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::kv::ContiguousCache;

/// One perplexity measurement.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PplReport {
    /// Tokens whose log-likelihood was scored.
    pub scored: usize,
    /// Sum of their negative log-likelihoods (nats).
    pub nll_sum: f64,
    /// `exp(nll_sum / scored)`.
    pub ppl: f64,
    /// Peak KV bytes held while scoring (hot + cold).
    pub kv_bytes: u64,
    /// Hot-tier (pool) bytes at that peak.
    pub hot_bytes: u64,
    /// Cold-tier (quantized) bytes at that peak.
    pub cold_bytes: u64,
    /// Peak KV bytes divided by the tokens in the cache at that point.
    pub kv_bytes_per_token: f64,
    /// Tokens run through the model per second.
    pub tokens_per_sec: f64,
    /// Greedy decode steps timed after scoring (streaming only).
    pub decode_steps: usize,
    /// Their rate, tokens per second (0 when none were run).
    pub decode_tokens_per_sec: f64,
    /// Streaming only: each streamed chunk's tokens scored and their NLL
    /// sum, in order (what a paired comparison of two caches resamples).
    pub chunks: Vec<(usize, f64)>,
}

impl PplReport {
    /// Records the bytes held by `seq` (and the pool) if they are a new peak.
    fn peak(&mut self, hot: u64, cold: u64, tokens: usize) {
        if hot + cold > self.kv_bytes {
            self.kv_bytes = hot + cold;
            self.hot_bytes = hot;
            self.cold_bytes = cold;
            self.kv_bytes_per_token = (hot + cold) as f64 / tokens.max(1) as f64;
        }
    }
}

/// Sum of `-log p(target)` over rows of `logits` (`[n, vocab]`).
fn nll(logits: &Tensor, targets: &[u32]) -> Result<f64> {
    let t: Vec<i64> = targets.iter().map(|&x| i64::from(x)).collect();
    let idx = Tensor::f_from_slice(&t)?
        .f_to_device(logits.device())?
        .f_unsqueeze(1)?;
    let lp = logits
        .f_log_softmax(-1, Kind::Double)?
        .f_gather(1, &idx, false)?;
    Ok(-lp.f_sum(Kind::Double)?.f_double_value(&[])?)
}

fn finish(mut r: PplReport, ran: usize, secs: f64) -> PplReport {
    r.ppl = (r.nll_sum / r.scored.max(1) as f64).exp();
    r.tokens_per_sec = ran as f64 / secs.max(1e-9);
    r
}

impl Engine {
    /// Streaming perplexity: prefill `prefix` tokens, then score the rest in
    /// chunks of `chunk` through the cache; then time `decode` greedy
    /// single-token steps at the final context (not scored).
    pub fn streaming_ppl(
        &self,
        tokens: &[u32],
        prefix: usize,
        chunk: usize,
        decode: usize,
    ) -> Result<PplReport> {
        if prefix == 0 || chunk == 0 || prefix >= tokens.len() {
            return Err(EngineError::Request(format!(
                "streaming perplexity needs 0 < prefix < {} tokens and chunk > 0 (prefix {prefix}, chunk {chunk})",
                tokens.len()
            )));
        }
        let mut seq = Sequence::default();
        let t0 = Instant::now();
        let out = (|| {
            let mut r = PplReport::default();
            let mut last =
                self.model
                    .forward(&tokens[..prefix], &mut self.cache.view(&mut seq), false)?;
            let mut p = prefix;
            while p < tokens.len() {
                let end = (p + chunk).min(tokens.len());
                let piece = &tokens[p..end];
                // The row before the chunk predicts its first token; each
                // chunk row predicts the next one.
                let mut here = nll(&last, &piece[..1])?;
                let logits = self
                    .model
                    .forward(piece, &mut self.cache.view(&mut seq), true)?;
                if piece.len() > 1 {
                    let n = piece.len() as i64;
                    here += nll(&logits.f_narrow(0, 0, n - 1)?, &piece[1..])?;
                }
                r.nll_sum += here;
                r.chunks.push((piece.len(), here));
                last = logits.f_narrow(0, piece.len() as i64 - 1, 1)?;
                r.scored += piece.len();
                let (hot, cold) = self.cache.tier_bytes();
                r.peak(hot, cold, seq.len());
                p = end;
            }
            let elapsed = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            for _ in 0..decode {
                let next = greedy_token(&last)?;
                last = self
                    .model
                    .forward(&[next], &mut self.cache.view(&mut seq), false)?;
            }
            r.decode_steps = decode;
            if decode > 0 {
                r.decode_tokens_per_sec = decode as f64 / t1.elapsed().as_secs_f64().max(1e-9);
            }
            Ok(finish(r, tokens.len(), elapsed))
        })();
        self.cache.free(&mut seq)?;
        out
    }

    /// The perplexity [`streaming_ppl`](Self::streaming_ppl) would report
    /// for the same tokens (every one after the first `prefix`) if nothing
    /// touched the KV: one forward pass over all of `tokens` into a dense
    /// cache of its own, so neither the paged cache's mechanisms nor its
    /// budget take part. The reference a live probe is plotted against.
    pub fn full_cache_ppl(&self, tokens: &[u32], prefix: usize) -> Result<PplReport> {
        if prefix == 0 || prefix >= tokens.len() {
            return Err(EngineError::Request(format!(
                "full-cache perplexity needs 0 < prefix < {} tokens (prefix {prefix})",
                tokens.len()
            )));
        }
        let t0 = Instant::now();
        let mut store = ContiguousCache::new(self.model.cfg.n_layers);
        let logits = self.model.forward(tokens, &mut store, true)?;
        let n = tokens.len() - prefix;
        let rows = logits.f_narrow(0, prefix as i64 - 1, n as i64)?;
        let r = PplReport {
            nll_sum: nll(&rows, &tokens[prefix..])?,
            scored: n,
            ..PplReport::default()
        };
        Ok(finish(r, tokens.len(), t0.elapsed().as_secs_f64()))
    }

    /// Window perplexity: windows of `window` tokens from an empty cache,
    /// scoring the second half of each.
    pub fn window_ppl(&self, tokens: &[u32], window: usize) -> Result<PplReport> {
        if window < 2 || tokens.len() < window {
            return Err(EngineError::Request(format!(
                "window perplexity needs a window of at least 2 tokens and at least one full window ({} tokens, window {window})",
                tokens.len()
            )));
        }
        let t0 = Instant::now();
        let mut r = PplReport::default();
        let mut ran = 0;
        for w in tokens.chunks_exact(window) {
            let mut seq = Sequence::default();
            let logits = self.model.forward(w, &mut self.cache.view(&mut seq), true);
            let bytes = self.cache.bytes_in_use();
            self.cache.free(&mut seq)?;
            let logits = logits?;
            let half = window / 2;
            let rows = logits.f_narrow(0, half as i64 - 1, (window - half) as i64)?;
            r.nll_sum += nll(&rows, &w[half..])?;
            r.scored += window - half;
            ran += window;
            r.peak(bytes, 0, window);
        }
        Ok(finish(r, ran, t0.elapsed().as_secs_f64()))
    }
}

/// The longest article of `text` (see [`articles`]); empty if there is none.
pub fn longest_article(text: &str) -> String {
    articles(text).into_iter().next().unwrap_or_default()
}

/// The greedy next token of a `[1, vocab]` row of logits.
pub fn greedy_token(logits: &Tensor) -> Result<u32> {
    let t = logits.f_argmax(-1, false)?.f_int64_value(&[0])?;
    u32::try_from(t).map_err(|_| EngineError::Torch(format!("argmax {t} is not a token id")))
}

/// The articles of an exllamav2-style `<doc … title=…>` calibration file
/// (plain text is one article), longest first.
pub fn articles(text: &str) -> Vec<String> {
    let mut docs: Vec<String> = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        if line.starts_with("<doc") || line.starts_with("</doc>") {
            if !cur.trim().is_empty() {
                docs.push(std::mem::take(&mut cur));
            }
            cur.clear();
            continue;
        }
        cur.push_str(line);
        cur.push('\n');
    }
    if !cur.trim().is_empty() {
        docs.push(cur);
    }
    docs.sort_by_key(|d| std::cmp::Reverse(d.len()));
    docs
}
