//! `kvforge serve`: an OpenAI-compatible HTTP server over the kvforge
//! engine, with continuous batching.
//!
//! * [`http`]: axum routes — `POST /v1/chat/completions`,
//!   `POST /v1/completions`, `GET /v1/models`, `/health`, `/metrics`;
//!   API keys, body limits, request checks, JSON and SSE replies.
//! * [`sched`]: the engine loop on its own thread — admission under a
//!   token budget, chunked prefill, one batched decode per step,
//!   preemption by recompute when the KV budget is full.
//! * [`api`]: the request bodies and their checks; [`error`]: OpenAI-shaped
//!   errors; [`metrics`]: Prometheus text with vLLM's names.
//! * [`client`]: a small blocking HTTP/1.1 client (tests, the load
//!   generator).
//!
//! # Invariants
//!
//! * The HTTP side never runs the model and never waits on the loop; the
//!   loop never waits on a client.
//! * Every request ends with exactly one `Done` or `Failed` event, or its
//!   client is gone; either way its sequence is freed in the step it ends.
//! * Requests of different API keys or `cache_salt`s never share KV: each
//!   pair is its own prefix-index namespace, derived from the key by a
//!   keyed hash (never its position, never the key in clear), the same on
//!   every instance sharing a remote tier; a server without keys has a
//!   namespace of its own.
//! * Nothing on the engine loop waits for the remote tier: a request's
//!   lookup runs on a thread of its own while the request waits.

#![deny(missing_docs)]

pub mod api;
pub mod client;
pub mod error;
pub mod events;
pub mod http;
pub mod metrics;
pub mod remote;
pub mod sched;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvforge_engine::cache::RemoteSetup;
use kvforge_engine::{Engine, ReuseConfig};

pub use api::Limits;
pub use error::ApiError;
pub use sched::{Fault, SchedConfig};

/// How to run a server.
#[derive(Clone)]
pub struct ServerConfig {
    /// The scheduler's knobs.
    pub sched: SchedConfig,
    /// Prefix reuse (on by default: stateless chats resend their history).
    pub reuse: ReuseConfig,
    /// Accepted API keys (empty: none needed); surrounding whitespace is
    /// trimmed, an empty key refused.
    pub api_keys: Vec<String>,
    /// The id `/v1/models` lists.
    pub model_id: String,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// How long a shutdown lets running requests finish.
    pub grace: Duration,
    /// How long a client may take to send a request's headers (and how
    /// long a kept-alive connection may idle before its next request).
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body.
    pub body_timeout: Duration,
    /// A test's hook into sampling (see [`Fault`]).
    pub fault: Option<Fault>,
    /// The coordinator checks all its invariants after every call (tests;
    /// slow).
    pub check_invariants: bool,
    /// A remote tier shared with other instances ([`remote::connect`]).
    pub remote: Option<RemoteSetup>,
    /// KV events on `/v1/kv_events`, each tenant's last this many batches
    /// kept ([`events`]; `None`: off).
    pub kv_events: Option<usize>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            sched: SchedConfig::default(),
            reuse: ReuseConfig::default(),
            api_keys: Vec::new(),
            model_id: "kvforge".into(),
            max_body_bytes: 4 << 20,
            default_max_tokens: 512,
            grace: sched::DEFAULT_GRACE,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            fault: None,
            check_invariants: false,
            remote: None,
            kv_events: None,
        }
    }
}

/// The KV events' log, its sink on the engine's prefix index, when
/// `--kv-events` asks for them.
fn watch_index(
    engine: &Engine,
    cfg: &ServerConfig,
) -> Result<Option<Arc<events::EventLog>>, String> {
    let Some(cap) = cfg.kv_events else {
        return Ok(None);
    };
    if cap == 0 {
        return Err("--kv-events-buffer must be at least 1".into());
    }
    if cfg.api_keys.is_empty() {
        return Err("--kv-events needs --api-key: the events carry the token ids of the prompts they store, and a server without keys serves every caller as one tenant".into());
    }
    let log = events::EventLog::new(cap);
    let sink = Box::new(events::LogSink(log.clone()));
    engine
        .cache()
        .with_coordinator(|c| c.watch_index(sink, 0))
        .map_err(|e| format!("--kv-events: {e}"))?;
    Ok(Some(log))
}

/// A running engine loop and the routes in front of it.
pub struct Server {
    app: Arc<http::App>,
    tx: mpsc::Sender<Msg>,
    grace: Duration,
    header_timeout: Duration,
    engine_loop: JoinHandle<()>,
}

use sched::Msg;

