//! vLLM's tokenizer endpoints, which evaluation harnesses use to count
//! and cut prompts with the server's own tokenizer (lm-evaluation-harness
//! picks its "remote" tokenizer when both answer): `GET /tokenizer_info`,
//! `POST /tokenize` (`{"prompt": …}` → `{"tokens": […], "count": …}`),
//! `POST /detokenize` (`{"tokens": […]}` → `{"prompt": …}`). Special
//! tokens written in the text are read as special tokens, as Hugging
//! Face tokenizers read them; the model adds none of its own (no BOS).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::App;
use crate::api;
use crate::error::ApiError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    prompt: String,
    #[allow(dead_code)] // accepted, as vLLM takes it: nothing is added either way
    add_special_tokens: Option<bool>,
    #[allow(dead_code)] // vLLM's: the model id, when given
    model: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    tokens: Vec<u64>,
    #[allow(dead_code)]
    model: Option<String>,
}

/// `handle`'s JSON answer to the request's JSON body, once the caller is
/// authorized; a failure as its OpenAI-shaped error.
fn answer<T: serde::de::DeserializeOwned>(
    app: &App,
    headers: &HeaderMap,
    b: Result<Bytes, BytesRejection>,
    handle: impl FnOnce(T) -> Result<Value, ApiError>,
) -> Response {
    let run = || -> Result<Value, ApiError> {
        app.auth.authorize(headers)?;
        let b = b.map_err(|r| ApiError::invalid(r.body_text()))?;
        handle(serde_json::from_slice(&b).map_err(|e| api::json_error(&e))?)
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /tokenizer_info`.
pub(super) async fn info(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.auth.authorize(&headers) {
        return e.into_response();
    }
    let tok = &app.tokenizer;
    let eos = tok.decode(&[tok.eos]).unwrap_or_default();
    axum::Json(json!({
        "eos_token": eos,
        "bos_token": null,
        "pad_token": null,
        "model_max_length": app.limits.max_ctx,
        "vocab_size": tok.vocab,
    }))
    .into_response()
}

/// `POST /tokenize`.
pub(super) async fn tokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&app, &headers, b, |r: TokenizeRequest| {
        let tokens = app
            .tokenizer
            .encode(&r.prompt)
            .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize: {e}")))?;
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": app.limits.max_ctx,
            "tokens": tokens,
        }))
    })
}

/// `POST /detokenize`.
pub(super) async fn detokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&app, &headers, b, |r: DetokenizeRequest| {
        let vocab = app.tokenizer.vocab as u64;
        let mut ids = Vec::with_capacity(r.tokens.len());
        for (i, &t) in r.tokens.iter().enumerate() {
            if t >= vocab {
                return Err(ApiError::invalid_param(
                    &format!("tokens[{i}]"),
                    format!("token id {t} is not in the vocabulary of {vocab} tokens"),
                ));
            }
            ids.push(t as u32);
        }
        let prompt = app
            .tokenizer
            .decode(&ids)
            .map_err(|e| ApiError::invalid(format!("cannot detokenize: {e}")))?;
        Ok(json!({"prompt": prompt}))
    })
}
