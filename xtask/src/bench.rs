//! `cargo xtask bench` (criterion, then a Markdown summary of medians) and
//! `engine-bench` (kvforge beside Hugging Face transformers).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, say, setup, step};

/// Runs `kvforge bench` in several precisions and the transformers script on
/// the same text and model, and prints one Markdown table.
pub(crate) fn engine_bench(root: &Path, context: usize, decode: usize) -> Result<()> {
    let env = setup::setup(root, true)?;
    crate::build_release(root, &["-p", "kvforge-engine"])?;
    let text = root.join("data/exllamav2/wiki.utf8");
    let model = root.join("models").join(setup::MODEL_FILE);
    let (ctx, dec) = (context.to_string(), decode.to_string());
    let mut runs: Vec<(String, Command)> = Vec::new();
    for extra in [
        &[][..],
        &["--dtype", "bf16"],
        &["--weights", "f16"],
        &["--weights", "f16", "--kv-dtype", "f16"],
    ] {
        let mut c = Command::new(root.join("target/release/kvforge"));
        c.current_dir(root)
            .args(["bench", "--text"])
            .arg(&text)
            .args(["--context", &ctx, "--max-tokens", &dec]);
        c.args(extra);
        let label = if extra.is_empty() {
            "kvforge (f32)".to_string()
        } else {
            format!("kvforge {}", extra.join(" "))
        };
        runs.push((label, c));
    }
    let mut hf = Command::new(&env.python);
    hf.current_dir(root)
        .arg(root.join("scripts/hf_bench.py"))
        .arg(&model)
        .arg(&text)
        .args([&ctx, &dec]);
    runs.push(("transformers (f32)".into(), hf));
    let mut rows = Vec::new();
    for (name, mut cmd) in runs {
        say(&format!("==> {name}"));
        let out = cmd
            .output()
            .with_context(|| format!("could not start {name}"))?;
        if !out.status.success() {
            bail!(
                "{name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .unwrap_or("{}");
        let j: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{name}: bad output {line:?}"))?;
        rows.push((name, j));
    }
    let base = rows
        .last()
        .and_then(|r| r.1["decode_tok_s"].as_f64())
        .unwrap_or(f64::NAN);
    let mut table = format!(
        "Context {context} tokens of wiki.utf8, {decode} greedy decode steps, CPU, SmolLM2-135M Q4_1 GGUF.\n\n\
         | engine | prefill tok/s | decode tok/s | decode vs transformers |\n|---|---:|---:|---:|\n"
    );
    for (name, j) in &rows {
        let d = j["decode_tok_s"].as_f64().unwrap_or(f64::NAN);
        table.push_str(&format!(
            "| {name} | {:.1} | {d:.1} | {:.2}x |\n",
            j["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
            d / base
        ));
    }
    let out = root.join("target/engine-bench.md");
    std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    say(&format!("\n{table}\nwritten to {}", out.display()));
    Ok(())
}

pub(crate) fn bench(root: &Path, filter: Option<&str>) -> Result<()> {
    // The bench crate also holds the engine-backed prefix-bench binary.
    setup::setup(root, false)?;
    let mut cmd = cargo();
    cmd.current_dir(root).args([
        "bench",
        "-p",
        "kvforge-bench",
        "--bench",
        "bench_main",
        "--",
    ]);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    step("cargo bench -p kvforge-bench", cmd)?;
    let table = summarize(&root.join("target/criterion"))?;
    let out = root.join("target/kvforge-bench.md");
    std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    say(&format!("\n{table}\nwritten to {}", out.display()));
    Ok(())
}

/// Reads every `new/estimates.json` + `new/benchmark.json` criterion left and
/// renders median time and throughput per benchmark.
fn summarize(dir: &Path) -> Result<String> {
    let mut rows = Vec::new();
    collect(dir, &mut rows)?;
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    let mut s = String::from("| benchmark | median | throughput |\n|---|---:|---:|\n");
    for (name, median_ns, per_iter) in rows {
        let thr = match per_iter {
            Some(n) => format_rate(n / (median_ns * 1e-9)),
            None => String::new(),
        };
        s.push_str(&format!("| {name} | {} | {thr} |\n", format_ns(median_ns)));
    }
    Ok(s)
}

type Row = (String, f64, Option<f64>);

fn collect(dir: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if !path.is_dir() {
            continue;
        }
        let est = path.join("new/estimates.json");
        let meta = path.join("new/benchmark.json");
        if est.is_file() && meta.is_file() {
            let est: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&est)?)
                .with_context(|| format!("parsing {}", est.display()))?;
            let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta)?)
                .with_context(|| format!("parsing {}", meta.display()))?;
            let median = est["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let name = meta["full_id"].as_str().unwrap_or("?").to_string();
            let per_iter = meta["throughput"]["Elements"].as_f64();
            rows.push((name, median, per_iter));
        } else {
            collect(&path, rows)?;
        }
    }
    Ok(())
}

fn format_ns(ns: f64) -> String {
    match ns {
        n if n < 1e3 => format!("{n:.1} ns"),
        n if n < 1e6 => format!("{:.2} µs", n / 1e3),
        n if n < 1e9 => format!("{:.2} ms", n / 1e6),
        n => format!("{:.2} s", n / 1e9),
    }
}

fn format_rate(per_s: f64) -> String {
    format!("{per_s:.3e} elem/s")
}
