//! [`ApiError`]: every refusal the server gives, in OpenAI's shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its HTTP
//! status, so that an OpenAI client raises its usual exception type.

use serde_json::json;

/// A refused or failed request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status (400, 401, 404, 408, 413, 429, 500, 503).
    pub status: u16,
    /// One line that says what is wrong and, where it helps, what to do.
    pub message: String,
    /// OpenAI's error type: `invalid_request_error`, `authentication_error`,
    /// `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found` …).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503 only).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request cannot be served as given.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    /// 401: no API key, or not one of the server's.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(401, "authentication_error", message).with_code("invalid_api_key")
    }

    /// 404: a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            format!("the model {asked:?} does not exist; this server serves {served:?}"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 413: the body is over the server's limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            format!("request body over the server's limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 408: the body did not arrive within the server's read timeout.
    pub fn body_timeout(secs: f64) -> Self {
        Self::new(
            408,
            "invalid_request_error",
            format!("the request body did not arrive within {secs} s"),
        )
        .with_code("request_timeout")
    }

    /// 429: the waiting queue is full.
    pub fn queue_full(max_waiting: usize) -> Self {
        let mut e = Self::new(
            429,
            "rate_limit_error",
            format!("{max_waiting} requests are already waiting; retry later"),
        )
        .with_code("queue_full");
        e.retry_after = Some(1);
        e
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> Self {
        let mut e = Self::new(503, "server_error", "the server is shutting down")
            .with_code("shutting_down");
        e.retry_after = Some(1);
        e
    }

    /// 500: the generation failed inside the server (only this request).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "server_error", message)
    }

    /// The same error naming `param`.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// The same error with `code`.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}
