//! Sampling and the generation loop.

use std::time::Instant;

use crate::batch::{Batch, Failure, Stepped};
use crate::cache::Sequence;
use crate::detokenize::Detokenizer;
use crate::engine::Engine;
use crate::error::{EngineError, Result};

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// RNG seed: the same seed and inputs give the same tokens.
    pub seed: u64,
    /// Stop after this many new tokens.
    pub max_tokens: usize,
    /// Do not stop at the end-of-sequence token.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 256,
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Checks every field; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Sampling(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// A seeded sampler.
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// Validates `params` and seeds the RNG.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let state = params.seed ^ 0x9e37_79b9_7f4a_7c15;
        Ok(Sampler { params, state })
    }

    fn uniform(&mut self) -> f64 {
        // SplitMix64 -> [0, 1)
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let argmax = || {
            logits
                .iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                    if v > b.1 { (i, v) } else { b }
                })
                .0 as u32
        };
        if self.params.temperature == 0.0 {
            return argmax();
        }
        let t = f64::from(self.params.temperature);
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, f64::from(v) / t))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut sum = 0.0;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1;
        }
        let mut keep = cand.len();
        let mut acc = 0.0;
        for (i, c) in cand.iter().enumerate() {
            acc += c.1 / sum;
            if acc >= f64::from(self.params.top_p) {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep);
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut r = self.uniform() * total;
        for c in &cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand.last().map_or_else(argmax, |c| c.0)
    }
}

/// What one generation produced.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    /// New token ids (without the prompt; with eos if it was produced).
    pub tokens: Vec<u32>,
    /// Tokens prefilled.
    pub prompt_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_secs: f64,
    /// Seconds spent decoding after the first token.
    pub decode_secs: f64,
    /// Whether generation stopped at eos.
    pub stopped_at_eos: bool,
}

impl Generation {
    /// Decode throughput (tokens after the first, per second).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        if self.decode_secs > 0.0 {
            n / self.decode_secs
        } else {
            0.0
        }
    }
}

/// [`Engine::generate_batch`]'s sequences as a [`Batch`].
struct Generating<'a> {
    engine: &'a Engine,
    seqs: &'a mut [Sequence],
    /// Positions each sequence held before its prompt.
    base: Vec<usize>,
    /// Each one's prompt and the tokens it sampled.
    tokens: Vec<Vec<u32>>,
    samplers: Vec<Sampler>,
    texts: Vec<Detokenizer>,
    params: &'a [SamplingParams],
    outs: Vec<Generation>,
    ended: Vec<bool>,
    /// The first failure: the batch stops with it.
    error: Option<Failure>,
    on_token: &'a mut dyn FnMut(usize, u32, &str) -> bool,
    /// When the first prompt's prefill began.
    started: Instant,
    /// When decoding began (the last prompt prefilled).
    decoding: Option<Instant>,
}

impl Batch for Generating<'_> {
    fn requests(&self) -> usize {
        self.seqs.len()
    }

    fn ended(&self, i: usize) -> bool {
        self.ended[i] || self.error.is_some()
    }

    fn pending(&self, i: usize) -> &[u32] {
        let held = self.seqs[i].len() - self.base[i];
        self.tokens[i].get(held..).unwrap_or_default()
    }

    fn sequences(&mut self, which: &[usize]) -> Vec<&mut Sequence> {
        self.seqs
            .iter_mut()
            .enumerate()
            .filter(|(j, _)| which.binary_search(j).is_ok())
            .map(|(_, s)| s)
            .collect()
    }

    fn sample(&mut self, i: usize, logits: &[f32]) {
        let now = Instant::now();
        if self.outs[i].tokens.is_empty() {
            // Its prompt is in: the time since the previous prompt's end.
            let since = self.decoding.unwrap_or(self.started);
            self.outs[i].prefill_secs = (now - since).as_secs_f64();
            self.decoding = Some(now);
        }
        let next = self.samplers[i].sample(logits);
        let ctx = self.engine.model.cfg.max_ctx;
        let e = self.engine;
        match e.emit(
            i,
            next,
            &mut self.outs[i],
            &mut self.texts[i],
            &self.params[i],
            &mut *self.on_token,
        ) {
            Ok(true) if self.seqs[i].len() + 1 < ctx => self.tokens[i].push(next),
            Ok(_) => {
                self.ended[i] = true;
                let since = self.decoding.unwrap_or(self.started);
                self.outs[i].decode_secs = since.elapsed().as_secs_f64();
            }
            Err(err) => self.fail(i, Failure::Engine(err)),
        }
    }

    fn fail(&mut self, i: usize, why: Failure) {
        self.ended[i] = true;
        self.error.get_or_insert(why);
    }
}

