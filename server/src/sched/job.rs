//! What goes into the loop ([`Job`]) and what comes back on a job's own
//! channel ([`Event`]s: the echo, text with its tokens' scores, the end).

use std::time::Instant;

use kvforge_engine::{SamplingParams, TokenLogprob, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;

/// One request for the loop.
#[derive(Clone)]
pub struct Job {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Sampling and the token limit.
    pub params: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// The prefix index's namespace (API key and `cache_salt`).
    pub namespace: String,
    /// The request's `user`.
    pub user: Option<String>,
    /// Where its events go; dropping the receiver aborts the request.
    pub events: UnboundedSender<Event>,
    /// When it arrived.
    pub arrived: Instant,
    /// Log-probabilities of its tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
    /// The reply starts with the prompt ([`Event::Echo`]), scored when
    /// `logprobs` asks for scores.
    pub echo: bool,
    /// Choices: the request runs its prompt once, then forks `n - 1`
    /// sequences from it (sharing its blocks), each sampled on its own.
    pub n: usize,
    /// Which choice this is (0 for the request itself, the forks after).
    pub index: usize,
}

/// Text for the reply, and the scores of the tokens that made it (when
/// the request asked for them).
#[derive(Debug, Default)]
pub struct Text {
    /// The choice it belongs to.
    pub index: usize,
    /// The text (may be empty).
    pub text: String,
    /// One per token.
    pub logprobs: Vec<Scored>,
}

/// A token's log-probability as the API shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    /// Its text alone (U+FFFD for part of a character).
    pub text: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// `ln p`; `None` for a prompt's first token (nothing before it
    /// predicts it).
    pub logprob: Option<f32>,
    /// The most likely tokens at its place, most likely first.
    pub top: Vec<Alt>,
    /// Whether its text is part of the choice's text: a generated special
    /// token is not (the reply's text drops it; an echoed prompt keeps
    /// every token's).
    pub shown: bool,
}

/// A token, its bytes and its log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct Alt {
    /// Its text alone (U+FFFD for part of a character).
    pub text: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// `ln p`.
    pub logprob: f32,
}

impl Alt {
    fn new(tok: &Tokenizer, id: u32, logprob: f32) -> Alt {
        Alt {
            text: tok.pieces().get(id as usize).cloned().unwrap_or_default(),
            bytes: tok.token_bytes(id),
            logprob,
        }
    }
}

impl Scored {
    /// `t` in words: each id's text and bytes from `tok`.
    pub fn new(tok: &Tokenizer, t: &TokenLogprob) -> Scored {
        Scored::of(tok, t.token, Some(t.logprob), &t.top)
    }

    /// Generated token `t`: not shown when the reply's text drops it.
    pub fn generated(tok: &Tokenizer, t: &TokenLogprob) -> Scored {
        let mut s = Scored::new(tok, t);
        s.shown = !tok.decode_text(&[t.token]).is_ok_and(|x| x.is_empty());
        s
    }

    /// Token `id` with no score (a prompt's first token).
    pub fn unscored(tok: &Tokenizer, id: u32) -> Scored {
        Scored::of(tok, id, None, &[])
    }

    fn of(tok: &Tokenizer, id: u32, logprob: Option<f32>, top: &[(u32, f32)]) -> Scored {
        let Alt { text, bytes, .. } = Alt::new(tok, id, 0.0);
        Scored {
            text,
            bytes,
            logprob,
            top: top.iter().map(|&(id, lp)| Alt::new(tok, id, lp)).collect(),
            shown: true,
        }
    }
}

/// What a request receives, in order: the echo when asked for, tokens,
/// then one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The prompt, before the first token (completions' `echo`).
    Echo(Text),
    /// A token was generated; the text it adds (may be empty) and the
    /// scores of the tokens since the last event.
    Token(Text),
    /// A choice of the request ended (all `n` of them end the request).
    Done(Outcome),
    /// The request failed or was refused.
    Failed(ApiError),
}

/// How a choice of a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The choice.
    pub index: usize,
    /// `true`: `finish_reason: stop` (eos or a stop string); else `length`.
    pub stopped: bool,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}
