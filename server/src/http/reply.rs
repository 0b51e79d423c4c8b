//! The replies: one JSON body, or server-sent events ending in `[DONE]`,
//! in OpenAI's shapes for chat and completions.

use std::convert::Infallible;

use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::Endpoint;
use crate::error::ApiError;
use crate::sched::{Event, Outcome, Scored, Text};

/// What every chunk of a reply names.
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) endpoint: Endpoint,
    /// The request asked for log-probabilities.
    pub(super) logprobs: bool,
    /// Its choices.
    pub(super) n: usize,
}

/// Characters of text before the next token, for completions'
/// `text_offset` (a token holding part of a character counts from the
/// character's first byte).
#[derive(Default)]
struct Offset(usize);

impl Offset {
    /// Completions' `logprobs` object for `tokens`; the tokens that come
    /// before them counted in `self`.
    fn completion(&mut self, tokens: &[Scored]) -> Value {
        let mut text_offset = Vec::with_capacity(tokens.len());
        for t in tokens {
            text_offset.push(self.0);
            if t.shown {
                self.0 += t.bytes.iter().filter(|&&b| b & 0xc0 != 0x80).count();
            }
        }
        let top = |t: &Scored| {
            t.logprob.map(|lp| {
                // The chosen token is always listed (OpenAI's "up to
                // logprobs + 1" entries).
                // Tokens holding parts of characters share one text
                // (U+FFFD): the most likely keeps it.
                let mut m = serde_json::Map::new();
                for a in &t.top {
                    m.entry(a.text.clone()).or_insert(json!(a.logprob));
                }
                m.entry(t.text.clone()).or_insert(json!(lp));
                m
            })
        };
        json!({
            "tokens": tokens.iter().map(|t| &t.text).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(top).collect::<Vec<_>>(),
            "text_offset": text_offset,
        })
    }
}

/// Chat's `logprobs` object for `tokens`.
fn chat_logprobs(tokens: &[Scored]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": a.text, "logprob": a.logprob, "bytes": a.bytes}))
                .collect();
            json!({"token": t.text, "logprob": t.logprob, "bytes": t.bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

fn finish_reason(o: &Outcome) -> &'static str {
    if o.stopped { "stop" } else { "length" }
}

impl Meta {
    /// The `logprobs` of a choice holding `tokens`.
    fn logprobs(&self, tokens: &[Scored], offset: &mut Offset) -> Value {
        match (self.logprobs, self.endpoint) {
            (false, _) => Value::Null,
            (true, Endpoint::Chat) => chat_logprobs(tokens),
            (true, Endpoint::Completion) => offset.completion(tokens),
        }
    }

    fn body(&self, choices: Vec<Value>, usage: Option<Value>, chunk: bool) -> Value {
        let object = match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("kvforge-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// A streamed choice: text (or a chat delta), its tokens' scores and
    /// the finish reason.
    fn delta(
        &self,
        index: usize,
        text: Option<&Text>,
        first: bool,
        finish: Option<&str>,
        offset: &mut Offset,
    ) -> Value {
        let logprobs = match text {
            Some(t) => self.logprobs(&t.logprobs, offset),
            None => Value::Null,
        };
        match self.endpoint {
            Endpoint::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t.text);
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completion => {
                let text = text.map_or("", |t| t.text.as_str());
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }
}

/// The usage of a request whose choices ended with `outcomes`: the
/// prompt once, the completions summed.
fn usage_of(outcomes: &[Outcome]) -> Value {
    let first = outcomes.iter().find(|o| o.index == 0).or(outcomes.first());
    let total = Outcome {
        index: 0,
        stopped: false,
        prompt_tokens: first.map_or(0, |o| o.prompt_tokens),
        completion_tokens: outcomes.iter().map(|o| o.completion_tokens).sum(),
        cached_tokens: first.map_or(0, |o| o.cached_tokens),
    };
    usage(&total)
}

/// One choice of a whole reply as it arrives.
#[derive(Default)]
struct Choice {
    text: String,
    scores: Vec<Scored>,
    outcome: Option<Outcome>,
}

/// Collects the whole reply (non-streaming): every choice's text, until
/// all `n` have ended.
pub(super) async fn whole_reply(
    meta: Meta,
    first: Event,
    mut rx: UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..meta.n).map(|_| Choice::default()).collect();
    let mut ev = Some(first);
    let mut ended = 0;
    while ended < meta.n {
        let e = match ev.take() {
            Some(e) => e,
            None => match rx.recv().await {
                Some(e) => e,
                None => return Err(ApiError::internal("the engine loop stopped")),
            },
        };
        match e {
            Event::Echo(t) | Event::Token(t) => {
                if let Some(c) = choices.get_mut(t.index) {
                    c.text.push_str(&t.text);
                    c.scores.extend(t.logprobs);
                }
            }
            Event::Failed(e) => return Err(e),
            Event::Done(o) => {
                if let Some(c) = choices.get_mut(o.index)
                    && c.outcome.replace(o).is_none()
                {
                    ended += 1;
                }
            }
        }
    }
    let outcomes: Vec<Outcome> = choices.iter().filter_map(|c| c.outcome).collect();
    let body: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(index, c)| {
            let logprobs = meta.logprobs(&c.scores, &mut Offset::default());
            let finish = c.outcome.as_ref().map(finish_reason);
            match meta.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }),
                Endpoint::Completion => json!({
                    "index": index, "text": c.text, "logprobs": logprobs,
                    "finish_reason": finish,
                }),
            }
        })
        .collect();
    let reply = meta.body(body, Some(usage_of(&outcomes)), false);
    Ok(axum::Json(reply).into_response())
}

