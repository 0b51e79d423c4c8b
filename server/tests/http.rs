//! The server over HTTP on a loopback port: replies, streaming, prefix
//! reuse and its namespaces, and every error path with OpenAI's error
//! shape. A tiny random-weight model keeps each test to seconds.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{MODEL, TestServer, chat, error_of, metric, tiny_engine};
use kvforge_engine::EngineConfig;
use kvforge_server::ServerConfig;
use kvforge_server::client;
use kvforge_server::sched::SchedConfig;
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["message"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .unwrap()
        .to_string()
}

#[test]
fn chat_replies_and_a_repeated_prefix_is_reused_within_its_namespace_only() {
    let s = TestServer::tiny(ServerConfig::default());
    let long = "Tell me about the history of the city and its old harbour, in detail.";
    let a = s.post(CHAT, &chat(long, 12)).json().unwrap();
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["model"], MODEL);
    let u = &a["usage"];
    assert_eq!(u["completion_tokens"], 12);
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0, "{a}");
    let prompt = u["prompt_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"].as_u64().unwrap(), prompt + 12);
    // The same prompt again: its full blocks come from the prefix cache.
    let b = s.post(CHAT, &chat(long, 12)).json().unwrap();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached < prompt, "{b}");
    // Another cache_salt is another namespace: nothing shared.
    let mut salted = chat(long, 12);
    salted["cache_salt"] = json!("tenant-b");
    let c = s.post(CHAT, &salted).json().unwrap();
    assert_eq!(
        c["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{c}"
    );
    let d = s.post(CHAT, &salted).json().unwrap();
    assert!(
        d["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // Greedy, same namespace path: the same text.
    assert_eq!(text_of(&c), text_of(&a));
    let m = s.metrics();
    assert!(metric(&m, "kvforge:prefix_cache_hits_total") >= (2 * cached) as f64);
    assert_eq!(
        metric(&m, "kvforge:prefix_cache_queries_total"),
        (4 * prompt) as f64
    );
    assert_eq!(metric(&m, "kvforge:generation_tokens_total"), 48.0);
}

#[test]
fn api_keys_are_checked_and_each_key_is_its_own_namespace() {
    let s = TestServer::tiny(ServerConfig {
        api_keys: vec!["k1".into(), "k2".into()],
        ..ServerConfig::default()
    });
    let body = chat(
        "A question that is long enough to fill a few blocks of KV.",
        4,
    );
    let (msg, _, code) = error_of(s.post(CHAT, &body), 401);
    assert!(msg.contains("Authorization"), "{msg}");
    assert_eq!(code.as_deref(), Some("invalid_api_key"));
    let (_, _, code) = error_of(
        s.post_with(CHAT, &[("Authorization", "Bearer nope")], &body),
        401,
    );
    assert_eq!(code.as_deref(), Some("invalid_api_key"));
    assert_eq!(s.get("/v1/models").status, 401);
    assert_eq!(s.get("/health").status, 200);
    let k1 = [("Authorization", "Bearer k1")];
    let k2 = [("Authorization", "Bearer k2")];
    let cached = |h: &[(&str, &str)]| {
        let v = s.post_with(CHAT, h, &body).json().unwrap();
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached(&k1), 0);
    assert!(cached(&k1) > 0);
    assert_eq!(cached(&k2), 0, "another key never sees k1's KV");
    assert!(cached(&k2) > 0);
    // Lowercase `bearer` is the same scheme (RFC 9110: case-insensitive).
    assert!(cached(&[("Authorization", "bearer k1")]) > 0);
}

/// Keys are trimmed at start, and an empty one or one with whitespace
/// inside is refused with one line.
#[test]
fn keys_are_trimmed_and_bad_ones_refused_at_start() {
    for (keys, words) in [
        (vec!["k1", "  "], "key 2 of 2 is empty"),
        (vec!["k 1"], "whitespace"),
        (vec!["k1\u{7}"], "control"),
    ] {
        let cfg = ServerConfig {
            api_keys: keys.iter().map(|k| k.to_string()).collect(),
            ..ServerConfig::default()
        };
        let e = kvforge_server::Server::start(tiny_engine(&EngineConfig::default(), 256), cfg)
            .err()
            .unwrap_or_default();
        assert!(e.contains(words) && !e.contains('\n'), "{keys:?}: {e}");
    }
    let s = TestServer::tiny(ServerConfig {
        api_keys: vec![" k1 ".into(), "k2\n".into()],
        ..ServerConfig::default()
    });
    for k in ["k1", "k2"] {
        let h = format!("Bearer {k}");
        assert_eq!(
            s.raw("GET", "/v1/models", &[("Authorization", &h)], b"")
                .status,
            200,
            "{k}"
        );
    }
}

/// S8: a client that never finishes its headers is dropped after the
/// header timeout, one that never sends its body gets 408 after the body
/// timeout; the server answers others all along.
#[test]
fn slow_clients_are_timed_out_and_others_are_served() {
    use std::io::{Read, Write};
    let s = TestServer::tiny(ServerConfig {
        header_timeout: Duration::from_millis(800),
        body_timeout: Duration::from_millis(800),
        ..ServerConfig::default()
    });
    let open = |bytes: &[u8]| {
        let mut c = std::net::TcpStream::connect(&s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
        c.write_all(bytes).unwrap();
        c
    };
    let slow: Vec<_> = (0..40)
        .map(|_| open(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-"))
        .collect();
    let mut bodiless =
        open(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo");
    assert_eq!(s.get("/health").status, 200, "served while they hang");
    let t0 = std::time::Instant::now();
    for mut c in slow {
        let mut buf = [0u8; 256];
        // The server closes the connection (EOF, or a reset) or answers
        // an error; a read that times out means it kept it open.
        let n = match c.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Err(e) => panic!("still open after {:?}: {e}", t0.elapsed()),
        };
        let head = String::from_utf8_lossy(&buf[..n]).to_string();
        assert!(n == 0 || head.starts_with("HTTP/1.1 408"), "{head}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let mut reply = String::new();
    let _ = bodiless.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("request_timeout"), "{reply}");
    assert_eq!(s.post(CHAT, &chat("still here", 2)).status, 200);
}

/// S9: a prompt far over the context is refused as such before it is
/// encoded whole, for chats and completions alike.
#[test]
fn a_prompt_of_megabytes_is_refused_as_over_the_context() {
    let s = TestServer::start(
        tiny_engine(&EngineConfig::default(), 512),
        ServerConfig {
            max_body_bytes: 8 << 20,
            ..ServerConfig::default()
        },
    );
    let huge = "many words in a row ".repeat(200_000);
    let (msg, param, code) = error_of(s.post(CHAT, &chat(&huge, 4)), 400);
    assert_eq!(code.as_deref(), Some("context_length_exceeded"), "{msg}");
    assert_eq!(param.as_deref(), Some("messages"));
    assert!(msg.contains("over 511 tokens"), "{msg}");
    let body = json!({"model": MODEL, "prompt": huge, "max_tokens": 2});
    let (msg, param, code) = error_of(s.post(COMPLETIONS, &body), 400);
    assert_eq!(code.as_deref(), Some("context_length_exceeded"), "{msg}");
    assert_eq!(param.as_deref(), Some("prompt"));
    // Just over the context, counted exactly.
    let (msg, _, _) = error_of(s.post(CHAT, &chat(&"word ".repeat(600), 4)), 400);
    assert!(msg.contains("context"), "{msg}");
    assert_eq!(s.post(CHAT, &chat("short", 2)).status, 200);
}

#[test]
fn streaming_sends_chunks_the_finish_reason_usage_and_done() {
    let s = TestServer::tiny(ServerConfig::default());
    let mut body = chat("Stream a reply, please.", 10);
    let whole = text_of(&s.post(CHAT, &body).json().unwrap());
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["cache_salt"] = json!("fresh"); // the same computation as the first
    let r = s.post(CHAT, &body);
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events: Vec<String> = r.events().map(Result::unwrap).collect();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(text, whole, "the stream's pieces make the whole reply");
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    assert!(chunks[0]["usage"].is_null() && chunks[0].get("usage").is_some());
}

#[test]
fn completions_take_text_or_token_ids_and_stop_strings_end_the_reply() {
    let s = TestServer::tiny(ServerConfig::default());
    let ask = |prompt: Value, extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        s.post(COMPLETIONS, &b).json().unwrap()
    };
    let a = ask(json!("Once upon a time"), json!({"cache_salt": "a"}));
    assert_eq!(a["object"], "text_completion");
    let text = text_of(&a);
    let ids = json!([19842, 2462, 253, 655]);
    let b = ask(ids, json!({}));
    assert_eq!(b["usage"]["prompt_tokens"], 4);
    // A stop string taken from the middle of the reply ends it there.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "{text:?}");
    let stop: String = chars[4..7].iter().collect();
    let at = text.find(&stop).unwrap();
    let c = ask(
        json!("Once upon a time"),
        json!({"cache_salt": "b", "stop": [stop]}),
    );
    assert_eq!(text_of(&c), text[..at]);
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    // Streamed with a stop string: the same text.
    let r = s.post(
        COMPLETIONS,
        &json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                "cache_salt": "c", "stop": stop, "stream": true}),
    );
    let mut streamed = String::new();
    for e in r.events() {
        let e = e.unwrap();
        if e == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        streamed.push_str(v["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(streamed, text[..at]);
}

#[test]
fn bad_requests_get_a_400_in_openais_shape_naming_the_field() {
    let s = TestServer::tiny(ServerConfig::default());
    let r = s.raw("POST", CHAT, &[], b"{\"model\": ");
    let (msg, _, _) = error_of(r, 400);
    assert!(msg.starts_with("malformed JSON"), "{msg}");
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!([1, 2]), "", "JSON object"),
        (json!({"model": MODEL}), "messages", "missing field"),
        (
            json!({"model": MODEL, "messages": [], "max_tokens": 3}),
            "messages",
            "at least one",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
            "temperature",
            "temperature must be a number, got a string",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}),
            "temperature",
            "between 0 and 2",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
            "top_p",
            "top_p",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}),
            "n",
            "n must be between 1 and 16",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
            "max_tokens",
            "at least 1",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": []}),
            "tools",
            "tools is not supported",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}),
            "response_format",
            "not supported",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool": []}),
            "tool",
            "unrecognized request argument",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 1.5}),
            "seed",
            "seed must be a signed 64-bit integer, got a number with a fraction or exponent",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
            "max_tokens",
            "max_tokens must be a non-negative integer, got a negative integer",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
            "stream",
            "must be a boolean",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "store": true}),
            "store",
            "not supported",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
            "not supported",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "string",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}),
            "stop[0]",
            "strings",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}),
            "stop",
            "at most 4",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}),
            "stream_options",
            "stream: true",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1}),
            "presence_penalty",
            "not supported",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
            "top_logprobs",
            "needs logprobs",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "at most 20",
        ),
    ];
    for (body, param, words) in cases {
        let (msg, p, _) = error_of(s.post(CHAT, &body), 400);
        assert!(msg.contains(words), "{body}: {msg}");
        if !param.is_empty() {
            assert_eq!(p.as_deref(), Some(param), "{body}: {msg}");
        }
    }
    let comp: Vec<(Value, &str)> = vec![
        (json!({"model": MODEL, "prompt": ["a", "b"]}), "prompt"),
        (
            json!({"model": MODEL, "prompt": [1, 99999999]}),
            "prompt[1]",
        ),
        (json!({"model": MODEL, "prompt": ""}), "prompt"),
        (
            json!({"model": MODEL, "prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "echo": true, "n": 2}),
            "echo",
        ),
        (json!({"model": MODEL, "prompt": {"a": 1}}), "prompt"),
        // Chat's field on completions: unknown there, not mistyped.
        (
            json!({"model": MODEL, "prompt": "x", "messages": 5}),
            "messages",
        ),
    ];
    for (body, param) in comp {
        let (msg, p, _) = error_of(s.post(COMPLETIONS, &body), 400);
        assert_eq!(p.as_deref(), Some(param), "{body}: {msg}");
    }
    // Longer than the model's context.
    let long = "word ".repeat(5000);
    let (msg, _, code) = error_of(s.post(CHAT, &chat(&long, 4)), 400);
    assert_eq!(code.as_deref(), Some("context_length_exceeded"), "{msg}");
    // Unknown model: 404 model_not_found, as OpenAI and vLLM answer.
    let mut b = chat("hi", 2);
    b["model"] = json!("gpt-5");
    let (msg, p, code) = error_of(s.post(CHAT, &b), 404);
    assert!(msg.contains("gpt-5") && msg.contains(MODEL), "{msg}");
    assert_eq!(
        (p.as_deref(), code.as_deref()),
        (Some("model"), Some("model_not_found"))
    );
    // No such endpoint.
    error_of(s.get("/v1/embeddings"), 404);
    // After all of it the server still answers.
    assert_eq!(s.post(CHAT, &chat("hi", 2)).status, 200);
    s.until("the running gauge to fall to 0", |s| {
        metric(&s.metrics(), "kvforge:num_requests_running") == 0.0
    });
}

#[test]
fn a_prompt_over_the_kv_budget_is_refused_and_a_body_over_the_limit_is_413() {
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 64,
        ..EngineConfig::default()
    };
    let s = TestServer::start(
        tiny_engine(&cfg, 1024),
        ServerConfig {
            max_body_bytes: 2000,
            ..ServerConfig::default()
        },
    );
    let (msg, _, code) = error_of(s.post(CHAT, &chat(&"word ".repeat(100), 4)), 400);
    assert_eq!(code.as_deref(), Some("kv_budget_exceeded"), "{msg}");
    let (msg, _, code) = error_of(s.post(CHAT, &chat(&"x".repeat(3000), 4)), 413);
    assert!(msg.contains("2000"), "{msg}");
    assert_eq!(code.as_deref(), Some("request_too_large"));
    assert_eq!(s.post(CHAT, &chat("short", 4)).status, 200);
}

