//! `GET /dashboard`: one page that draws the cache live, and
//! `GET /dashboard/stream`, the snapshots it draws (server-sent events,
//! one a second). Like `/metrics`, both ask for no API key (a browser's
//! EventSource sends no headers) and show what an operator sees: the
//! server's totals — bytes per tier, what the policies did, hit rates,
//! latency — and, across tenants, per-request shapes: the running
//! requests' block tables (entry kinds only) and the last requests'
//! lengths and timings; never tokens or keys.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::sse::{Event as Sse, Sse as SseBody};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use super::App;
use crate::sched::lock;

/// The page: plain HTML, canvas and script, nothing fetched from elsewhere.
const PAGE: &str = include_str!("dashboard.html");

/// How often a snapshot goes out.
const EVERY: Duration = Duration::from_secs(1);

pub(super) async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

/// The counters whose growth is drawn as a marker, by the marker's name.
const MARKED: [(&str, &str); 5] = [
    ("eviction", "evicted_entries"),
    ("demotion", "demoted_blocks"),
    ("compaction", "compacted_blocks"),
    ("reclaim", "lifecycle_reclaimed"),
    ("preemption", "preemptions"),
];

/// One snapshot of the server's totals, with what grew since `before`.
fn snapshot(app: &App, before: Option<&Value>) -> Value {
    let m = lock(&app.shared.metrics).clone();
    let cache = lock(&app.shared.cache).clone();
    let sequences = lock(&app.shared.strips).clone();
    let probe = lock(&app.shared.probe).clone();
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut v = json!({
        "t": t,
        "model": app.limits.model_id,
        "serve": {
            "running": m.running,
            "waiting": m.waiting,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generation_tokens,
            "preemptions": m.preemptions,
            "ttft_sum": m.ttft.sum(),
            "ttft_count": m.ttft.count(),
        },
        "cache": cache,
        "sequences": sequences,
        "recent": m.recent,
        "probe": probe,
    });
    let count = |v: &Value, field: &str| -> u64 {
        let c = &v["cache"]["policies"][field];
        c.as_u64()
            .or_else(|| v["serve"][field].as_u64())
            .unwrap_or(0)
    };
    let marks: Vec<Value> = match before {
        None => Vec::new(),
        Some(b) => MARKED
            .iter()
            .filter_map(|&(kind, field)| {
                let grew = count(&v, field).saturating_sub(count(b, field));
                (grew > 0).then(|| json!({"kind": kind, "count": grew, "counter": field}))
            })
            .collect(),
    };
    v["marks"] = Value::Array(marks);
    v
}

/// A dashboard watching: counted while its stream lives, so that the
/// engine loop publishes the block tables only then.
struct Watching(Arc<App>);

impl Watching {
    fn new(app: Arc<App>) -> Watching {
        app.shared.watchers.fetch_add(1, Ordering::SeqCst);
        Watching(app)
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.shared.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) async fn stream(State(app): State<Arc<App>>) -> Response {
    let watching = Watching::new(app);
    let s = stream::unfold((watching, None::<Value>), |(w, before)| async move {
        let app = &w.0;
        if before.is_some() {
            tokio::time::sleep(EVERY).await;
        }
        if app.shared.closing.load(Ordering::SeqCst) {
            return None;
        }
        let now = snapshot(app, before.as_ref());
        let e = Sse::default().event("snapshot").data(now.to_string());
        Some((Ok::<_, Infallible>(e), (w, Some(now))))
    });
    SseBody::new(s).into_response()
}
