//! `cargo xtask pressure`: bad flags are one line and a non-zero exit; a
//! small run on the real model writes its report, and the sessions that
//! never lost an entry answer exactly as without pressure.

#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::root;

/// Runs the binary from the project root; returns exit code and stderr.
fn pressure(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pressure"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_flags_are_one_line_and_a_non_zero_exit() {
    for (args, want) in [
        (&["--nope", "1"][..], "unexpected argument '--nope'"),
        (
            &["--share", "0"],
            "for '--share <SHARE>': takes a fraction in (0, 1]",
        ),
        (
            &["--share", "1.5"],
            "for '--share <SHARE>': takes a fraction in (0, 1]",
        ),
        (&["--sessions", "0"], "--sessions"),
        (&["--policy", "random"], "--policy takes h2o, lfu or hybrid"),
        (&["--high", "0.5", "--low", "0.9"], "0 < low < high <= 1"),
        (
            &["--cold", "int3"],
            "invalid value 'int3' for '--cold <COLD>' [possible values: int8, int4, int2, none]",
        ),
        (&["--turns", "30"], "--turns must be at most 20"),
        (&["--data", "data/no-such.json"], "run `cargo xtask setup`"),
    ] {
        let (code, err) = pressure(args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn a_small_run_reports_every_turn_and_keeps_untouched_sessions_exact() {
    let out = std::env::temp_dir().join(format!("kvforge-pressure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = out.to_str().unwrap();
    let args = [
        "--sessions",
        "3",
        "--turns",
        "3",
        "--answer-tokens",
        "6",
        "--share",
        "0.7",
        "--sink",
        "4",
        "--window",
        "16",
        "--cold",
        "none",
        "--out",
        o,
    ];
    let (code, err) = pressure(&args);
    assert_eq!(code, 0, "{err}");
    let csv = std::fs::read_to_string(out.join("turns.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 2 * 3 * 3, "{csv}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    // "... answer exactly as in pass 1: **a/b**": every untouched session.
    let tail = md
        .split("as in pass 1: **")
        .nth(1)
        .expect("the summary line");
    let (a, b) = tail.split_once('/').unwrap();
    let b = b.split("**").next().unwrap();
    assert_eq!(a, b, "{md}");
    std::fs::remove_dir_all(out).unwrap();
}
