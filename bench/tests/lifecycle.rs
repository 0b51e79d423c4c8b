//! `cargo xtask lifecycle`: bad flags are one line and a non-zero exit; a
//! small run on the real model writes every turn of every configuration,
//! the constrained labels always parse, the lifecycle frees KV.

#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::root;

fn lifecycle(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lifecycle"))
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
        (&["--conversations", "0"], "--conversations"),
        (&["--filler", "99"], "--filler must be at most 40"),
        (&["--protect", "0"], "--protect"),
        (
            &["--configs", "full,magic"],
            "unknown configuration \"magic\"",
        ),
        (&["--configs", "full,streaming"], "include lc-rule"),
        (&["--data", "data/no-such.json"], "run `cargo xtask setup`"),
    ] {
        let (code, err) = lifecycle(args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn a_small_run_reports_every_turn_of_every_configuration() {
    let out = std::env::temp_dir().join(format!("kvforge-lifecycle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = out.to_str().unwrap();
    let configs = "full,lc-rule,lc-constrained";
    let args = [
        "--conversations",
        "1",
        "--filler",
        "2",
        "--answer-tokens",
        "8",
        "--protect",
        "1",
        "--delay",
        "1",
        "--configs",
        configs,
        "--out",
        o,
    ];
    let (code, err) = lifecycle(&args);
    assert_eq!(code, 0, "{err}");
    // 1 opening + 3 fact turns + 2 filler + 4 questions, per configuration.
    let csv = std::fs::read_to_string(out.join("turns.csv")).unwrap();
    let per = 10;
    assert_eq!(csv.lines().count(), 1 + 3 * per, "{csv}");
    let res = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let col = |name: &str, field: &str| -> String {
        let head: Vec<&str> = res.lines().next().unwrap().split(',').collect();
        let i = head.iter().position(|h| *h == field).unwrap();
        let line = res
            .lines()
            .find(|l| l.starts_with(&format!("{name},")))
            .unwrap();
        line.split(',').nth(i).unwrap().to_string()
    };
    // Constrained labels parse every turn; the rule never asks the model.
    assert_eq!(
        col("lc-constrained", "labels_valid"),
        per.to_string(),
        "{res}"
    );
    assert_eq!(col("lc-constrained", "fallbacks"), "0", "{res}");
    assert_eq!(col("lc-rule", "label_turns"), "0", "{res}");
    // The rule with protect 1, K = 1 frees segments.
    assert!(
        col("lc-rule", "reclaimed_segments").parse::<u32>().unwrap() > 0,
        "{res}"
    );
    for f in ["report.md", "recall_vs_peak.png", "kv_per_turn.png"] {
        assert!(out.join(f).exists(), "{f}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
