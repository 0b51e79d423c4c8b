//! Real clients replaying conversations: every turn resends the whole
//! history (as OpenAI-style clients do), streams the reply, and appends
//! it; so reuse can only come from the server's prefix cache.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvforge_server::client;
use serde_json::{Value, json};

/// What one turn measured.
#[derive(Clone, Debug, Default)]
pub struct Turn {
    /// Seconds from sending to the first content.
    pub ttft: f64,
    /// Seconds between consecutive content chunks.
    pub itl: Vec<f64>,
    /// Tokens generated (the usage's, else the content chunks).
    pub tokens: usize,
    /// Prompt tokens (0 when the server did not say).
    pub prompt_tokens: usize,
    /// Of those, found in the prefix cache.
    pub cached_tokens: usize,
    /// The reply.
    pub text: String,
    /// Why the turn failed, if it did.
    pub error: Option<String>,
    /// The client hung up on purpose mid-stream.
    pub disconnected: bool,
}

/// How the clients behave.
#[derive(Clone, Debug)]
pub struct Load {
    /// Tokens per reply at most.
    pub max_tokens: usize,
    /// Generate `max_tokens` whatever the model says (off: replies end at
    /// the model's end of turn, as a real client's do).
    pub ignore_eos: bool,
    /// Hang up after this many chunks (the soak's leaving clients).
    pub disconnect_after: Option<usize>,
}

fn fail(t: &mut Turn, e: impl std::fmt::Display) -> Turn {
    t.error = Some(e.to_string());
    std::mem::take(t)
}

/// One streamed chat turn over `messages`.
pub fn turn(addr: &str, model: &str, messages: &[Value], load: &Load) -> Turn {
    let body = json!({
        "model": model,
        "messages": messages,
        "max_tokens": load.max_tokens,
        "temperature": 0,
        "ignore_eos": load.ignore_eos,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut t = Turn::default();
    let start = Instant::now();
    let r = match client::post_json(
        addr,
        "/v1/chat/completions",
        &[],
        &body,
        Duration::from_secs(600),
    ) {
        Ok(r) => r,
        Err(e) => return fail(&mut t, e),
    };
    if r.status != 200 {
        let status = r.status;
        let text = r
            .bytes()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        return fail(
            &mut t,
            format!(
                "HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ),
        );
    }
    let mut last: Option<Instant> = None;
    let mut chunks = 0;
    let mut events = r.events();
    for ev in events.by_ref() {
        let ev = match ev {
            Ok(e) => e,
            Err(e) => return fail(&mut t, e),
        };
        if ev == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(&ev) else {
            return fail(&mut t, format!("not JSON: {ev}"));
        };
        if let Some(e) = v.get("error") {
            return fail(&mut t, e);
        }
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !content.is_empty() {
            let now = Instant::now();
            match last {
                None => t.ttft = (now - start).as_secs_f64(),
                Some(l) => t.itl.push((now - l).as_secs_f64()),
            }
            last = Some(now);
            chunks += 1;
            t.text.push_str(content);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            t.tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            t.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            t.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as usize;
        }
        // llama-server reports its prompt cache in `timings`.
        if let Some(tm) = v.get("timings") {
            if let (Some(n), Some(p)) = (tm["cache_n"].as_u64(), tm["prompt_n"].as_u64()) {
                t.cached_tokens = n as usize;
                t.prompt_tokens = (n + p) as usize;
            }
        }
        if load.disconnect_after.is_some_and(|n| chunks >= n) {
            t.disconnected = true;
            events.close();
            return t;
        }
    }
    if t.tokens == 0 {
        t.tokens = chunks;
    }
    if last.is_none() {
        return fail(&mut t, "no content");
    }
    t
}

/// Plays `convs` on `concurrency` clients (each takes the next
/// conversation when its last one ends); every turn of every conversation,
/// in order. `leave(i)`: whether conversation `i`'s client hangs up
/// mid-stream on its last turn.
pub fn replay(
    addr: &str,
    model: &str,
    convs: &[Vec<String>],
    concurrency: usize,
    load: &Load,
    leave: &(dyn Fn(usize) -> bool + Sync),
) -> Vec<Vec<Turn>> {
    let queue = Mutex::new((0..convs.len()).collect::<VecDeque<_>>());
    let out = Mutex::new(vec![Vec::new(); convs.len()]);
    std::thread::scope(|s| {
        for _ in 0..concurrency.max(1) {
            s.spawn(|| {
                while let Some(i) = next(&queue) {
                    let turns = conversation(addr, model, &convs[i], load, leave(i));
                    if let Ok(mut o) = out.lock() {
                        o[i] = turns;
                    }
                }
            });
        }
    });
    out.into_inner().unwrap_or_default()
}

/// The next conversation to play (the lock is released before it plays).
fn next(queue: &Mutex<VecDeque<usize>>) -> Option<usize> {
    queue.lock().ok().and_then(|mut q| q.pop_front())
}

fn conversation(addr: &str, model: &str, conv: &[String], load: &Load, leave: bool) -> Vec<Turn> {
    let mut messages: Vec<Value> = Vec::new();
    let mut turns = Vec::new();
    for (k, user) in conv.iter().enumerate() {
        messages.push(json!({"role": "user", "content": user}));
        let mut l = load.clone();
        if !(leave && k + 1 == conv.len()) {
            l.disconnect_after = None;
        }
        let t = turn(addr, model, &messages, &l);
        let failed = t.error.is_some();
        messages.push(json!({"role": "assistant", "content": t.text}));
        turns.push(t);
        if failed {
            break;
        }
    }
    turns
}

/// The `q` quantile (0..=1) of `xs` (nearest rank); NaN when empty.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
