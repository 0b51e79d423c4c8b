//! Source hygiene, rust-analyzer style: every Rust file opens with a `//!`
//! header, and no test is switched off with an ignore attribute. Runs under
//! `cargo test` (see the test below) and as `cargo xtask tidy`.

use std::path::{Path, PathBuf};

use anyhow::Result;

/// Returns one line per problem found under `root`.
pub(crate) fn check(root: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files)?;
    let mut problems = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        if !first.starts_with("//!") {
            problems.push(format!("{rel}: must start with a `//!` header"));
        }
        let ignore = ["#[", "ignore"].concat();
        if text.contains(&ignore) {
            problems.push(format!(
                "{rel}: {ignore}] hides a test; gate it on a feature instead"
            ));
        }
    }
    Ok(problems)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                rust_files(&path, out)?;
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_tree_is_tidy() {
        let problems = super::check(&crate::project_root()).expect("walk the tree");
        assert!(
            problems.is_empty(),
            "tidy problems:\n{}",
            problems.join("\n")
        );
    }
}
