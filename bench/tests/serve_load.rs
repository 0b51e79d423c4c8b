//! `cargo xtask serve-load`: a bad mode, flag or value is one line and a
//! non-zero exit, before any server starts; `--help` lists the modes.

#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::root;

/// Runs the binary from the project root; exit code, stdout and stderr.
fn serve_load(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_serve_load"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_modes_flags_and_values_are_one_line_and_a_non_zero_exit() {
    for (args, want) in [
        (&[][..], "required arguments were not provided: <MODE>"),
        (&["stress"], "invalid value 'stress' for '<MODE>'"),
        (&["sweep", "--nope", "1"], "unexpected argument '--nope'"),
        (&["sweep", "--levels", "1,0"], "must be at least 1"),
        (
            &["sweep", "--reps", "x"],
            "invalid value 'x' for '--reps <REPS>'",
        ),
        (&["soak", "--minutes", "0"], "takes a number in (0, 240]"),
        (&["soak", "--minutes", "500"], "takes a number in (0, 240]"),
        (
            &["sweep", "--ignore-eos", "yes"],
            "'--ignore-eos <IGNORE_EOS>'",
        ),
        (&["sweep", "--out"], "a value is required for '--out <OUT>'"),
        (
            &["single", "--model", "models/no-such.gguf"],
            "--model models/no-such.gguf: no such file",
        ),
        (
            &["sweep", "--serve-bin", "target/no-such-serve"],
            "--serve-bin target/no-such-serve: no such file",
        ),
    ] {
        let (code, _, err) = serve_load(args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(err.starts_with("serve-load: "), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn help_lists_the_modes_and_exits_zero() {
    let (code, out, _) = serve_load(&["--help"]);
    assert_eq!(code, 0);
    for mode in ["sweep", "soak", "budget", "single"] {
        assert!(out.contains(mode), "{out}");
    }
}
