//! Fails the build early, with one line that says what to do, when libtorch
//! is not where `cargo xtask setup` puts it. Its build script is tiny, so it
//! fails before `torch-sys` gets to its own, much less helpful, compiler
//! error about a missing `torch/torch.h`.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    if std::env::var_os("LIBTORCH_USE_PYTORCH").is_some() {
        return; // torch-sys asks Python where torch is
    }
    let Some(dir) = std::env::var_os("LIBTORCH") else {
        eprintln!("libtorch not found: LIBTORCH is not set; run `cargo xtask setup` (see README)");
        std::process::exit(1);
    };
    let header = Path::new(&dir).join("include/torch/torch.h");
    println!("cargo:rerun-if-changed={}", header.display());
    if !header.exists() {
        eprintln!(
            "libtorch not found at {}: run `cargo xtask setup` first (it installs torch 2.11.0 into .venv)",
            Path::new(&dir).display()
        );
        std::process::exit(1);
    }
}
