//! `GET /v1/kv_events`: a tenant's KV events as server-sent events (the
//! log and its rules: `crate::events`).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as Sse, KeepAlive, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::json;

use super::App;
use crate::error::ApiError;
use crate::events::EventLog;

/// How often a waiting subscriber looks whether the server is stopping.
const WAKE: Duration = Duration::from_secs(1);

struct Sub {
    log: Arc<EventLog>,
    app: Arc<App>,
    tenant: String,
    salt: Option<String>,
    cursor: u64,
    ready: VecDeque<Sse>,
}

impl Sub {
    /// Waits for batches after the cursor; `false` when the server stops.
    async fn fill(&mut self) -> bool {
        loop {
            if self.app.shared.closing.load(Ordering::SeqCst) {
                return false;
            }
            let notified = self.log.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let r = self
                .log
                .read(&self.tenant, self.salt.as_deref(), self.cursor);
            if let Some((from, to)) = r.missed {
                let data = json!({"missed": to - from + 1, "from": from, "to": to});
                self.ready
                    .push_back(Sse::default().event("missed").data(data.to_string()));
            }
            self.cursor = r.upto;
            for b in r.batches {
                let e = Sse::default().id(self.log.id(b.seq)).event("kv");
                self.ready.push_back(e.data(&*b.json));
            }
            if !self.ready.is_empty() {
                return true;
            }
            let _ = tokio::time::timeout(WAKE, notified).await;
        }
    }
}

/// `GET /v1/kv_events[?cache_salt=S]`: the caller's batches of one
/// namespace (its API key's, with that `cache_salt` or none), as SSE.
pub(super) async fn subscribe(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let tenant = match app.auth.authorize(&headers) {
        Ok(ns) => ns,
        Err(e) => return e.into_response(),
    };
    let Some(log) = app.shared.kv_events.clone() else {
        let mut e =
            ApiError::invalid("KV events are off on this server: start it with --kv-events");
        e.status = 404;
        return e.into_response();
    };
    if let Some(k) = q.keys().find(|k| *k != "cache_salt") {
        return ApiError::invalid(format!(
            "unknown query parameter {k:?}; /v1/kv_events takes cache_salt"
        ))
        .into_response();
    }
    let cursor = match headers.get("last-event-id").map(|v| v.to_str()) {
        None => 0,
        Some(Ok(s)) => match log.cursor(s) {
            Ok(n) => n,
            Err(e) => return ApiError::invalid(e).into_response(),
        },
        Some(Err(_)) => {
            return ApiError::invalid("Last-Event-ID must be an id this stream sent")
                .into_response();
        }
    };
    let sub = Sub {
        log,
        app,
        tenant,
        salt: q.get("cache_salt").cloned(),
        cursor,
        ready: VecDeque::new(),
    };
    let s = stream::unfold(sub, |mut sub| async move {
        if sub.ready.is_empty() && !sub.fill().await {
            return None;
        }
        let e = sub.ready.pop_front()?;
        Some((Ok::<_, Infallible>(e), sub))
    });
    SseBody::new(s)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