fn endless(salt: &str) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Go on forever."}],
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "cache_salt": salt,
    })
}

#[test]
fn a_full_queue_gets_429_with_retry_after_and_a_gone_client_frees_its_blocks() {
    let s = TestServer::tiny(ServerConfig {
        sched: SchedConfig {
            max_batch: 1,
            max_waiting: 1,
            ..SchedConfig::default()
        },
        ..ServerConfig::default()
    });
    // One running (its first token seen), one waiting behind it.
    let mut first = s.post(CHAT, &endless("a")).events();
    first.next().unwrap().unwrap();
    let addr = s.addr.clone();
    let waiter = std::thread::spawn(move || {
        client::post_json(&addr, CHAT, &[], &chat("Then me.", 3), common::TIMEOUT)
            .unwrap()
            .json()
            .unwrap()
    });
    s.until("the second request to wait", |s| {
        s.shared.queued.load(std::sync::atomic::Ordering::SeqCst) == 1
    });
    let r = s.post(CHAT, &chat("And me.", 3));
    assert_eq!(r.header("retry-after"), Some("1"));
    let (_, _, code) = error_of(r, 429);
    assert_eq!(code.as_deref(), Some("queue_full"));
    // The running client goes away mid-stream: its sequence ends, and the
    // waiting request runs.
    first.close();
    let second = waiter.join().unwrap();
    assert_eq!(second["usage"]["completion_tokens"], 3, "{second}");
    s.until("the hot blocks to come back", |s| {
        let m = s.metrics();
        metric(&m, "kvforge:kv_blocks_in_use") == 0.0
            && metric(&m, "kvforge:num_requests_running") == 0.0
    });
    assert_eq!(metric(&s.metrics(), "kvforge:request_aborted_total"), 1.0);
}

