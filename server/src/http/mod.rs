//! The HTTP side: routes, API keys, body limits, request checks, and the
//! replies (one JSON body, or server-sent events ending in `[DONE]`).
//! Nothing here runs the model: a request becomes a [`Job`] for the
//! engine loop, and its [`Event`]s come back on a channel of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvforge_engine::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc::unbounded_channel;

use crate::api::{self, ChatRequest, CompletionRequest, Endpoint, Limits, Parsed};
use crate::error::ApiError;
use crate::metrics;
use crate::sched::{Event, Job, Msg, Shared, lock};

mod auth;
mod dashboard;
mod events;
mod listen;
mod reply;
mod tokenize;
pub use auth::{ANONYMOUS, Auth};
pub use listen::Connections;
use reply::{Meta, stream_reply, whole_reply};

/// What every handler reads.
pub struct App {
    /// Request limits and the model id.
    pub limits: Limits,
    /// The model's tokenizer (prompts are tokenized here, not in the loop).
    pub tokenizer: Tokenizer,
    /// Accepted API keys, each a tenant with a namespace of its own.
    pub auth: Auth,
    /// The remote tier's live counters (read when `/metrics` is scraped).
    pub remote: Option<kvforge_remote::StatsSource>,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// How long a request's body may take to arrive.
    pub body_timeout: std::time::Duration,
    /// Requests waiting at most.
    pub max_waiting: usize,
    /// Into the engine loop.
    pub tx: mpsc::Sender<Msg>,
    /// Shared with the loop.
    pub shared: Arc<Shared>,
    next_id: AtomicU64,
}

impl App {
    /// The state of a router over the loop behind `tx`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        limits: Limits,
        tokenizer: Tokenizer,
        auth: Auth,
        remote: Option<kvforge_remote::StatsSource>,
        max_body: usize,
        body_timeout: std::time::Duration,
        max_waiting: usize,
        tx: mpsc::Sender<Msg>,
        shared: Arc<Shared>,
    ) -> Self {
        App {
            limits,
            tokenizer,
            auth,
            remote,
            max_body,
            body_timeout,
            max_waiting,
            tx,
            shared,
            next_id: AtomicU64::new(1),
        }
    }
}

/// The routes.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/tokenizer_info", get(tokenize::info))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/kv_events", get(events::subscribe))
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/stream", get(dashboard::stream))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(app.clone(), read_body))
        .with_state(app)
}

/// Reads the whole body within the body timeout (a client that sends its
/// headers, then trickles or withholds the body, gets 408 and is let go)
/// and the size limit (413), before any handler runs.
async fn read_body(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, app.max_body);
    let read = tokio::time::timeout(app.body_timeout, http_body_util::BodyExt::collect(limited));
    match read.await {
        Ok(Ok(b)) => {
            let body = axum::body::Body::from(b.to_bytes());
            next.run(axum::extract::Request::from_parts(parts, body))
                .await
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            ApiError::too_large(app.max_body).into_response()
        }
        Ok(Err(e)) => {
            ApiError::invalid(format!("reading the request body failed: {e}")).into_response()
        }
        Err(_) => ApiError::body_timeout(app.body_timeout.as_secs_f64()).into_response(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

async fn not_found() -> ApiError {
    let mut e = ApiError::invalid(
        "no such endpoint; see /v1/models, /v1/chat/completions, /v1/completions",
    );
    e.status = 404;
    e
}

/// 405 in OpenAI's error shape (axum's own has an empty body).
async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    let mut e = ApiError::invalid(format!(
        "method {method} is not allowed here; the endpoints take POST (chat, completions, tokenize, detokenize) or GET (models, health, metrics, tokenizer_info, kv_events, dashboard)"
    ));
    e.status = 405;
    e
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl App {
    /// Takes a place in the queue, or refuses.
    fn reserve(&self) -> Result<(), ApiError> {
        if self.shared.closing.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        self.shared
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                (q < self.max_waiting).then_some(q + 1)
            })
            .map(|_| ())
            .map_err(|_| ApiError::queue_full(self.max_waiting))
    }

    fn parse(&self, body: Result<Bytes, BytesRejection>, ep: Endpoint) -> Result<Parsed, ApiError> {
        let body = body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(self.max_body)
            } else {
                ApiError::invalid(r.body_text())
            }
        })?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| api::json_error(&e))?;
        api::check_fields(&v, ep)?;
        let p = match ep {
            Endpoint::Chat => serde_json::from_value::<ChatRequest>(v)
                .map_err(|e| api::json_error(&e))?
                .parse(&self.limits, &self.tokenizer)?,
            Endpoint::Completion => serde_json::from_value::<CompletionRequest>(v)
                .map_err(|e| api::json_error(&e))?
                .parse(&self.limits, &self.tokenizer)?,
        };
        if let Some(kv) = self.limits.max_kv_tokens
            && p.prompt.len() + 1 > kv
        {
            return Err(ApiError::invalid(format!(
                "the prompt is {} tokens, and the server's KV budget holds {kv}",
                p.prompt.len()
            ))
            .with_code("kv_budget_exceeded"));
        }
        Ok(p)
    }
}

