//! The length rules: a crate's source file under 400 lines, a function
//! under 100 (tests excluded).

use super::non_test_lines;

/// Source files allowed past [`MAX_LINES`], and functions past
/// [`MAX_FN_LINES`], each with the reason.
const LONG_FILES: &[(&str, &str)] = &[];
const LONG_FNS: &[(&str, &str, &str)] = &[];

/// Lines a source file of a crate (anything below a `src` folder) may
/// have.
const MAX_LINES: usize = 400;
/// Lines a function there may have.
const MAX_FN_LINES: usize = 100;

/// Source files of a crate (below a `src` folder) and their functions
/// over the limits (tests excluded: a `tests.rs` file, or below a
/// `#[cfg(test)]` line; so are integration tests, benches and fuzz
/// targets, which live outside `src`).
pub(super) fn length_problems(rel: &str, text: &str) -> Vec<String> {
    let rel = rel.replace('\\', "/");
    if !rel.split('/').any(|dir| dir == "src") || rel.ends_with("tests.rs") {
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