#[test]
fn a_disconnect_mid_stream_returns_the_blocks_within_a_step_or_two() {
    let s = TestServer::tiny(ServerConfig::default());
    let mut ev = s.post(CHAT, &endless("d")).events();
    for _ in 0..3 {
        ev.next().unwrap().unwrap();
    }
    let steps_before = metric(&s.metrics(), "kvforge:engine_steps_total");
    ev.close();
    s.until("the aborted request's blocks", |s| {
        metric(&s.metrics(), "kvforge:kv_blocks_in_use") == 0.0
    });
    let m = s.metrics();
    assert_eq!(metric(&m, "kvforge:request_aborted_total"), 1.0);
    // How soon the loop learns of it depends on when a write finds the
    // socket closed (the step after that frees it: sched's own test); here,
    // long before the request would have ended.
    let steps = metric(&m, "kvforge:engine_steps_total") - steps_before;
    assert!(steps < 300.0, "{steps} steps after the disconnect");
    assert!(metric(&m, "kvforge:generation_tokens_total") < 4000.0);
}

#[test]
fn a_panic_in_one_request_fails_that_request_only() {
    let fault: kvforge_server::Fault = Arc::new(|user: Option<&str>| {
        if user == Some("boom") {
            panic!("injected fault");
        }
    });
    let s = TestServer::tiny(ServerConfig {
        fault: Some(fault),
        ..ServerConfig::default()
    });
    let mut ok = s.post(CHAT, &endless("ok")).events();
    ok.next().unwrap().unwrap();
    let mut bad = chat("Explode.", 5);
    bad["user"] = json!("boom");
    let (msg, _, _) = error_of(s.post(CHAT, &bad), 500);
    assert!(msg.contains("injected fault"), "{msg}");
    // The other stream goes on.
    for _ in 0..5 {
        let e = ok.next().unwrap().unwrap();
        assert!(e.contains("chat.completion.chunk"), "{e}");
    }
    ok.close();
    let v = s.post(CHAT, &chat("Still there?", 3)).json().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(metric(&s.metrics(), "kvforge:request_failed_total"), 1.0);
}

