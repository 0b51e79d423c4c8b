//! Which fields a request may hold, and of which JSON type: an unknown
//! field, a real OpenAI field the server does not implement, or a known
//! field of the wrong type is refused naming the field (`param`), before
//! serde reads the body (its errors name no field).

use serde_json::Value;

use super::{Endpoint, bad};
use crate::error::ApiError;

/// The fields both endpoints take.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "cache_salt",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
];

/// OpenAI's request fields this server does not implement: `null` (what
/// clients such as LangChain and lm-evaluation-harness send for a field
/// they do not use) is accepted, any other value is refused as not
/// supported.
const UNSUPPORTED_FIELDS: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "logit_bias",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
];

/// Refuses a field the endpoint does not know, as OpenAI does
/// ("Unrecognized request argument supplied"), and a real OpenAI field it
/// does not implement unless it is `null`. Serde's own refusal cannot be
/// used: it does not work with the flattened shared fields.
pub fn check_fields(body: &Value, endpoint: Endpoint) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    };
    let own: &[&str] = match endpoint {
        Endpoint::Chat => &["messages", "max_completion_tokens", "top_logprobs"],
        Endpoint::Completion => &["prompt", "echo", "best_of", "suffix"],
    };
    for (key, value) in obj {
        if UNSUPPORTED_FIELDS.contains(&key.as_str()) {
            if value.is_null() || is_no_op(key, value) {
                continue;
            }
            return Err(bad(
                key,
                format!("{key} is not supported by this server (only null or its default)"),
            ));
        }
        if !COMMON_FIELDS.contains(&key.as_str()) && !own.contains(&key.as_str()) {
            return Err(bad(
                key,
                format!("unrecognized request argument supplied: {key}"),
            ));
        }
        if let Some(want) = expected(key, endpoint)
            && !value.is_null()
            && !want.accepts(value)
        {
            return Err(bad(
                key,
                format!("{key} must be {}, got {}", want.words(), kind_of(value)),
            ));
        }
    }
    Ok(())
}

/// A value of a field the server does not implement that asks for nothing
/// (`store: false`, an empty `logit_bias`, `parallel_tool_calls` without
/// tools, plain-text `response_format`, the default service tier): accepted, as the default it is.
fn is_no_op(key: &str, value: &Value) -> bool {
    match key {
        "store" => value == &Value::Bool(false),
        "logit_bias" | "metadata" => value.as_object().is_some_and(|m| m.is_empty()),
        "parallel_tool_calls" => value.is_boolean(),
        "response_format" => {
            value.as_object().is_some_and(|m| m.len() == 1) && value["type"] == "text"
        }
        "service_tier" => matches!(value.as_str(), Some("auto" | "default")),
        _ => false,
    }
}

/// The JSON type a known field takes.
#[derive(Clone, Copy)]
enum Want {
    Bool,
    Number,
    Integer,
    Count,
    Text,
    Object,
    Array,
    TextOrArray,
}

impl Want {
    fn accepts(self, v: &Value) -> bool {
        match self {
            Want::Bool => v.is_boolean(),
            Want::Number => v.is_number(),
            Want::Integer => v.is_i64(),
            Want::Count => v.is_u64(),
            Want::Text => v.is_string(),
            Want::Object => v.is_object(),
            Want::Array => v.is_array(),
            Want::TextOrArray => v.is_string() || v.is_array(),
        }
    }

    fn words(self) -> &'static str {
        match self {
            Want::Bool => "a boolean",
            Want::Number => "a number",
            Want::Integer => "a signed 64-bit integer",
            Want::Count => "a non-negative integer",
            Want::Text => "a string",
            Want::Object => "an object",
            Want::Array => "an array",
            Want::TextOrArray => "a string or an array",
        }
    }
}

/// The type of known field `key` on `endpoint` (`None`: not a field
/// checked here).
fn expected(key: &str, endpoint: Endpoint) -> Option<Want> {
    Some(match key {
        "model" | "user" | "cache_salt" | "suffix" => Want::Text,
        "max_tokens" | "max_completion_tokens" | "n" | "best_of" | "top_logprobs" => Want::Count,
        "temperature" | "top_p" | "frequency_penalty" | "presence_penalty" => Want::Number,
        "top_k" | "seed" => Want::Integer,
        "stream" | "ignore_eos" | "echo" => Want::Bool,
        "logprobs" if endpoint == Endpoint::Chat => Want::Bool,
        "logprobs" => Want::Count,
        "stream_options" => Want::Object,
        "messages" => Want::Array,
        "stop" | "prompt" => Want::TextOrArray,
        _ => return None,
    })
}

/// A JSON value's type, in words.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number with a fraction or exponent",
        Value::Number(n) if n.as_i64().is_some_and(|i| i < 0) => "a negative integer",
        Value::Number(n) if n.as_i64().is_none() => "an integer above 2^63 - 1",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