impl Engine {
    /// Checks that `prompt` fits after what `seq` holds.
    fn check_prompt(&self, seq: &Sequence, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(EngineError::Request("empty prompt".into()));
        }
        let ctx = self.model.cfg.max_ctx;
        if seq.len() + prompt.len() >= ctx {
            return Err(EngineError::Request(format!(
                "prompt of {} tokens (after {} cached) leaves no room in the {ctx}-token context",
                prompt.len(),
                seq.len()
            )));
        }
        Ok(())
    }

    /// Prefills `prompt` after what `seq` already holds, then decodes until
    /// eos, `max_tokens`, or `on_token` returns false. `on_token` gets each
    /// new id and the text it completes (may be empty mid-character). A
    /// batch of one ([`generate_batch`](Self::generate_batch)): each step
    /// runs the sequence's next token as a prompt of one (the unbatched
    /// forward pass).
    pub fn generate(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        params: &SamplingParams,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<Generation> {
        let seqs = std::slice::from_mut(seq);
        let prompts = [prompt.to_vec()];
        let params = std::slice::from_ref(params);
        let mut outs = self.generate_batch(seqs, &prompts, params, &mut |_, id, piece| {
            on_token(id, piece)
        })?;
        outs.pop()
            .ok_or_else(|| EngineError::Request("no generation".into()))
    }

    /// [`generate`](Self::generate) for several sequences at once: prompt
    /// `i` is prefilled on `seqs[i]` (one after another), then every
    /// decode step runs the sequences still going as one batch (one left
    /// alone steps as [`generate`](Self::generate) does)
    /// ([`Llama::forward_batch`](crate::model::Llama::forward_batch): the weights
    /// are read once per step for all of them). Sequence `i` samples with
    /// `params[i]` and stops on its own (eos, `max_tokens`, the context,
    /// or `on_token(i, id, piece)` returning false); its tokens are those
    /// `generate` would give it alone, up to rounding in the batched
    /// matmuls. Every prompt and parameter set is checked before any
    /// work. On an error the step in flight is aborted: each sequence
    /// holds what its committed steps wrote.
    pub fn generate_batch(
        &self,
        seqs: &mut [Sequence],
        prompts: &[Vec<u32>],
        params: &[SamplingParams],
        on_token: &mut dyn FnMut(usize, u32, &str) -> bool,
    ) -> Result<Vec<Generation>> {
        let n = seqs.len();
        if n == 0 || prompts.len() != n || params.len() != n {
            return Err(EngineError::Request(format!(
                "a batch needs one prompt and one parameter set per sequence: {n} sequences, {} prompts, {} parameter sets",
                prompts.len(),
                params.len()
            )));
        }
        let samplers = params
            .iter()
            .map(|p| Sampler::new(p.clone()))
            .collect::<Result<Vec<_>>>()?;
        for (s, p) in seqs.iter().zip(prompts) {
            self.check_prompt(s, p)?;
        }
        let outs: Vec<Generation> = prompts
            .iter()
            .map(|p| Generation {
                prompt_tokens: p.len(),
                ..Generation::default()
            })
            .collect();
        let mut batch = Generating {
            engine: self,
            base: seqs.iter().map(Sequence::len).collect(),
            seqs,
            tokens: prompts.to_vec(),
            samplers,
            texts: (0..n).map(|_| Detokenizer::default()).collect(),
            params,
            outs,
            ended: vec![false; n],
            error: None,
            on_token,
            started: Instant::now(),
            decoding: None,
        };
        // No step budget: each prompt is prefilled whole, one after
        // another, then every step decodes all the sequences still going.
        while batch.ended.iter().any(|e| !e) {
            match self.step(&mut batch, usize::MAX) {
                Stepped::Full(e) => return Err(e),
                Stepped::Idle | Stepped::Ran => {}
            }
            if let Some(e) = batch.error.take() {
                match e {
                    Failure::Engine(e) => return Err(e),
                    Failure::Panic(p) => std::panic::resume_unwind(p),
                    other => return Err(EngineError::Request(other.to_string())),
                }
            }
        }
        Ok(batch.outs)
    }

    /// Records token `next` of sequence `i` and tells the caller; whether
    /// the sequence goes on.
    fn emit(
        &self,
        i: usize,
        next: u32,
        out: &mut Generation,
        text: &mut Detokenizer,
        params: &SamplingParams,
        on_token: &mut dyn FnMut(usize, u32, &str) -> bool,
    ) -> Result<bool> {
        out.tokens.push(next);
        let piece = text.step(&self.tokenizer, next)?;
        let go_on = on_token(i, next, &piece);
        if next == self.tokenizer.eos && !params.ignore_eos {
            out.stopped_at_eos = true;
            return Ok(false);
        }
        Ok(go_on && out.tokens.len() < params.max_tokens)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_bad_params_are_named() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0]), 1);
        for (p, word) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..Default::default()
                },
                "max_tokens",
            ),
        ] {
            let e = Sampler::new(p).err().unwrap().to_string();
            assert!(e.contains(word), "{e}");
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            seed: 7,
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        let mut top: Vec<usize> = (0..50).collect();
        top.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        assert!(a.iter().all(|&t| top[..3].contains(&(t as usize))));
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(
            distinct.len() > 1,
            "temperature 1 over 3 tokens samples more than one"
        );
        let p2 = SamplingParams {
            seed: 8,
            ..p.clone()
        };
        assert_ne!(a, draw(&p2));
        // top_p small enough keeps only the best token.
        let p3 = SamplingParams { top_p: 1e-6, ..p };
        assert!(draw(&p3).iter().all(|&t| t as usize == top[0]));
    }
}
