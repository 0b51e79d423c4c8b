//! Source hygiene, rust-analyzer style: every Rust file opens with a `//!`
//! header, no test is switched off with an ignore attribute, and no language
//! feature newer than the workspace's `rust-version` is used where the one
//! toolchain here would accept it silently (a safe `#[target_feature]` fn
//! needs Rust 1.86). Newer std APIs are caught by clippy's
//! `incompatible_msrv` lint, which reads the same `rust-version`. Runs under
//! `cargo test` (see the test below) and as `cargo xtask tidy`.

use std::path::{Path, PathBuf};

use anyhow::Result;

/// Returns one line per problem found under `root`.
pub(crate) fn check(root: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files)?;
    let msrv_minor = msrv_minor(&std::fs::read_to_string(root.join("Cargo.toml"))?);
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
        if msrv_minor.is_some_and(|m| m < 86) {
            if let Some(line) = safe_target_feature_fn(&text) {
                problems.push(format!(
                    "{rel}:{line}: a safe #[target_feature] fn needs Rust 1.86; make it `unsafe fn` or raise rust-version"
                ));
            }
        }
    }
    Ok(problems)
}

/// The minor version of `rust-version = "1.xx"` in a manifest.
fn msrv_minor(manifest: &str) -> Option<u32> {
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("rust-version"))?;
    let version = line.split('"').nth(1)?;
    version.split('.').nth(1)?.parse().ok()
}

/// The line (1-based) of a `#[target_feature]` attribute whose function is
/// not `unsafe fn`.
fn safe_target_feature_fn(text: &str) -> Option<usize> {
    let attr = ["#[", "target_feature"].concat();
    let lines: Vec<&str> = text.lines().collect();
    lines.iter().enumerate().find_map(|(i, l)| {
        if !l.trim_start().starts_with(&attr) {
            return None;
        }
        let item = lines[i + 1..]
            .iter()
            .find(|l| !l.trim_start().starts_with("#[") && !l.trim_start().starts_with("//"))?;
        (item.contains("fn ") && !item.contains("unsafe fn")).then_some(i + 1)
    })
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
    fn a_safe_target_feature_fn_is_found() {
        let attr = ["#[", "target_feature(enable = \"avx2\")]"].concat();
        let safe = format!("//! x\n{attr}\nfn f() {{}}\n");
        assert_eq!(super::safe_target_feature_fn(&safe), Some(2));
        let unsafe_fn = format!("//! x\n{attr}\n#[inline]\nunsafe fn f() {{}}\n");
        assert_eq!(super::safe_target_feature_fn(&unsafe_fn), None);
        assert_eq!(super::msrv_minor("rust-version = \"1.85\""), Some(85));
    }

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