/// Server-sent events: one chunk per token of each choice, each choice's
/// finish reason, the usage if asked for once all have ended, then
/// `[DONE]`. A failure after the first token is one `{"error": …}` event
/// and the end of the stream.
pub(super) fn stream_reply(
    meta: Meta,
    include_usage: bool,
    first: Event,
    rx: UnboundedReceiver<Event>,
) -> SseBody<impl Stream<Item = Result<Sse, Infallible>>> {
    struct St {
        meta: Meta,
        include_usage: bool,
        rx: UnboundedReceiver<Event>,
        next: Option<Event>,
        /// Per choice: whether its first chunk went out, its text offset.
        started: Vec<bool>,
        offsets: Vec<Offset>,
        outcomes: Vec<Outcome>,
        out: std::collections::VecDeque<String>,
        done: bool,
    }
    let n = meta.n;
    let st = St {
        meta,
        include_usage,
        rx,
        next: Some(first),
        started: vec![false; n],
        offsets: (0..n).map(|_| Offset::default()).collect(),
        outcomes: Vec::new(),
        out: Default::default(),
        done: false,
    };
    let s = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.out.pop_front() {
                return Some((Ok(Sse::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            let ev = match st.next.take() {
                Some(e) => e,
                None => st.rx.recv().await?,
            };
            let usage_null = st.include_usage.then_some(Value::Null);
            let (index, text, finish) = match &ev {
                Event::Echo(t) | Event::Token(t) => (t.index, Some(t), None),
                Event::Done(o) => (o.index, None, Some(finish_reason(o))),
                Event::Failed(e) => {
                    st.out.push_back(e.body().to_string());
                    st.done = true;
                    continue;
                }
            };
            if index >= st.started.len() {
                continue;
            }
            let first = !std::mem::replace(&mut st.started[index], true);
            let c = st
                .meta
                .delta(index, text, first, finish, &mut st.offsets[index]);
            st.out
                .push_back(st.meta.body(vec![c], usage_null, true).to_string());
            if let Event::Done(o) = ev {
                st.outcomes.push(o);
            }
            if st.outcomes.len() == st.meta.n {
                if st.include_usage {
                    let u = st.meta.body(Vec::new(), Some(usage_of(&st.outcomes)), true);
                    st.out.push_back(u.to_string());
                }
                st.out.push_back("[DONE]".into());
                st.done = true;
            }
        }
    });
    SseBody::new(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(text: &str, shown: bool) -> Scored {
        Scored {
            text: text.into(),
            bytes: text.as_bytes().to_vec(),
            logprob: Some(-1.0),
            top: Vec::new(),
            shown,
        }
    }

    /// A special token the reply's text drops takes no place in it: the
    /// offsets after it are where their text starts.
    #[test]
    fn text_offsets_skip_what_the_text_drops() {
        let mut at = Offset(3);
        let v = at.completion(&[
            scored("Hé", true),
            scored("<|im_end|>", false),
            scored("llo", true),
        ]);
        assert_eq!(v["text_offset"], json!([3, 5, 5]));
        assert_eq!(at.0, 8);
    }
}
