//! `cargo xtask gpu-check`'s binary without a GPU: its harness runs at toy
//! sizes on the CPU (`--dry-run 1`) and writes every section of the
//! report; bad flags, and no GPU, are one line and a non-zero exit.

#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn gpu_check(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu_check"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_dry_run_writes_every_section() {
    let dir = std::env::temp_dir().join(format!("kvforge-gpu-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (code, stdout, stderr) = gpu_check(&["--dry-run", "1", "--out", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    let report = std::fs::read_to_string(dir.join("gpu-check.md")).unwrap();
    for section in ["## Engine logits", "## Decode throughput", "| 1024 | int4-"] {
        assert!(report.contains(section), "no {section:?} in\n{report}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_flags_and_a_missing_gpu_are_one_line_and_a_non_zero_exit() {
    let mut cases = vec![
        (vec!["--nope", "1"], "unexpected argument '--nope'"),
        (vec!["--out"], "a value is required for '--out <OUT>'"),
    ];
    if kvforge_engine::cuda_devices() == 0 {
        cases.push((vec![], "libtorch sees no CUDA device"));
    }
    for (args, want) in cases {
        let (code, _, err) = gpu_check(&args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}