impl Server {
    /// Configures `engine`'s cache for reuse and starts the engine loop.
    pub fn start(mut engine: Engine, cfg: ServerConfig) -> Result<Self, String> {
        if cfg.sched.max_batch == 0
            || cfg.sched.max_step_tokens == 0
            || cfg.sched.max_waiting == 0
            || cfg.default_max_tokens == 0
        {
            return Err(
                "--max-batch, --max-step-tokens, --max-waiting and --default-max-tokens must be at least 1"
                    .into(),
            );
        }
        if cfg.header_timeout.is_zero() || cfg.body_timeout.is_zero() {
            return Err("--header-timeout-secs and --body-timeout-secs must be positive".into());
        }
        cfg.reuse
            .apply(engine.cache_mut())
            .map_err(|e| e.to_string())?;
        engine
            .cache_mut()
            .set_remote(cfg.remote.clone())
            .map_err(|e| e.to_string())?;
        engine.cache().check_every_call(cfg.check_invariants);
        let kv_events = watch_index(&engine, &cfg)?;
        let stats = engine.cache().stats();
        let hot = stats.tiers.first().map(|t| t.pool);
        let max_kv_tokens = (engine.cache().grows_only_hot())
            .then(|| {
                hot.map(|h| {
                    let by_budget = stats.budget_bytes / h.block_bytes.max(1);
                    (h.max_blocks as u64).min(by_budget) as usize * stats.block_size
                })
            })
            .flatten();
        let limits = Limits {
            model_id: cfg.model_id.clone(),
            max_ctx: engine.model_config().max_ctx,
            vocab: engine.model_config().vocab,
            default_max_tokens: cfg.default_max_tokens,
            max_kv_tokens,
        };
        let tokenizer = engine.tokenizer().clone();
        // Tenants' namespaces are keyed by the remote tier's secret, so
        // they agree across the instances sharing it; without one, by a
        // secret of this process's own.
        let secret = cfg
            .remote
            .as_ref()
            .map_or_else(kvforge_remote::Secret::random, |r| r.secret.clone());
        let auth = http::Auth::new(&cfg.api_keys, secret)?;
        let remote = engine.cache().remote_stats_source();
        let shared = Arc::new(sched::Shared {
            kv_events,
            ..sched::Shared::default()
        });
        // The cache's reading from the start, so that `/metrics` and the
        // dashboard never answer before the loop's first publish.
        *sched::lock(&shared.cache) = Some(engine.cache().stats());
        if let Some(p) = &cfg.sched.probe {
            p.check()?;
            sched::lock(&shared.probe).full_cache = Some(p.full_cache(&engine)?);
        }
        let (tx, rx) = mpsc::channel();
        let sched = sched::Scheduler::new(
            Arc::new(engine),
            cfg.sched.clone(),
            shared.clone(),
            cfg.fault.clone(),
        );
        let engine_loop = std::thread::Builder::new()
            .name("kvforge-engine".into())
            .spawn(move || sched.run(rx))
            .map_err(|e| format!("cannot start the engine loop: {e}"))?;
        let app = Arc::new(http::App::new(
            limits,
            tokenizer,
            auth,
            remote,
            cfg.max_body_bytes,
            cfg.body_timeout,
            cfg.sched.max_waiting,
            tx.clone(),
            shared,
        ));
        Ok(Server {
            app,
            tx,
            grace: cfg.grace,
            header_timeout: cfg.header_timeout,
            engine_loop,
        })
    }

    /// The routes (for a caller that serves them itself).
    pub fn router(&self) -> axum::Router {
        http::router(self.app.clone())
    }

    /// What the loop and the routes share (counters, the queue).
    pub fn shared(&self) -> Arc<sched::Shared> {
        self.app.shared.clone()
    }

    /// Serves on `listener` until `shutdown` resolves; then answers new
    /// requests with 503 (the listener stays open, so a client sees the
    /// refusal rather than a closed port), lets running ones finish for
    /// the grace period, cancels the rest, and returns once the engine
    /// loop has stopped and the last replies were sent (a client that
    /// stops reading is given a few seconds, no more).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Server {
            app,
            tx,
            grace,
            header_timeout,
            engine_loop,
        } = self;
        let conns = http::Connections::new(http::router(app.clone()), header_timeout);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = conns.accept(&listener) => {}
                () = &mut shutdown => break,
            }
        }
        app.shared.closing.store(true, Ordering::SeqCst);
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let deadline = Instant::now().checked_add(grace).unwrap_or(far);
        let _ = tx.send(Msg::Shutdown(deadline));
        drop(tx);
        let joined = tokio::task::spawn_blocking(move || engine_loop.join());
        tokio::pin!(joined);
        let bound = tokio::time::sleep(grace.saturating_add(Duration::from_secs(5)));
        tokio::pin!(bound);
        // Stopping: still accepting, so that new requests get their 503.
        let joined = loop {
            tokio::select! {
                () = conns.accept(&listener) => {}
                j = &mut joined => break Some(j),
                () = &mut bound => break None,
            }
        };
        drop(listener);
        conns.close(Duration::from_secs(5)).await;
        drop(app);
        match joined {
            Some(Ok(Ok(()))) | None => Ok(()),
            Some(Ok(Err(_))) => Err(std::io::Error::other("the engine loop panicked")),
            Some(Err(e)) => Err(std::io::Error::other(e)),
        }
    }
}
