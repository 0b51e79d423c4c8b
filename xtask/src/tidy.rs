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
//! root). The engine's, the coordinator's and the server's files and
//! functions stay short (an allow-list names the exceptions and why; it is
//! empty). Runs under `cargo test` (see the test below) and as `cargo
//! xtask tidy`.

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

/// Crates (and, on the way to all of them, folders) whose files and
/// functions must stay short (the limits below).
const SHORT_CRATES: &[&str] = &[
    "engine/src",
    "engine/coordinator/src",
    "server/src",
    "ablate/src",
    "bench/src",
    "lifecycle/src",
    "lsh-share/src",
    "remote-redis/src",
    "remote-tier/src",
];

/// The `src` directory (relative to `root`) of every library crate of the
/// workspace: their modules must form a DAG and never import the crate
/// root (`use crate::{Engine, ..}` from below `lib.rs` is how a circle
/// starts: name the module instead).
fn crate_sources(root: &Path) -> Result<Vec<String>> {
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
fn module_dirs(root: &Path) -> Result<Vec<PathBuf>> {
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
fn sibling_circles(root: &Path, dir: &Path) -> Result<Vec<String>> {
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
        for l in non_test_lines(&text) {
            let code = l.split("//").next().unwrap_or("");
            for n in imported_names(code, "super::") {
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

/// Source files allowed past [`MAX_LINES`], and functions past
/// [`MAX_FN_LINES`], each with the reason.
const LONG_FILES: &[(&str, &str)] = &[];
const LONG_FNS: &[(&str, &str, &str)] = &[];

/// Lines a source file of the [`SHORT_CRATES`] may have.
const MAX_LINES: usize = 400;
/// Lines a function there may have.
const MAX_FN_LINES: usize = 100;

/// Files and functions of the [`SHORT_CRATES`] over the limits
/// (tests excluded: a `tests.rs` file, or below a `#[cfg(test)]` line).
fn length_problems(rel: &str, text: &str) -> Vec<String> {
    let rel = rel.replace('\\', "/");
    if !SHORT_CRATES.iter().any(|d| rel.starts_with(d)) || rel.ends_with("tests.rs") {
        return Vec::new();
    }
    let code = non_test_lines(text);
    let mut out = Vec::new();
    if code.len() > MAX_LINES && !LONG_FILES.iter().any(|(f, _)| *f == rel) {
        out.push(format!(
            "{rel}: {} lines (at most {MAX_LINES}; split it by concern)",
            code.len()
        ));
    }
    for (name, start, len) in functions(&code) {
        let allowed = LONG_FNS.iter().any(|(f, n, _)| *f == rel && *n == name);
        if len > MAX_FN_LINES && !allowed {
            out.push(format!(
                "{rel}:{}: fn {name} has {len} lines (at most {MAX_FN_LINES})",
                start + 1
            ));
        }
    }
    out
}

/// The lines of `text` before its inline unit tests (`#[cfg(test)]` then
/// `mod tests {`; a `mod tests;` declaration does not end the code).
fn non_test_lines(text: &str) -> Vec<&str> {
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

/// `(name, first line, lines)` of every function with a body in `lines`.
fn functions(lines: &[&str]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let Some(rest) = t.strip_prefix("fn ") else {
            continue;
        };
        if l.trim_end().ends_with(';') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let indent = l.len() - l.trim_start().len();
        let close = format!("{}}}", " ".repeat(indent));
        let end = lines[i..]
            .iter()
            .position(|x| x.trim_end() == close)
            .map_or(lines.len(), |k| i + k);
        out.push((name, i, end - i + 1));
    }
    out
}

/// Circles between the modules of the crate at `root/krate`, and imports
/// of its root from a module below it.
fn module_graph_problems(root: &Path, krate: &str) -> Result<Vec<String>> {
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
        for l in non_test_lines(&text) {
            let code = l.split("//").next().unwrap_or("");
            for name in imported_names(code, "crate::") {
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

    /// A crate that breaks each module rule once: a re-export imported
    /// through the root, a circle of modules, a circle of files through
    /// `super::`; and what the rules allow (an item the root defines, a
    /// module named through `crate::`).
    #[test]
    fn circles_and_root_re_exports_are_found_and_the_allowed_forms_pass() {
        let root = std::env::temp_dir().join(format!("kvforge-tidy-{}", std::process::id()));
        let src = root.join("k/src");
        let write = |p: &str, text: &str| {
            let p = src.join(p);
            std::fs::create_dir_all(p.parent().expect("a parent")).expect("mkdir");
            std::fs::write(p, text).expect("write");
        };
        write(
            "lib.rs",
            "//! k\nmod a;\nmod b;\nmod m;\npub use a::X;\npub struct Y;\n",
        );
        write(
            "a.rs",
            "//! a\nuse crate::Y;\nuse crate::b::Z;\npub struct X;\n",
        );
        write("b.rs", "//! b\nuse crate::{a::X, X as W};\npub struct Z;\n");
        write("m/mod.rs", "//! m\nmod p;\nmod q;\nmod r;\n");
        write("m/p.rs", "//! p\nuse super::q::Q;\n");
        write("m/q.rs", "//! q\nuse super::{r::R, p};\npub struct Q;\n");
        write("m/r.rs", "//! r\nuse super::super::Y;\npub struct R;\n");
        let mut got = super::module_graph_problems(&root, "k/src").expect("graph");
        got.extend(super::sibling_circles(&root, &src.join("m")).expect("siblings"));
        std::fs::remove_dir_all(&root).expect("clean up");
        let want = [
            "k/src/b.rs: `crate::X` is a re-export of the crate root; import it from its module",
            "k/src: modules import each other in a circle: a -> b -> a",
            "k/src: modules import each other in a circle: b -> a -> b",
            "k/src/m: files import each other through super:: in a circle: p -> q -> p",
            "k/src/m: files import each other through super:: in a circle: q -> p -> q",
        ];
        assert_eq!(got, want);
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
