//! What the bench crate's integration tests share.

use std::path::{Path, PathBuf};

/// The project root: the binaries run from there, as `cargo xtask` runs them.
pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the bench crate sits in the workspace")
        .to_path_buf()
}
