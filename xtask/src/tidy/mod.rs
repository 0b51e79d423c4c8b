//! Source hygiene, rust-analyzer style: every Rust file opens with a `//!`
//! header, no test is switched off with an ignore attribute, and no language
//! feature newer than the workspace's `rust-version` is used where the one
//! toolchain here would accept it silently (a safe `#[target_feature]` fn
//! needs Rust 1.86). Newer std APIs are caught by clippy's
//! `incompatible_msrv` lint, which reads the same `rust-version`. In every
//! library crate of the workspace the modules form a DAG (through
//! `crate::`), the files of each module directory form one (through
//! `super::`), and no module imports a re-export of the crate root (name
//! the module; an item `lib.rs` defines itself may be imported from the
//! root). Every crate's source files stay under 400 lines and their
//! functions under 100 (an allow-list names the exceptions and why; it is
//! empty). Runs under `cargo test` (see the test below) and as `cargo
//! xtask tidy`.

mod lengths;
mod modules;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::Result;

use lengths::length_problems;
use modules::{crate_sources, module_dirs, module_graph_problems, sibling_circles};

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
        problems.extend(length_problems(&rel, &text));
        if msrv_minor.is_some_and(|m| m < 86) {
            if let Some(line) = safe_target_feature_fn(&text) {
                problems.push(format!(
                    "{rel}:{line}: a safe #[target_feature] fn needs Rust 1.86; make it `unsafe fn` or raise rust-version"
                ));
            }
        }
    }
    for krate in crate_sources(root)? {
        problems.extend(module_graph_problems(root, &krate)?);
    }
    for dir in module_dirs(root)? {
        problems.extend(sibling_circles(root, &dir)?);
    }
    Ok(problems)
}

/// The lines of `text` before its inline unit tests (`#[cfg(test)]` then
/// `mod tests {`; a `mod tests;` declaration does not end the code).
pub(super) fn non_test_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = (0..lines.len())
        .find(|&i| {
            lines[i].trim_start().starts_with("#[cfg(test)]")
                && lines[i + 1..]
                    .iter()
                    .take(3)
                    .any(|l| l.trim_start().starts_with("mod tests {"))
        })
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// The code lines of `text` before its unit tests, comments cut, with a
/// `use` that spans several lines joined into one (so every name it
/// imports is seen).
pub(super) fn statements(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut open = false;
    for l in non_test_lines(text) {
        let code = l.split("//").next().unwrap_or("").trim();
        match out.last_mut() {
            Some(last) if open => last.push_str(code),
            _ => out.push(code.to_string()),
        }
        let starts = code.starts_with("use ")
            || code.starts_with("pub use ")
            || code.starts_with("pub(crate) use ");
        if starts || open {
            open = !code.ends_with(';');
        }
    }
    out
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

pub(super) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
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
