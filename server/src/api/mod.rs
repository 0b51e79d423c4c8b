//! The OpenAI request bodies this server accepts, checked into a
//! [`Parsed`] request: the prompt as token ids, sampling, stop strings,
//! streaming. Every field of OpenAI's that the server cannot honour is
//! refused with a 400 naming it, never silently ignored.

use kvforge_engine::logprobs::MAX_TOP_LOGPROBS;
use kvforge_engine::{Message, SamplingParams, Tokenizer};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

mod fields;
mod params;

pub use fields::check_fields;

/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// `n` at most. A request's choices run together once its prompt is in,
/// whatever `--max-batch` says (it bounds requests, not their choices).
pub const MAX_CHOICES: usize = 16;

/// What requests are checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    /// The model id `/v1/models` lists and requests must name.
    pub model_id: String,
    /// The model's context in tokens.
    pub max_ctx: usize,
    /// Its vocabulary size.
    pub vocab: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// Tokens the KV budget can hold at most, when only the hot tier
    /// grows (no cold tier or eviction): a longer prompt is refused.
    pub max_kv_tokens: Option<usize>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize)]
pub struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    common: Common,
    max_completion_tokens: Option<u64>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    content: Value,
    #[allow(dead_code)] // accepted, as OpenAI does; the template has no names
    name: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Deserialize)]
pub struct CompletionRequest {
    model: String,
    prompt: Value,
    #[serde(flatten)]
    common: Common,
    echo: Option<bool>,
    logprobs: Option<u64>,
    best_of: Option<u32>,
    suffix: Option<String>,
}

/// The fields both endpoints share.
#[derive(Deserialize)]
struct Common {
    max_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// vLLM's extension: keep the k most likely tokens (-1 or 0 = all).
    top_k: Option<i64>,
    /// OpenAI's seed is a signed 64-bit integer; its bits seed the sampler.
    seed: Option<i64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
    user: Option<String>,
    /// vLLM's request field: requests with different salts never share KV.
    cache_salt: Option<String>,
    /// vLLM's extension: generate `max_tokens` whatever the model says.
    ignore_eos: Option<bool>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// Which endpoint a request came in through (the response shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// A checked request.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The prompt's token ids (the chat template applied for chat).
    pub prompt: Vec<u32>,
    /// Sampling and the token limit.
    pub params: SamplingParams,
    /// Stop strings (the reply ends before the first one).
    pub stop: Vec<String>,
    /// Reply as server-sent events.
    pub stream: bool,
    /// Streaming: one more chunk with the usage at the end.
    pub include_usage: bool,
    /// `cache_salt`, if given.
    pub cache_salt: Option<String>,
    /// `user`, if given.
    pub user: Option<String>,
    /// Log-probabilities wanted: with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Completions' `echo`: the reply starts with the prompt (and its
    /// tokens' log-probabilities, when `logprobs` asks for them).
    pub echo: bool,
    /// Choices: forks of one prompt, each sampled on its own.
    pub n: usize,
}

/// The first line of a serde error, with the field it names as `param`.
pub fn json_error(e: &serde_json::Error) -> ApiError {
    let msg = e.to_string();
    let param = msg
        .split('`')
        .nth(1)
        .filter(|_| msg.starts_with("unknown field") || msg.starts_with("missing field"))
        .map(str::to_string);
    let what = if e.is_syntax() || e.is_eof() {
        "malformed JSON"
    } else {
        "invalid request"
    };
    let mut err = ApiError::invalid(format!("{what}: {msg}"));
    err.param = param;
    err
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, msg)
}