async fn chat(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(app, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(app, headers, body, Endpoint::Completion).await
}

/// One generation request, from the body to the reply.
async fn generate(
    app: Arc<App>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> Response {
    let arrived = Instant::now();
    let run = async {
        let mut namespace = app.auth.authorize(&headers)?;
        // JSON and tokenization of a large body off the async workers.
        let parsing = app.clone();
        let p = tokio::task::spawn_blocking(move || parsing.parse(body, ep))
            .await
            .map_err(|e| ApiError::internal(format!("parsing the request failed: {e}")))??;
        app.reserve()?;
        let (tx, mut rx) = unbounded_channel();
        if let Some(salt) = &p.cache_salt {
            namespace.push('\u{0}');
            namespace.push_str(salt);
        }
        let job = Job {
            prompt: p.prompt.clone(),
            params: p.params.clone(),
            stop: p.stop.clone(),
            namespace,
            user: p.user.clone(),
            events: tx,
            arrived,
            logprobs: p.logprobs,
            echo: p.echo,
            n: p.n,
            index: 0,
        };
        if app.tx.send(Msg::Submit(job)).is_err() {
            app.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::shutting_down());
        }
        let first = match rx.recv().await {
            None if app.shared.closing.load(Ordering::SeqCst) => {
                return Err(ApiError::shutting_down());
            }
            None => return Err(ApiError::internal("the engine loop stopped")),
            Some(Event::Failed(e)) => return Err(e),
            Some(e) => e,
        };
        let id = app.next_id.fetch_add(1, Ordering::Relaxed);
        let meta = Meta {
            id: match ep {
                Endpoint::Chat => format!("chatcmpl-{id}"),
                Endpoint::Completion => format!("cmpl-{id}"),
            },
            created: now_secs(),
            model: app.limits.model_id.clone(),
            endpoint: ep,
            logprobs: p.logprobs.is_some(),
            n: p.n,
        };
        if p.stream {
            Ok(stream_reply(meta, p.include_usage, first, rx).into_response())
        } else {
            whole_reply(meta, first, rx).await
        }
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// The one model this server serves, as OpenAI's model object.
fn model_object(app: &App) -> serde_json::Value {
    json!({
        "id": app.limits.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "kvforge",
        "max_model_len": app.limits.max_ctx,
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = app.auth.authorize(&headers) {
        return e.into_response();
    }
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

/// `GET /v1/models/{id}` (the client's `models.retrieve`; the id may hold
/// slashes, as `org/name` ids do).
async fn model(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if let Err(e) = app.auth.authorize(&headers) {
        return e.into_response();
    }
    if id != app.limits.model_id {
        return ApiError::unknown_model(&id, &app.limits.model_id).into_response();
    }
    axum::Json(model_object(&app)).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.shared.closing.load(Ordering::SeqCst) {
        ApiError::shutting_down().into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let m = lock(&app.shared.metrics).clone();
    let cache = lock(&app.shared.cache).clone();
    let text = match cache {
        Some(mut c) => {
            // The remote tier's counters as they are now, not as the
            // engine loop last published them.
            if let Some(r) = &app.remote {
                c.remote = Some(r.read());
            }
            metrics::render(&m, &c, &app.limits.model_id)
        }
        None => String::new(),
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
