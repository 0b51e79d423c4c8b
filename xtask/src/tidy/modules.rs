//! The module rules: in each library crate the modules form a DAG
//! (through `crate::`) and import nothing the root only re-exports; the
//! files of each module directory form a DAG (through `super::`).

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::{non_test_lines, rust_files, statements};

/// The `src` directory (relative to `root`) of every library crate of the
/// workspace: their modules must form a DAG and never import the crate
/// root (`use crate::{Engine, ..}` from below `lib.rs` is how a circle
/// starts: name the module instead).
pub(super) fn crate_sources(root: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    rust_files(root, &mut files)?;
    let mut out: Vec<String> = files
        .iter()
        .filter(|f| f.ends_with("src/lib.rs"))
        .filter_map(|f| f.parent()?.strip_prefix(root).ok())
        .map(|d| d.display().to_string().replace('\\', "/"))
        .collect();
    out.sort();
    Ok(out)
}

/// Every directory that is a module with children (it holds a `mod.rs`,
/// or sits beside `name.rs`).
pub(super) fn module_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    rust_files(root, &mut files)?;
    let mut dirs: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| f.parent())
        .filter(|d| d.join("mod.rs").exists() || d.with_extension("rs").exists())
        .map(Path::to_path_buf)
        .collect();
    dirs.sort();
    dirs.dedup();
    Ok(dirs)
}

/// The names `lib.rs` defines itself (types, traits, functions, macros,
/// constants): a module may import those from the crate root. A name the
/// root only re-exports is imported from its module.
fn defined_items(lib: &str) -> Vec<String> {
    let kinds = [
        "struct ", "enum ", "trait ", "type ", "fn ", "const ", "static ", "union ",
    ];
    let mut out = Vec::new();
    for l in non_test_lines(lib) {
        let mut t = l.trim_start();
        if let Some(rest) = t.strip_prefix("pub") {
            t = rest.strip_prefix("(crate)").unwrap_or(rest).trim_start();
        }
        for q in ["const ", "unsafe ", "async "] {
            if t.strip_prefix(q)
                .is_some_and(|rest| rest.starts_with("fn "))
            {
                t = &t[q.len()..];
            }
        }
        if let Some(rest) = t.strip_prefix("macro_rules! ") {
            t = rest;
        } else if let Some(k) = kinds.iter().find(|k| t.starts_with(**k)) {
            t = &t[k.len()..];
        } else {
            continue;
        }
        let name: String = t
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        out.push(name);
    }
    out
}

/// The first segment of each path a line imports through `key`
/// (`super::`, `crate::`): `super::a::X` and `super::{a, b::Y}` name `a`
/// (and `b`).
fn imported_names(code: &str, key: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(key) {
        rest = &rest[i + key.len()..];
        let Some(inner) = rest.strip_prefix('{') else {
            out.push(ident(rest));
            continue;
        };
        let mut depth = 0usize;
        let mut part = String::new();
        for c in inner.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(ident(&part));
                    part.clear();
                    continue;
                }
                _ => {}
            }
            part.push(c);
        }
        out.push(ident(&part));
    }
    out.retain(|n| !n.is_empty());
    out
}

/// Circles among the child modules of `dir` through `super::` imports:
/// the split into files is by concern only when the files form a DAG.
pub(super) fn sibling_circles(root: &Path, dir: &Path) -> Result<Vec<String>> {
    let mut children = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_string();
        let child = if p.is_dir() {
            p.join("mod.rs").exists()
        } else {
            p.extension().is_some_and(|x| x == "rs") && name != "mod" && name != "tests"
        };
        if child {
            children.push((name, p));
        }
    }
    let names: Vec<&str> = children.iter().map(|(n, _)| n.as_str()).collect();
    let mut deps: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (name, path) in &children {
        let file = if path.is_dir() {
            path.join("mod.rs")
        } else {
            path.clone()
        };
        let text = std::fs::read_to_string(&file)?;
        let mut uses: Vec<String> = Vec::new();
        for code in statements(&text) {
            for n in imported_names(&code, "super::") {
                if n != *name && names.contains(&n.as_str()) && !uses.contains(&n) {
                    uses.push(n);
                }
            }
        }
        deps.insert(name.clone(), uses);
    }
    let rel = dir.strip_prefix(root).unwrap_or(dir).display().to_string();
    Ok(circles(&deps)
        .into_iter()
        .map(|c| format!("{rel}: files import each other through super:: in a circle: {c}"))
        .collect())
}

/// Each circle of `deps` (module -> the modules it imports), as
/// `a -> b -> a`, once per module on one.
fn circles(deps: &std::collections::BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for m in deps.keys() {
        let mut stack: Vec<(String, Vec<String>)> = vec![(m.clone(), vec![m.clone()])];
        let mut seen = std::collections::BTreeSet::new();
        while let Some((n, path)) = stack.pop() {
            for d in deps.get(&n).into_iter().flatten() {
                if d == m {
                    out.push(format!("{} -> {m}", path.join(" -> ")));
                    stack.clear();
                    break;
                }
                if seen.insert(d.clone()) {
                    let mut p = path.clone();
                    p.push(d.clone());
                    stack.push((d.clone(), p));
                }
            }
        }
    }
    out
}

/// Circles between the modules of the crate at `root/krate`, and imports
/// of its root from a module below it.
pub(super) fn module_graph_problems(root: &Path, krate: &str) -> Result<Vec<String>> {
    let src = root.join(krate);
    let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let lib = std::fs::read_to_string(src.join("lib.rs"))?;
    let mods: Vec<String> = lib
        .lines()
        .filter_map(|l| {
            let t = l.trim_start();
            let t = t.strip_prefix("pub ").unwrap_or(t);
            t.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect();
    let defined = defined_items(&lib);
    let mut deps: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let mut problems = Vec::new();
    for m in &mods {
        let file = [src.join(format!("{m}.rs")), src.join(m).join("mod.rs")]
            .into_iter()
            .find(|p| p.exists());
        let Some(file) = file else { continue };
        let mut text = String::new();
        let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        if file.ends_with("mod.rs") {
            for e in std::fs::read_dir(&dir)? {
                let p = e?.path();
                if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("tests.rs") {
                    text.push_str(&std::fs::read_to_string(&p)?);
                }
            }
        } else {
            text = std::fs::read_to_string(&file)?;
        }
        let mut uses: Vec<String> = Vec::new();
        for code in statements(&text) {
            for name in imported_names(&code, "crate::") {
                if mods.contains(&name) {
                    if name != *m && !uses.contains(&name) {
                        uses.push(name);
                    }
                } else if !defined.contains(&name) {
                    problems.push(format!(
                        "{}: `crate::{name}` is a re-export of the crate root; import it from its module",
                        rel(&file)
                    ));
                }
            }
        }
        deps.insert(m.clone(), uses);
    }
    // A circle: a module reachable from itself.
    for c in circles(&deps) {
        problems.push(format!(
            "{krate}: modules import each other in a circle: {c}"
        ));
    }
    problems.sort();
    problems.dedup();
    Ok(problems)
}