impl ChatRequest {
    /// Checks the request and applies the chat template.
    pub fn parse(self, limits: &Limits, tok: &Tokenizer) -> Result<Parsed, ApiError> {
        check_model(&self.model, limits)?;
        let top = alternatives("top_logprobs", self.top_logprobs)?;
        let logprobs = match (self.logprobs.unwrap_or(false), top) {
            (true, top) => Some(top.unwrap_or(0)),
            (false, Some(n)) if n > 0 => {
                return Err(bad("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            (false, _) => None,
        };
        if self.messages.is_empty() {
            return Err(bad("messages", "messages must hold at least one message"));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let param = format!("messages[{i}]");
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant"
            ) {
                return Err(bad(
                    &format!("{param}.role"),
                    format!(
                        "role {:?} is not supported; use system, developer, user or assistant",
                        m.role
                    ),
                ));
            }
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            messages.push(Message::new(role, content_text(&m.content, &param)?));
        }
        // Encoding stops once the prompt is known not to fit the context.
        let prompt = tok
            .chat_ids_within(&messages, limits.max_ctx.saturating_sub(1))
            .map_err(|e| ApiError::invalid(format!("cannot tokenize the messages: {e}")))?
            .ok_or_else(|| too_long(Endpoint::Chat, limits))?;
        let max = self.max_completion_tokens.or(self.common.max_tokens);
        let param = if self.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        let mut p = self
            .common
            .finish(Endpoint::Chat, prompt, max, param, limits)?;
        p.logprobs = logprobs;
        Ok(p)
    }
}

/// The text of a message's `content`: a string, or an array of
/// `{"type": "text", "text": …}` parts (joined).
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let text = (p.get("type").and_then(Value::as_str) == Some("text"))
                    .then(|| p.get("text").and_then(Value::as_str))
                    .flatten();
                match text {
                    Some(t) => out.push_str(t),
                    None => {
                        return Err(bad(
                            &format!("{param}.content[{j}]"),
                            "only {\"type\": \"text\", \"text\": …} content parts are supported",
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(
            &format!("{param}.content"),
            "content must be a string or an array of text parts",
        )),
    }
}

impl CompletionRequest {
    /// Checks the request and reads its prompt (text or token ids).
    pub fn parse(self, limits: &Limits, tok: &Tokenizer) -> Result<Parsed, ApiError> {
        check_model(&self.model, limits)?;
        let logprobs = alternatives("logprobs", self.logprobs)?;
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(bad("best_of", "best_of must be 1"));
        }
        if self.suffix.is_some() {
            return Err(bad("suffix", "suffix is not supported by this server"));
        }
        let prompt = prompt_ids(&self.prompt, limits, tok)?;
        // OpenAI's default for completions.
        let max = self.common.max_tokens.or(Some(16));
        let mut p = self
            .common
            .finish(Endpoint::Completion, prompt, max, "max_tokens", limits)?;
        p.logprobs = logprobs;
        p.echo = self.echo.unwrap_or(false);
        if p.echo && p.n > 1 {
            return Err(bad("echo", "echo with n > 1 is not supported"));
        }
        Ok(p)
    }
}

/// A count of alternatives per token (`top_logprobs`, completions'
/// `logprobs`), at most [`MAX_TOP_LOGPROBS`].
fn alternatives(param: &str, n: Option<u64>) -> Result<Option<usize>, ApiError> {
    match n {
        Some(n) if n > MAX_TOP_LOGPROBS as u64 => Err(bad(
            param,
            format!("{param} must be at most {MAX_TOP_LOGPROBS}, got {n}"),
        )),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// A completions prompt: a string, token ids, or a one-element array of
/// either (several prompts at once are refused, like `n` > 1).
fn prompt_ids(v: &Value, limits: &Limits, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let several = || {
        bad(
            "prompt",
            "one prompt per request: send several requests instead",
        )
    };
    match v {
        Value::String(s) => tok
            .encode_text_within(s, limits.max_ctx.saturating_sub(1))
            .map_err(|e| bad("prompt", format!("cannot tokenize the prompt: {e}")))?
            .ok_or_else(|| too_long(Endpoint::Completion, limits)),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            let mut ids = Vec::with_capacity(items.len());
            for (i, x) in items.iter().enumerate() {
                match x.as_u64().filter(|&t| (t as usize) < limits.vocab) {
                    Some(t) => ids.push(t as u32),
                    None => {
                        return Err(bad(
                            &format!("prompt[{i}]"),
                            format!(
                                "token id {x} is not in the vocabulary of {} tokens",
                                limits.vocab
                            ),
                        ));
                    }
                }
            }
            Ok(ids)
        }
        Value::Array(items) if items.len() == 1 => prompt_ids(&items[0], limits, tok),
        Value::Array(items) if items.len() > 1 => Err(several()),
        _ => Err(bad(
            "prompt",
            "prompt must be a string or an array of token ids",
        )),
    }
}

/// A prompt found to hold more tokens than the context before it was
/// encoded whole.
fn too_long(endpoint: Endpoint, limits: &Limits) -> ApiError {
    context_exceeded(
        endpoint,
        format!(
            "the prompt is over {} tokens, and this model's context is {} tokens",
            limits.max_ctx.saturating_sub(1),
            limits.max_ctx
        ),
    )
}

/// OpenAI's `context_length_exceeded` error, on the prompt's parameter.
pub(crate) fn context_exceeded(endpoint: Endpoint, msg: String) -> ApiError {
    ApiError::invalid(msg)
        .with_param(if endpoint == Endpoint::Chat {
            "messages"
        } else {
            "prompt"
        })
        .with_code("context_length_exceeded")
}

fn check_model(model: &str, limits: &Limits) -> Result<(), ApiError> {
    if model == limits.model_id {
        Ok(())
    } else {
        Err(ApiError::unknown_model(model, &limits.model_id))
    }
}
