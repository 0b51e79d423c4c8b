//! `cargo xtask ablate`: every experiment file parses; the quick run covers
//! every configuration, writes a well-formed report and repeats its quality
//! columns exactly; `--resume` skips what was measured; a failing
//! configuration is recorded while the others run; bad input is one line
//! and a non-zero exit.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvforge_bench::ablate::config::Experiment;
#[cfg(feature = "engine")]
use kvforge_bench::ablate::run::{Options, Outcome, run};

use common::root;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvforge-ablate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_experiment_file_in_configs_parses() {
    let mut n = 0;
    for e in std::fs::read_dir(root().join("configs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            match Experiment::load(&p) {
                Ok(exp) => assert!(!exp.matrix().is_empty()),
                // A file naming a policy written in Python parses only in
                // the Python package's process (pytest runs one).
                Err(e) if e.to_string().contains("is a policy written in Python") => {}
                Err(e) => panic!("{e}"),
            }
            n += 1;
        }
    }
    assert!(n >= 3, "ablate, quick and full");
}

/// results.csv as (config, workload, item) -> column -> value.
type Table = BTreeMap<(String, String, String), BTreeMap<String, String>>;

fn results(dir: &Path) -> Table {
    let text = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    let mut lines = text.lines();
    let head: Vec<&str> = lines.next().unwrap().split(',').collect();
    lines
        .map(|l| {
            let f = fields(l);
            let f: Vec<&str> = f.iter().map(String::as_str).collect();
            assert_eq!(f.len(), head.len(), "{l}");
            let row: BTreeMap<String, String> = head
                .iter()
                .zip(&f)
                .map(|(h, v)| (h.to_string(), v.to_string()))
                .collect();
            ((f[0].into(), f[1].into(), f[2].into()), row)
        })
        .collect()
}

