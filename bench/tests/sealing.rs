//! `sealing`: bad arguments are one line and a non-zero exit, before any
//! work (a replay too large to hold in memory is refused, not run).

#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn bad_arguments_are_one_line_and_a_non_zero_exit() {
    for (args, want) in [
        (&["100000000", "16"][..], "is above the 1000000 turns"),
        (&["0"], "CHATS must be at least 1"),
        (&["x"], "CHATS must be a positive integer"),
        (&["1", "2", "out", "extra"], "usage: sealing"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sealing"))
            .args(args)
            .current_dir(std::env::temp_dir())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