#[test]
fn requests_over_the_budget_together_are_preempted_and_all_complete() {
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 96,
        ..EngineConfig::default()
    };
    let s = TestServer::start(
        tiny_engine(&cfg, 1024),
        ServerConfig {
            sched: SchedConfig {
                max_batch: 6,
                max_step_tokens: 16,
                ..SchedConfig::default()
            },
            ..ServerConfig::default()
        },
    );
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let addr = s.addr.clone();
            std::thread::spawn(move || {
                let mut b = chat(&format!("Request number {i} here."), 40);
                b["ignore_eos"] = json!(true);
                client::post_json(&addr, CHAT, &[], &b, common::TIMEOUT)
                    .unwrap()
                    .json()
                    .unwrap()
            })
        })
        .collect();
    for t in threads {
        let v: Value = t.join().unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    let m = s.metrics();
    assert!(metric(&m, "kvforge:num_preemptions_total") > 0.0, "{m}");
    // The gauges are published after the step that sent the last reply.
    s.until("the blocks to come back", |s| {
        metric(&s.metrics(), "kvforge:kv_blocks_in_use") == 0.0
    });
}

#[test]
fn metrics_have_vllms_names_counters_and_histograms() {
    let s = TestServer::tiny(ServerConfig::default());
    s.post(CHAT, &chat("Count me.", 5));
    let m = s.metrics();
    for name in [
        "kvforge:num_requests_running",
        "kvforge:num_requests_waiting",
        "kvforge:kv_cache_usage_perc",
        "kvforge:prefix_cache_queries_total",
        "kvforge:prefix_cache_hits_total",
        "kvforge:prompt_tokens_total",
        "kvforge:generation_tokens_total",
        "kvforge:evicted_entries_total",
        "kvforge:demoted_blocks_total",
        "kvforge:shared_blocks_total",
        "kvforge:lifecycle_dropped_entries_total",
    ] {
        metric(&m, name);
    }
    for h in [
        "kvforge:time_to_first_token_seconds",
        "kvforge:inter_token_latency_seconds",
        "kvforge:e2e_request_latency_seconds",
    ] {
        assert!(m.contains(&format!("# TYPE {h} histogram")), "{h}");
        let inf = format!("{h}_bucket{{model_name=\"{MODEL}\",le=\"+Inf\"}}");
        assert!(m.contains(&inf), "{h}");
        metric(&m, &format!("{h}_count"));
    }
    assert_eq!(metric(&m, "kvforge:time_to_first_token_seconds_count"), 1.0);
    assert_eq!(metric(&m, "kvforge:inter_token_latency_seconds_count"), 4.0);
    assert_eq!(metric(&m, "kvforge:generation_tokens_total"), 5.0);
    // Every row names the model, as vLLM's do (dashboards filter on it).
    for row in m.lines().filter(|l| !l.starts_with('#')) {
        assert!(row.contains(&format!("{{model_name=\"{MODEL}\"")), "{row}");
    }
    for line in m
        .lines()
        .filter(|l| l.starts_with("# TYPE") && l.ends_with("counter"))
    {
        assert!(
            line.split(' ').nth(2).unwrap().ends_with("_total"),
            "{line}"
        );
    }
    let models = s.get("/v1/models").json().unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
}