/// The fields of one CSV line (a field in double quotes may hold commas;
/// `""` inside it is one quote).
fn fields(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Columns that measure time, not quality: they may differ between runs.
fn is_speed(col: &str) -> bool {
    matches!(col, "secs" | "tok_s" | "decode_tok_s")
}

#[cfg(feature = "engine")]
fn quick(out: &Path, config: &Path, resume: bool) -> anyhow::Result<Outcome> {
    run(&Options {
        config: config.to_path_buf(),
        out: Some(out.to_path_buf()),
        resume,
        progress: false,
        root: root(),
        registry: kvforge_ablate::registry(),
    })
}

#[cfg(feature = "engine")]
#[test]
fn quick_runs_every_configuration_and_repeats_its_quality_columns() {
    let config = root().join("configs/quick.toml");
    let (a, b) = (scratch("a"), scratch("b"));
    quick(&a, &config, false).unwrap();
    quick(&b, &config, false).unwrap();
    let exp = Experiment::load(&config).unwrap();
    let (ra, rb) = (results(&a), results(&b));
    // Every configuration ran every item, none failed.
    // Chats, contexts, pass keys of quick.toml, for each configuration
    // that runs the workload.
    let items: usize = exp
        .matrix()
        .iter()
        .map(|m| {
            [("chat", 2), ("stream", 2), ("passkey", 3)]
                .iter()
                .filter(|(w, _)| exp.runs(m.name(), w))
                .map(|(_, n)| n)
                .sum::<usize>()
        })
        .sum();
    assert_eq!(ra.len(), items);
    for ((config, workload, item), row) in &ra {
        assert_eq!(row["error"], "", "{config} {workload} {item}");
    }
    // Two runs: the same quality, column by column.
    assert_eq!(ra.keys().collect::<Vec<_>>(), rb.keys().collect::<Vec<_>>());
    for (k, row) in &ra {
        for (col, v) in row {
            if !is_speed(col) {
                assert_eq!(v, &rb[k][col], "{k:?} {col}");
            }
        }
    }
    // The report: one row per configuration, the sections, the files.
    let md = std::fs::read_to_string(a.join("report.md")).unwrap();
    for m in exp.matrix() {
        assert!(md.contains(&format!("\n| {} | ", m.name())), "{}", m.name());
    }
    for section in [
        "## Quality at equal memory",
        "## Quality with 95% intervals",
        "## Chat",
        "## Streaming perplexity",
        "## Pass key retrieval",
        "## The experiment file",
    ] {
        assert!(md.contains(section), "{section}");
    }
    assert!(!md.contains("## Failures"));
    assert!(md.contains("Measured at commit `") && md.contains("cores"));
    // Budget-aligned rows hold their target or up to one block under it
    // (whole blocks: at quick's 16 to 24 blocks an item, one block is 4 to
    // 6 points), never a block over; every row has its measured share.
    let iso = std::fs::read_to_string(a.join("iso.csv")).unwrap();
    for line in iso.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let share: f64 = f[4].parse().unwrap(); // kept
        if let Ok(target) = f[1].parse::<f64>() {
            assert!(share <= target + 0.01 && share > target - 0.07, "{line}");
        }
        assert!(share > 0.0 && share < 1.5, "{line}");
    }
    assert!(iso.contains("int4+evict-kv25,0.25,passkey,3,"), "{iso}");
    for png in ["pareto.png", "passkey.png", "chat_kv.png", "headline.png"] {
        let bytes = std::fs::read(a.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png}");
    }
    let prom = std::fs::read_to_string(a.join("metrics/all-chat.prom")).unwrap();
    assert!(
        prom.contains("# TYPE kvforge_policies_lifecycle_dropped_entries gauge"),
        "{prom}"
    );
    // Intervals: each configuration's recall, pass key and perplexity,
    // the same in both runs (seeded), none for the baseline's change.
    let iv = std::fs::read_to_string(a.join("intervals.csv")).unwrap();
    let runs = |w: &str| {
        exp.matrix()
            .iter()
            .filter(|m| exp.runs(m.name(), w))
            .count()
    };
    let measures = runs("chat") + runs("stream") + runs("passkey");
    assert_eq!(iv.lines().count(), 1 + measures, "{iv}");
    assert_eq!(
        iv,
        std::fs::read_to_string(b.join("intervals.csv")).unwrap()
    );
    let base_ppl = iv.lines().find(|l| l.starts_with("baseline,ppl,")).unwrap();
    assert!(base_ppl.ends_with(",,,,"), "{base_ppl}");
    let turns = std::fs::read_to_string(a.join("turns.csv")).unwrap();
    assert_eq!(turns.lines().count(), 1 + runs("chat") * 2 * 4);
    // Mechanisms really engaged: cold bytes under int4, drops under eviction.
    let col = |config: &str, item: &str, c: &str| -> f64 {
        ra[&(config.to_string(), "stream".to_string(), item.to_string())][c]
            .parse()
            .unwrap()
    };
    assert!(col("int4", "a0-ctx384", "cold_bytes") > 0.0);
    assert!(col("evict", "a1-ctx384", "kv_bytes") < col("baseline", "a1-ctx384", "kv_bytes"));
    assert!(
        col("keydiff-per-head", "a0-ctx384", "kv_bytes") < col("baseline", "a0-ctx384", "kv_bytes")
    );
    // Two articles: two texts, and the perplexity change pairs the chunks
    // of both (10 scored chunks of 32 after the prefix of 64, each).
    assert_ne!(
        col("baseline", "a0-ctx384", "ppl"),
        col("baseline", "a1-ctx384", "ppl")
    );
    let int4 = iv.lines().find(|l| l.starts_with("int4,ppl,")).unwrap();
    assert!(int4.starts_with("int4,ppl,20,20,"), "{int4}");

    // --resume skips everything measured; a changed file is refused.
    let before = std::fs::read_to_string(a.join("items.jsonl")).unwrap();
    quick(&a, &config, true).unwrap();
    assert_eq!(
        std::fs::read_to_string(a.join("items.jsonl")).unwrap(),
        before
    );
    // An interrupt: the log cut inside an item's line; --resume measures
    // what is missing, and the results are those of the whole run.
    let lines: Vec<&str> = before.lines().collect();
    let keep = lines.len() - 2;
    let cut = format!("{}\n{}", lines[..keep].join("\n"), &lines[keep][..20]);
    std::fs::write(a.join("items.jsonl"), cut).unwrap();
    quick(&a, &config, true).unwrap();
    let resumed = results(&a);
    assert_eq!(resumed.len(), ra.len());
    for (k, row) in &ra {
        for (col, v) in row {
            if !is_speed(col) {
                assert_eq!(v, &resumed[k][col], "resumed {k:?} {col}");
            }
        }
    }
    let changed = a.join("changed.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&changed, text.replace("seed = 7", "seed = 8")).unwrap();
    let err = quick(&a, &changed, true).unwrap_err().to_string();
    assert!(err.contains("changed since the run"), "{err}");
    // One invalid byte in the log: refused, not "nothing measured".
    let mut log = std::fs::read(a.join("items.jsonl")).unwrap();
    log[10] = 0xff;
    std::fs::write(a.join("items.jsonl"), &log).unwrap();
    let err = quick(&a, &config, true).unwrap_err().to_string();
    assert!(
        err.contains("not UTF-8") && err.contains("items.jsonl"),
        "{err}"
    );
    assert_eq!(std::fs::read(a.join("items.jsonl")).unwrap(), log);
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// quick.toml's model and workloads with the matrix `configs` (TOML).
#[cfg(feature = "engine")]
fn quick_with(configs: &str) -> String {
    let text = std::fs::read_to_string(root().join("configs/quick.toml")).unwrap();
    let cut = text.find("[[config]]").unwrap();
    format!("{}{configs}", &text[..cut])
}

/// What only the model can tell (a group size against its head dim, a
/// context it lacks) stops the run before anything is measured, naming
/// the configuration; an earlier run in the folder stays resumable.
#[cfg(feature = "engine")]
#[test]
fn a_configuration_the_engine_refuses_stops_the_run_before_it_starts() {
    let dir = scratch("refused");
    let good = dir.join("good.toml");
    std::fs::write(&good, quick_with("[[config]]\nname = \"baseline\"\n")).unwrap();
    let out = dir.join("out");
    let first = quick(&out, &good, false).unwrap();
    assert_eq!((first.measured, first.failed), (7, 0));
    let log = std::fs::read_to_string(out.join("items.jsonl")).unwrap();
    let broken = dir.join("broken.toml");
    let cases = [
        // A group size that does not divide the head dim (32).
        (
            "[[config]]\nname = \"baseline\"\n\n[[config]]\nname = \"broken\"\ncold = { format = \"int4\", window = 32, group = 7 }\n",
            "config \"broken\": ",
        ),
        // A context and decode past the model's 2048 positions.
        (
            "[[config]]\nname = \"baseline\"\n",
            "exceed the model's context of 2048 tokens",
        ),
    ];
    for (i, (configs, needle)) in cases.iter().enumerate() {
        let mut src = quick_with(configs);
        if i == 1 {
            src = src.replace("contexts = [384]", "contexts = [2046]");
        }
        std::fs::write(&broken, src).unwrap();
        let err = format!("{:#}", quick(&out, &broken, false).unwrap_err());
        assert!(err.contains(needle) && !err.contains('\n'), "{err}");
    }
    // Nothing was measured or overwritten: the first run resumes as is.
    assert_eq!(
        std::fs::read_to_string(out.join("items.jsonl")).unwrap(),
        log
    );
    let again = quick(&out, &good, true).unwrap();
    assert_eq!((again.measured, again.failed), (0, 0));
    std::fs::remove_dir_all(dir).unwrap();
}

/// An item that fails while it runs (here the stream outgrows a 1 MiB
/// budget) is recorded, the other items and configurations still run, and
/// the binary exits non-zero saying how many failed.
#[cfg(feature = "engine")]
#[test]
fn a_failing_item_is_recorded_the_others_run_and_the_exit_is_non_zero() {
    let dir = scratch("fail");
    // 8 layers × 4 KV heads × 32 dims × K and V in f16: 4 KiB per token,
    // so 1 MiB holds 256 tokens, less than the 384-token stream.
    let src = quick_with(
        "[[config]]\nname = \"baseline\"\n\n[[config]]\nname = \"tight\"\nbudget_mib = 1\n",
    )
    .replace(
        "layers = 2, heads = 4, kv_heads = 2",
        "layers = 8, heads = 4, kv_heads = 4",
    );
    let config = dir.join("tight.toml");
    std::fs::write(&config, src).unwrap();
    let out = dir.join("out");
    let (code, err) = ablate(&[
        "--config",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{err}");
    let r = results(&out);
    let failed: Vec<_> = r
        .iter()
        .filter(|(_, row)| !row["error"].is_empty())
        .collect();
    assert!(!failed.is_empty(), "{r:?}");
    assert!(
        failed.iter().all(|((c, _, _), _)| c == "tight"),
        "{failed:?}"
    );
    assert_eq!(r.len(), 14, "every item of both configurations ran");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with(&format!(
            "ablate: {} of the 14 items measured failed",
            failed.len()
        )),
        "{err}"
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("## Failures"), "{md}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs the binary from the project root; returns exit code and stderr.
#[cfg(feature = "engine")]
fn ablate(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ablate"))
        .arg("--no-progress")
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(feature = "engine")]
#[test]
fn bad_input_is_one_line_and_a_non_zero_exit() {
    let dir = scratch("bad");
    let quick = std::fs::read_to_string(root().join("configs/quick.toml")).unwrap();
    let write = |name: &str, text: &str| -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let malformed = write("malformed.toml", "name = \"x\"\n[model\n");
    let unknown = write(
        "unknown.toml",
        &quick.replace(
            "name = \"int2\"",
            "name = \"int2\"\nlsh = { threshold = 0.9 }",
        ),
    );
    let no_data = write(
        "no-data.toml",
        &quick.replace("data/PaulGrahamEssays", "data/NoSuchEssays"),
    );
    let escaped = write(
        "escaped.toml",
        &quick.replace("name = \"int2\"", "name = \"../../../escaped\""),
    );
    let threads = write(
        "threads.toml",
        &quick.replace("seed = 7", "seed = 7\nthreads = 2000"),
    );
    let budget = write(
        "budget.toml",
        &quick.replace(
            "name = \"int2\"",
            "name = \"int2\"\nbudget_mib = 17592186044416",
        ),
    );
    let devzero = write(
        "devzero.toml",
        &quick.replace("data/exllamav2/wiki.utf8", "/dev/zero"),
    );
    let never_cold = write(
        "never-cold.toml",
        &quick.replace(
            "cold = { format = \"int2\", window = 32, sink = 16 }",
            "cold = { format = \"int2\", window = 65536, sink = 16 }",
        ),
    );
    let never_drops = write(
        "never-drops.toml",
        &quick.replace(
            "lifecycle = { policy = \"constrained\", protect = 1, delay = 1 }",
            "lifecycle = { policy = \"constrained\", protect = 4294967295, delay = 1 }",
        ),
    );
    let a_file = write("a-file", "");
    let out = dir.join("out");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--config", "/dev/zero"],
            "/dev/zero: not a regular file",
        ),
        (
            vec!["--config", &escaped],
            "config name \"../../../escaped\"",
        ),
        (
            vec!["--config", &threads],
            "model.threads = 2000 must be between 0",
        ),
        (
            vec!["--config", &budget],
            "budget_mib = 17592186044416 is too large",
        ),
        (
            vec!["--config", &devzero],
            "cannot read /dev/zero: not a regular file",
        ),
        (
            vec!["--config", &never_cold],
            "config \"int2\": cold sink 16 + window 65536 cover the model's whole context",
        ),
        (
            vec!["--config", &never_drops],
            "it would never drop anything",
        ),
        (
            vec!["--quick", "--out", &a_file],
            "exists and is not a folder",
        ),
        (
            vec!["--config", "/nonexistent/x.toml"],
            "/nonexistent/x.toml",
        ),
        (vec!["--config", &malformed], "malformed.toml:2:"),
        (vec!["--config", &unknown], "unknown field `lsh`"),
        (
            vec!["--config", &no_data],
            "data/NoSuchEssays is missing: `cargo xtask setup` installs it",
        ),
        (vec!["--bogus"], "unknown argument \"--bogus\""),
        (vec!["--quick", "--full"], "give one of"),
        (vec!["--config"], "--config needs a file"),
        (
            vec!["--quick", "--resume", "--out", out.to_str().unwrap()],
            "no earlier run",
        ),
    ];
    for (args, needle) in cases {
        let (code, err) = ablate(&args);
        assert_ne!(code, 0, "{args:?}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(
            lines[0].starts_with("ablate: ") && lines[0].contains(needle),
            "{args:?}: {err}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}
