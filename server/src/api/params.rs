//! The fields both endpoints share, checked: sampling, stop strings,
//! streaming, `n`, the penalties, the prompt's length.

use kvforge_engine::SamplingParams;
use serde_json::Value;

use super::{Common, Endpoint, Limits, MAX_CHOICES, MAX_STOP, Parsed, bad};
use crate::error::ApiError;

impl Common {
    /// The checked request, around `prompt`.
    pub(super) fn finish(
        self,
        endpoint: Endpoint,
        prompt: Vec<u32>,
        max_tokens: Option<u64>,
        max_param: &str,
        limits: &Limits,
    ) -> Result<Parsed, ApiError> {
        let n = self.n.unwrap_or(1);
        if n == 0 || n as usize > MAX_CHOICES {
            return Err(bad(
                "n",
                format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if v.is_some_and(|x| x != 0.0) {
                return Err(bad(name, format!("{name} is not supported (only 0)")));
            }
        }
        if prompt.is_empty() {
            return Err(bad(
                if endpoint == Endpoint::Chat {
                    "messages"
                } else {
                    "prompt"
                },
                "the prompt is empty",
            ));
        }
        if prompt.len() >= limits.max_ctx {
            return Err(super::context_exceeded(
                endpoint,
                format!(
                    "the prompt is {} tokens, and this model's context is {} tokens",
                    prompt.len(),
                    limits.max_ctx
                ),
            ));
        }
        // A max_tokens past the context is refused, as OpenAI and vLLM
        // refuse it: the client's, or completions' default of 16 (chat
        // without one: the reply ends at the context).
        if let Some(m) = max_tokens
            && (prompt.len() as u64).saturating_add(m) > limits.max_ctx as u64
        {
            return Err(super::context_exceeded(
                endpoint,
                format!(
                    "this model's context is {} tokens, and the request asks for {} ({} in the prompt, {m} to generate: {max_param}, 16 when a completion gives none)",
                    limits.max_ctx,
                    (prompt.len() as u64).saturating_add(m),
                    prompt.len()
                ),
            ));
        }
        let params = self.sampling(max_tokens, max_param, limits)?;
        let stop = stop_strings(self.stop.as_ref())?;
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(bad(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        if let Some(salt) = &self.cache_salt
            && salt.is_empty()
        {
            return Err(bad("cache_salt", "cache_salt must not be empty"));
        }
        Ok(Parsed {
            endpoint,
            prompt,
            params,
            stop,
            stream,
            include_usage: self
                .stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            cache_salt: self.cache_salt,
            user: self.user,
            logprobs: None,
            echo: false,
            n: n as usize,
        })
    }

    /// The sampling parameters, each checked.
    fn sampling(
        &self,
        max_tokens: Option<u64>,
        max_param: &str,
        limits: &Limits,
    ) -> Result<SamplingParams, ApiError> {
        let max_tokens = match max_tokens {
            Some(0) => return Err(bad(max_param, format!("{max_param} must be at least 1"))),
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => limits.default_max_tokens,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(bad(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(bad(
                    "top_k",
                    format!("top_k must be -1, 0 or positive, got {k}"),
                ));
            }
        };
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: self.seed.map_or_else(fresh_seed, |s| s as u64),
            max_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// A seed for a request that gives none: OpenAI and vLLM sample a new
/// one each time, so two such requests do not repeat each other.
fn fresh_seed() -> u64 {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).rotate_left(17)
}

fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, x) in items.iter().enumerate() {
                match x.as_str() {
                    Some(s) => out.push(s.to_string()),
                    None => return Err(bad(&format!("stop[{i}]"), "stop must hold strings")),
                }
            }
            out
        }
        Some(_) => {
            return Err(bad("stop", "stop must be a string or an array of strings"));
        }
    };
    if list.len() > MAX_STOP {
        return Err(bad("stop", format!("at most {MAX_STOP} stop strings")));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("stop", "stop strings must not be empty"));
    }
    Ok(list)
}