#[test]
fn stopping_lets_running_requests_finish_and_refuses_new_ones() {
    let s = TestServer::tiny(ServerConfig {
        grace: Duration::from_secs(30),
        ..ServerConfig::default()
    });
    let addr = s.addr.clone();
    let mut body = endless("s");
    body["max_tokens"] = json!(60);
    let mut ev = s.post(CHAT, &body).events();
    ev.next().unwrap().unwrap();
    let shared = s.shared.clone();
    let stopper = std::thread::spawn(move || s.stop());
    while !shared.closing.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // New requests are refused with a 503 (the listener stays open).
    let r = client::post_json(&addr, CHAT, &[], &chat("late", 2), common::TIMEOUT).unwrap();
    let (_, _, code) = error_of(r, 503);
    assert_eq!(code.as_deref(), Some("shutting_down"));
    let rest: Vec<String> = ev.map(Result::unwrap).collect();
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    stopper.join().unwrap().unwrap();
}

#[test]
fn without_a_seed_two_sampled_replies_differ_and_with_one_they_repeat() {
    let s = TestServer::tiny(ServerConfig::default());
    // Each request in its own namespace: the same computation from scratch.
    let n = std::sync::atomic::AtomicU32::new(0);
    let ask = |seed: Option<u64>| {
        let mut b = chat("Say anything.", 12);
        b["temperature"] = json!(1.0);
        b["cache_salt"] = json!(format!(
            "seed-{}",
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        if let Some(x) = seed {
            b["seed"] = json!(x);
        }
        text_of(&s.post(CHAT, &b).json().unwrap())
    };
    assert_ne!(
        ask(None),
        ask(None),
        "a fresh seed per request, as OpenAI samples"
    );
    assert_eq!(ask(Some(5)), ask(Some(5)));
}

/// What harnesses and SDKs send: `null` for every field they do not use,
/// signed seeds, `models.retrieve`; and a wrong method gets OpenAI's
/// error shape.
#[test]
fn nulls_signed_seeds_model_retrieval_and_405s_as_openai_answers() {
    let s = TestServer::tiny(ServerConfig::default());
    let mut body = chat("hi", 2);
    for key in [
        "tools",
        "tool_choice",
        "response_format",
        "logit_bias",
        "top_logprobs",
        "functions",
        "stop",
        "user",
        "n",
        "logprobs",
        "temperature",
        "stream_options",
    ] {
        body[key] = Value::Null;
    }
    body["seed"] = json!(-1);
    // Values of unimplemented fields that ask for nothing.
    body["store"] = json!(false);
    body["parallel_tool_calls"] = json!(true);
    body["metadata"] = json!({});
    body["response_format"] = json!({"type": "text"});
    body["service_tier"] = json!("auto");
    let r = s.post(CHAT, &body);
    let status = r.status;
    let reply = String::from_utf8_lossy(&r.bytes().unwrap()).to_string();
    assert_eq!(status, 200, "{reply}");
    // Signed seeds repeat as unsigned ones do (different salts: both
    // replies computed afresh).
    let mut a = chat("Tell me a story", 6);
    a["seed"] = json!(-7);
    a["temperature"] = json!(1.0);
    let mut text = |salt: &str| {
        a["cache_salt"] = json!(salt);
        s.post(CHAT, &a).json().unwrap()["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(text("a"), text("b"));
    let mut c = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": i64::MIN});
    c["suffix"] = Value::Null;
    c["response_format"] = Value::Null;
    assert_eq!(s.post(COMPLETIONS, &c).status, 200);
    // Prompt + max_tokens past the context (4096 here): 400, as OpenAI and
    // vLLM answer; no max_tokens: the reply may run to the context.
    for (path, body) in [
        (CHAT, chat("hi", 4096)),
        (
            COMPLETIONS,
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 4096}),
        ),
        (
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": u64::MAX}),
        ),
    ] {
        let (msg, _, code) = error_of(s.post(path, &body), 400);
        assert_eq!(code.as_deref(), Some("context_length_exceeded"), "{msg}");
        assert!(msg.contains("context is 4096 tokens"), "{msg}");
    }
    // models.retrieve: the served model, or 404 model_not_found.
    let m = s.get(&format!("/v1/models/{MODEL}"));
    assert_eq!(m.status, 200);
    let v = m.json().unwrap();
    assert_eq!(v["id"], MODEL);
    assert_eq!(v["object"], "model");
    for other in ["/v1/models/gpt-4o", "/v1/models/org/tiny"] {
        let (msg, _, code) = error_of(s.get(other), 404);
        assert_eq!(code.as_deref(), Some("model_not_found"), "{other}: {msg}");
    }
    // A wrong method: 405 with a JSON error, not an empty body.
    for (method, path) in [
        ("GET", CHAT),
        ("POST", "/v1/models"),
        ("DELETE", COMPLETIONS),
    ] {
        let (msg, _, _) = error_of(s.raw(method, path, &[], b""), 405);
        assert!(msg.contains(method) && !msg.contains('\n'), "{msg}");
    }
}

/// `logprobs` as harnesses read them. lm-evaluation-harness scores a
/// continuation by sending context + continuation as token ids with
/// `echo`, `logprobs: 1` and `max_tokens: 1`, then sums
/// `token_logprobs[len(context)..-1]` and checks each is its place's most
/// likely (`top_logprobs`). The echo covers every prompt token (the first
/// unscored), then the generated one, scored as without the echo (the
/// same row of logits computed in another shape: within 1e-3; that prompt
/// rows score what generation would is the engine's
/// `prompt_scores_cover_every_token_once_whatever_the_chunking`); a chat
/// reply carries one entry per token; a stream the same entries as the
/// whole reply.
#[test]
fn logprobs_and_echo_score_prompts_and_replies_as_harnesses_read_them() {
    let s = TestServer::tiny(ServerConfig::default());
    // Longer than a block, so that a prefix hit could happen.
    let context: Vec<u32> = (0..40).map(|i| 5 + (i * 12) % 300).collect();
    let post = |body: Value| {
        let r = s.post(COMPLETIONS, &body);
        assert_eq!(r.status, 200);
        r.json().unwrap()
    };
    // The greedy next token and its log-probability.
    let greedy = post(json!({"model": MODEL, "prompt": context, "max_tokens": 1,
        "temperature": 0, "logprobs": 2, "cache_salt": "g"}));
    let lp = &greedy["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 1, "{lp}");
    let generated = lp["token_logprobs"][0].as_f64().unwrap();
    let top = lp["top_logprobs"][0].as_object().unwrap();
    let best = top
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert!(
        generated <= 0.0 && (generated - best).abs() < 1e-9,
        "greedy: {lp}"
    );
    let piece = lp["tokens"][0].clone();
    // The same, echoed (the prompt as a batch of one, as the harness
    // sends it).
    let echo = post(json!({"model": MODEL, "prompt": [context], "max_tokens": 1,
        "temperature": 0, "logprobs": 1, "echo": true}));
    let choice = &echo["choices"][0];
    let lp = &choice["logprobs"];
    let scores = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(
        scores.len(),
        context.len() + 1,
        "the prompt and one token: {lp}"
    );
    assert!(scores[0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(lp["tokens"][context.len()], piece);
    let scored = scores[context.len()].as_f64().unwrap();
    assert!((scored - generated).abs() < 1e-3, "{scored} vs {generated}");
    for (i, t) in lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .skip(1)
    {
        let t = t.as_object().unwrap();
        assert!(
            (1..=2).contains(&t.len()),
            "logprobs 1, and the token itself: {t:?}"
        );
        assert!(scores[i].as_f64().unwrap() <= 0.0);
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    let text = choice["text"].as_str().unwrap();
    let tokens: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(text, tokens, "the echo's text is its tokens'");
    // Again, in the same namespace (the first echo's blocks are in the
    // prefix cache now): scored afresh, the same scores.
    let again = post(json!({"model": MODEL, "prompt": [context], "max_tokens": 1,
        "temperature": 0, "logprobs": 1, "echo": true}));
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "scored afresh"
    );
    assert_eq!(again["choices"][0]["logprobs"]["tokens"], lp["tokens"]);
    let same = again["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(same.len(), scores.len());
    for (a, b) in same.iter().zip(scores).skip(1) {
        assert!(
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4,
            "{a} vs {b}"
        );
    }
    // logprobs 0: each token's own score only.
    let zero = post(json!({"model": MODEL, "prompt": context, "max_tokens": 3,
        "temperature": 0, "logprobs": 0, "cache_salt": "z"}));
    for t in zero["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap()
    {
        assert_eq!(t.as_object().unwrap().len(), 1, "{t}");
    }
    // Chat: one entry per generated token, `top_logprobs` alternatives
    // each, most likely first; the stream carries the same entries.
    let mut body = chat("Score this.", 6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    body["ignore_eos"] = json!(true);
    body["cache_salt"] = json!("w");
    let whole = s.post(CHAT, &body).json().unwrap();
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 6, "{whole}");
    for e in &content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let lps: Vec<f64> = top.iter().map(|a| a["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
        assert!(e["bytes"].is_array() && e["token"].is_string());
    }
    body["stream"] = json!(true);
    body["cache_salt"] = json!("s");
    let streamed: Vec<Value> = s
        .post(CHAT, &body)
        .events()
        .map(Result::unwrap)
        .filter(|e| e != "[DONE]")
        .flat_map(|e| {
            let v: Value = serde_json::from_str(&e).unwrap();
            v["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    let tokens = |v: &[Value]| v.iter().map(|e| e["token"].clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&streamed), tokens(&content));
}

/// `n` > 1: one prompt, `n` choices. The prompt runs once and the other
/// choices fork its sequence (its blocks shared, none recomputed), so a
/// KV budget that holds the prompt once plus every choice's tokens is
/// enough: 4 choices of a 60-token prompt in 128 tokens of KV, where four
/// separate requests would need 4 × 68 and be preempted. Each choice
/// samples on its own (seeded: the same seed gives the same choices); the
/// usage counts the prompt once; a stream carries every choice's chunks
/// and finish, then one usage.
#[test]
fn n_choices_fork_one_prompt_and_share_its_blocks() {
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens: 128,
        ..EngineConfig::default()
    };
    let s = TestServer::start(tiny_engine(&cfg, 1024), ServerConfig::default());
    let prompt: Vec<u32> = (0..60).map(|i| 100 + (i * 37) % 500).collect();
    let ask = |salt: &str, stream: bool| {
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 4,
            "temperature": 1.0, "seed": 7, "ignore_eos": true, "cache_salt": salt});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = s.post(COMPLETIONS, &body);
        assert_eq!(r.status, 200);
        r
    };
    let whole = ask("a", false).json().unwrap();
    let texts: Vec<String> = (0..4)
        .map(|i| {
            let c = &whole["choices"][i];
            assert_eq!(c["index"], i);
            assert_eq!(c["finish_reason"], "length");
            c["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(
        texts.iter().any(|t| t != &texts[0]),
        "each choice samples on its own: {texts:?}"
    );
    assert_eq!(whole["usage"]["prompt_tokens"], 60);
    assert_eq!(whole["usage"]["completion_tokens"], 32);
    let m = s.metrics();
    assert_eq!(
        metric(&m, "kvforge:num_preemptions_total"),
        0.0,
        "the prompt's blocks are shared"
    );
    assert_eq!(metric(&m, "kvforge:forked_prompt_tokens_total"), 180.0);
    // The same seed, streamed (another salt: computed afresh).
    let events: Vec<String> = ask("b", true).events().map(Result::unwrap).collect();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut streamed = vec![String::new(); 4];
    let mut finished = 0;
    let mut usage = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(c["text"].as_str().unwrap());
            finished += usize::from(!c["finish_reason"].is_null());
        }
    }
    assert_eq!(streamed, texts, "the same seed, the same choices");
    assert_eq!(finished, 4);
    assert_eq!(usage["completion_tokens"], 32);
    // Greedy choices are one reply n times.
    let greedy = s
        .post(
            COMPLETIONS,
            &json!({"model": MODEL, "prompt": "Once", "max_tokens": 5, "n": 3, "temperature": 0}),
        )
        .json()
        .unwrap();
    let g: Vec<&Value> = (0..3).map(|i| &greedy["choices"][i]["text"]).collect();
    assert!(g.iter().all(|t| *t == g[0]), "{g:?}");
}

/// vLLM's tokenizer endpoints, which lm-evaluation-harness detects and
/// uses instead of a tokenizer of its own: `/tokenize` and `/detokenize`
/// round-trip a text, the end-of-turn token written in text is that token
/// (the harness takes `encode(eos_token)[0]` as its id), and a bad body or
/// token id is a 400 naming it.
#[test]
fn the_tokenizer_endpoints_round_trip_as_lm_eval_uses_them() {
    let s = TestServer::tiny(ServerConfig::default());
    let info = s.get("/tokenizer_info").json().unwrap();
    assert_eq!(info["eos_token"], "<|im_end|>");
    let text = "Hello, KV cache 🦀";
    let t = s.post(
        "/tokenize",
        &json!({"prompt": text, "add_special_tokens": false}),
    );
    assert_eq!(t.status, 200);
    let t = t.json().unwrap();
    let ids = t["tokens"].clone();
    assert_eq!(t["count"], ids.as_array().unwrap().len());
    let d = s
        .post("/detokenize", &json!({"tokens": ids}))
        .json()
        .unwrap();
    assert_eq!(d["prompt"], text);
    let eos = s
        .post("/tokenize", &json!({"prompt": "<|im_end|>"}))
        .json()
        .unwrap();
    assert_eq!(eos["tokens"].as_array().unwrap().len(), 1, "{eos}");
    let (msg, p, _) = error_of(
        s.post("/detokenize", &json!({"tokens": [1, 99999999]})),
        400,
    );
    assert_eq!(p.as_deref(), Some("tokens[1]"), "{msg}");
    let (msg, _, _) = error_of(s.post("/tokenize", &json!({"text": "x"})), 400);
    assert!(msg.contains("text"), "{msg}");
}
