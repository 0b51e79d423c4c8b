//! The `kvforge-serve` binary: bad flags and files are one line and a
//! non-zero exit; SIGTERM lets a running stream finish and exits 0. On
//! the real model (`cargo xtask setup` installs it).

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvforge_server::client;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_kvforge-serve");

fn fails(args: &[&str], code: i32, words: &str) {
    let out = Command::new(BIN)
        .args(args)
        .args(["--port", "0"])
        .env_remove("KVFORGE_REMOTE_SECRET")
        .env_remove("KVFORGE_API_KEY")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    assert!(err.contains(words), "{args:?}: {err}");
}

#[test]
fn bad_flags_and_files_are_one_line_and_a_nonzero_exit() {
    let model = common::model_path();
    let model = model.to_str().unwrap();
    fails(&["--max-batch", "many"], 2, "invalid value");
    fails(&["--no-such-flag"], 2, "--no-such-flag");
    fails(&["--model", "/no/such/model.gguf"], 1, "not found");
    fails(
        &["--model", model, "--config", "/no/such.toml"],
        1,
        "/no/such.toml",
    );
    let dir = std::env::temp_dir().join(format!("kvforge-serve-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "cold = { format = \"int3\" }\n").unwrap();
    fails(
        &["--model", model, "--config", bad.to_str().unwrap()],
        1,
        "int3",
    );
    for (toml, words) in [
        (
            "prefix = {}\nremote = { url = \"http://h:1\", seed = 1 }\n",
            "must be redis://",
        ),
        (
            "remote = { url = \"redis://h:1\", seed = 1 }\n",
            "needs prefix reuse",
        ),
        ("prefix = {}\nremote = { url = \"redis://h:1\" }\n", "seed"),
        (
            "prefix = {}\nremote = { url = \"redis://h:notaport\", seed = 1 }\n",
            "remote:",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://127.0.0.1:1\", seed = 1 }\n",
            "KVFORGE_REMOTE_SECRET",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://127.0.0.1:1\", seed = 1, secret_file = \"/no/such/secret\" }\n",
            "/no/such/secret",
        ),
        (
            "prefix = {}\nremote = { url = \"redis://127.0.0.1:1\", seed = 1, secret = \"in the file\" }\n",
            "secret",
        ),
    ] {
        std::fs::write(&bad, toml).unwrap();
        fails(
            &["--model", model, "--config", bad.to_str().unwrap()],
            1,
            words,
        );
    }
    fails(&["--model", model, "--threads", "999"], 1, "--threads");
    fails(&["--model", model, "--max-batch", "0"], 1, "--max-batch");
    fails(&["--model", model, "--device", "tpu"], 1, "tpu");
    fails(
        &["--model", model, "--host", "256.0.0.1"],
        1,
        "cannot listen",
    );
    fails(&["--model", model, "--api-key", ""], 1, "--api-key");
    fails(&["--model", model, "--api-key", "sk one"], 1, "whitespace");
    fails(
        &["--model", model, "--header-timeout-secs", "0"],
        1,
        "--header-timeout-secs",
    );
    fails(
        &["--model", model, "--kv-events", "--kv-events-buffer", "0"],
        1,
        "--kv-events-buffer",
    );
    fails(
        &["--model", model, "--probe", "/no/such/text"],
        1,
        "--probe /no/such/text",
    );
    let short = dir.join("short.txt");
    std::fs::write(&short, "Too short.").unwrap();
    let short = short.to_str().unwrap();
    fails(
        &["--model", model, "--probe", short],
        1,
        "the probe needs at least",
    );
    let long = dir.join("long.txt");
    std::fs::write(&long, "A text long enough to probe. ".repeat(20)).unwrap();
    fails(
        &[
            "--model",
            model,
            "--probe",
            long.to_str().unwrap(),
            "--probe-every",
            "0",
        ],
        1,
        "--probe-every",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_lets_the_running_stream_finish_then_exits_zero() {
    let model = common::model_path();
    let mut child = Command::new(BIN)
        .args(["--port", "0", "--grace-secs", "60", "--model"])
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_string();
    let body = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "Count from one to fifty."}],
        "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let r = client::post_json(&addr, "/v1/chat/completions", &[], &body, common::TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    let mut events = r.events();
    events.next().unwrap().unwrap();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let rest: Vec<String> = events.map(Result::unwrap).collect();
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    let said: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(said.iter().any(|l| l.contains("stopping")), "{said:?}");
}

/// Starts the binary on the real model with `args` and `env`; returns the
/// child and its address.
fn serve(args: &[&str], env: &[(&str, &str)]) -> (std::process::Child, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["--port", "0", "--model"])
        .arg(common::model_path())
        .args(args)
        .env_remove("KVFORGE_API_KEY")
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("exited before listening").unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (child, addr)
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// S10: keys from `KVFORGE_API_KEY="sk-one, sk-two"` are trimmed: both
/// work; a wrong one and none are refused.
#[test]
fn keys_from_the_environment_are_trimmed() {
    let (mut child, addr) = serve(&[], &[("KVFORGE_API_KEY", "sk-one, sk-two")]);
    let models = |key: Option<&str>| {
        let h = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = h.iter().map(|h| ("Authorization", h.as_str())).collect();
        client::request(&addr, "GET", "/v1/models", &headers, b"", common::TIMEOUT)
            .unwrap()
            .status
    };
    assert_eq!(models(Some("sk-one")), 200);
    assert_eq!(
        models(Some("sk-two")),
        200,
        "the key after the comma and space"
    );
    assert_eq!(models(Some("sk-three")), 401);
    assert_eq!(models(Some(" sk-two")), 200, "the header is trimmed too");
    assert_eq!(models(None), 401);
    let _ = child.kill();
    let _ = child.wait();
}

/// S11: after SIGTERM the server still answers, with 503, while a stream
/// runs out its grace; a second signal exits at once.
#[test]
fn sigterm_answers_new_requests_with_503_and_a_second_signal_exits_at_once() {
    let (mut child, addr) = serve(&["--grace-secs", "60"], &[]);
    let body = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": true, "stream": true,
    });
    let r = client::post_json(&addr, "/v1/chat/completions", &[], &body, common::TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    let mut events = r.events();
    events.next().unwrap().unwrap();
    signal(&child, "-TERM");
    let t0 = Instant::now();
    let refused = loop {
        let r =
            client::post_json(&addr, "/v1/chat/completions", &[], &body, common::TIMEOUT).unwrap();
        if r.status != 200 {
            break r;
        }
        r.close();
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "still taking requests"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let (msg, _, code) = common::error_of(refused, 503);
    assert_eq!(code.as_deref(), Some("shutting_down"), "{msg}");
    let health = client::request(&addr, "GET", "/health", &[], b"", common::TIMEOUT).unwrap();
    assert_eq!(health.status, 503);
    assert!(
        child.try_wait().unwrap().is_none(),
        "the stream has its grace"
    );
    signal(&child, "-TERM");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a second signal did not exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(130));
    drop(events);
}
