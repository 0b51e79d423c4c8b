//! The official `openai` Python client (installed by `cargo xtask setup`)
//! against the `kvforge-serve` binary: `openai_client.py` starts the
//! server on a loopback port, runs its cases and stops it with SIGTERM.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_openai_python_client_talks_to_kvforge_serve() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} missing: run `cargo xtask setup`",
        python.display()
    );
    let out = Command::new(&python)
        .arg(root.join("server/tests/openai_client.py"))
        .env("KVFORGE_SERVE", env!("CARGO_BIN_EXE_kvforge-serve"))
        .env("KVFORGE_MODEL", common::model_path())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_client.py failed:\n{log}");
    assert!(log.contains("OK"), "{log}");
    println!("{log}");
}
