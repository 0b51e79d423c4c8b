//! The one way a bench program writes its results: CSV tables, Markdown
//! reports and PNG plots in one directory, each report closed by the
//! commit, machine and command line that produced it, so a number in
//! `docs/results` can always be traced back to a run.
//!
//! ```no_run
//! use kvforge_ablate::output::{Csv, Output};
//!
//! let mut out = Output::create("target/example")?;
//! let mut csv = Csv::new(&["context", "ppl"]);
//! csv.row([4096.to_string(), format!("{:.4}", 11.2)]);
//! out.csv("sweep.csv", &csv)?;
//! out.report("# Example\n\nOne row.\n")?; // report.md, provenance appended
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Where and how a run happened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provenance {
    /// `git rev-parse --short=12 HEAD` of the workspace, `-dirty` when
    /// tracked files differ from it, `unknown` outside a checkout.
    pub commit: String,
    /// Cores, CPU model, GPU.
    pub machine: String,
    /// The program and its arguments, shell-quoted.
    pub command: String,
}

impl Provenance {
    /// This process: the workspace this binary was built from, this
    /// machine, this command line.
    pub fn capture() -> Provenance {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap_or(Path::new("."));
        Provenance {
            commit: commit(root),
            machine: machine(),
            command: command_line(std::env::args()),
        }
    }

    /// One Markdown line naming all three.
    pub fn line(&self) -> String {
        format!(
            "Measured at commit `{}` on {}, by `{}`.",
            self.commit, self.machine, self.command
        )
    }
}

/// An output folder is a folder or does not exist yet.
pub fn check_folder(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        bail!(
            "output folder {}: exists and is not a folder",
            dir.display()
        );
    }
    Ok(())
}

/// The commit checked out at `root` (`-dirty` when tracked files changed).
pub fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .current_dir(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        }
        None => "unknown".into(),
    }
}

/// Cores, the CPU's model name and whether a GPU is there (and unused:
/// every program but `gpu_check` runs on the CPU).
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{cores} cores ({cpu}), {}", gpu())
}

fn gpu() -> String {
    match kvforge_engine::cuda_devices() {
        0 => "no GPU".into(),
        n => format!("{n} CUDA device(s)"),
    }
}

/// `args` as one shell-quoted line, the program by its file name.
fn command_line(args: impl IntoIterator<Item = String>) -> String {
    let mut words = Vec::new();
    for (i, a) in args.into_iter().enumerate() {
        let a = if i == 0 {
            Path::new(&a)
                .file_name()
                .map_or(a.clone(), |f| f.to_string_lossy().into_owned())
        } else {
            a
        };
        let plain = !a.is_empty()
            && a.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
        words.push(if plain {
            a
        } else {
            format!("'{}'", a.replace('\'', r"'\''"))
        });
    }
    words.join(" ")
}

/// A CSV table: a header, then rows of as many fields, each quoted when
/// it holds a comma, a quote or a line break (RFC 4180).
#[derive(Clone, Debug)]
pub struct Csv {
    columns: usize,
    text: String,
    /// The first row whose field count did not match the header.
    bad_row: Option<(usize, usize)>,
    rows: usize,
}

impl Csv {
    /// An empty table under `header`.
    pub fn new(header: &[&str]) -> Csv {
        let mut c = Csv {
            columns: header.len(),
            text: String::new(),
            bad_row: None,
            rows: 0,
        };
        c.push(header.iter().copied());
        c.rows = 0;
        c
    }

    /// Appends one row (written as given: format numbers before).
    pub fn row<S: AsRef<str>>(&mut self, fields: impl IntoIterator<Item = S>) -> &mut Csv {
        self.push(fields);
        self
    }

    fn push<S: AsRef<str>>(&mut self, fields: impl IntoIterator<Item = S>) {
        let mut n = 0;
        for f in fields {
            if n > 0 {
                self.text.push(',');
            }
            let f = f.as_ref();
            if f.contains([',', '"', '\n', '\r']) {
                let _ = write!(self.text, "\"{}\"", f.replace('"', "\"\""));
            } else {
                self.text.push_str(f);
            }
            n += 1;
        }
        self.text.push('\n');
        self.rows += 1;
        if n != self.columns && self.bad_row.is_none() {
            self.bad_row = Some((self.rows, n));
        }
    }

    /// Rows so far (the header not counted).
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The table as CSV text; an error if a row had the wrong number of
    /// fields.
    pub fn text(&self) -> Result<&str> {
        if let Some((row, n)) = self.bad_row {
            bail!("row {row} has {n} fields, the header {}", self.columns);
        }
        Ok(&self.text)
    }
}

/// One output directory: every file a program writes goes through it.
#[derive(Debug)]
pub struct Output {
    dir: PathBuf,
    provenance: Provenance,
    started: Instant,
    files: Vec<String>,
}

impl Output {
    /// `dir`, created if missing, for this process's run.
    pub fn create(dir: impl Into<PathBuf>) -> Result<Output> {
        Output::with_provenance(dir, Provenance::capture())
    }

    /// `dir` for a run described by `provenance`.
    pub fn with_provenance(dir: impl Into<PathBuf>, provenance: Provenance) -> Result<Output> {
        let dir = dir.into();
        check_folder(&dir)?;
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the output folder {}", dir.display()))?;
        Ok(Output {
            dir,
            provenance,
            started: Instant::now(),
            files: Vec::new(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where and how this run happened.
    pub fn provenance(&self) -> &Provenance {
        &self.provenance
    }

    /// Writes `text` to `name` in the directory.
    pub fn file(&mut self, name: &str, text: &str) -> Result<PathBuf> {
        let path = self.dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        self.note(name);
        Ok(path)
    }

    /// Writes the table `csv` to `name`.
    pub fn csv(&mut self, name: &str, csv: &Csv) -> Result<PathBuf> {
        let text = csv.text().with_context(|| name.to_string())?;
        self.file(name, text)
    }

    /// A PNG at `name`, drawn by `draw` (a [`crate::plot`] function) at
    /// the path it is given.
    pub fn png(&mut self, name: &str, draw: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
        let path = self.dir.join(name);
        draw(&path).with_context(|| format!("plotting {}", path.display()))?;
        self.note(name);
        Ok(path)
    }

    /// Writes `report.md`: `md`, then where and how it was measured and
    /// the files written so far.
    pub fn report(&mut self, md: &str) -> Result<PathBuf> {
        self.report_as("report.md", md)
    }

    /// [`report`](Self::report) under another name.
    pub fn report_as(&mut self, name: &str, md: &str) -> Result<PathBuf> {
        let mut text = md.trim_end().to_string();
        let _ = write!(
            text,
            "\n\n---\n\n{} This run took {:.0} s",
            self.provenance.line(),
            self.started.elapsed().as_secs_f64()
        );
        let others: Vec<&str> = self
            .files
            .iter()
            .map(String::as_str)
            .filter(|f| *f != name)
            .collect();
        if others.is_empty() {
            text.push_str(".\n");
        } else {
            let _ = writeln!(text, "; it also wrote `{}`.", others.join("`, `"));
        }
        self.file(name, &text)
    }

    fn note(&mut self, name: &str) {
        if !self.files.iter().any(|f| f == name) {
            self.files.push(name.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn fields_are_quoted_only_when_they_must_be() {
        let mut c = Csv::new(&["name", "value"]);
        c.row(["plain", "1.5"]).row(["a, b", "say \"hi\""]);
        assert_eq!(
            c.text().unwrap(),
            "name,value\nplain,1.5\n\"a, b\",\"say \"\"hi\"\"\"\n"
        );
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_row_of_the_wrong_width_is_an_error_when_written() {
        let mut c = Csv::new(&["a", "b"]);
        c.row(["1", "2"]).row(["3"]);
        let e = c.text().unwrap_err().to_string();
        assert_eq!(e, "row 2 has 1 fields, the header 2");
    }

    #[test]
    fn the_command_line_is_shell_quoted() {
        let args = [
            "/x/target/release/quant_sweep",
            "--contexts",
            "512,1024",
            "it's",
            "",
        ];
        assert_eq!(
            command_line(args.map(String::from)),
            r"quant_sweep --contexts 512,1024 'it'\''s' ''"
        );
    }

    #[test]
    fn a_report_names_its_provenance_and_the_other_files() {
        let dir = std::env::temp_dir().join(format!("kvforge-output-{}", std::process::id()));
        let prov = Provenance {
            commit: "abc".into(),
            machine: "2 cores (test), no GPU".into(),
            command: "bench --flag 1".into(),
        };
        let mut out = Output::with_provenance(&dir, prov).unwrap();
        let mut c = Csv::new(&["x"]);
        c.row(["1"]);
        out.csv("t.csv", &c).unwrap();
        let p = out.report("# R\n\nbody\n").unwrap();
        let text = std::fs::read_to_string(p).unwrap();
        assert!(text.starts_with("# R\n\nbody\n\n---\n\n"), "{text}");
        assert!(
            text.contains(
                "Measured at commit `abc` on 2 cores (test), no GPU, by `bench --flag 1`."
            ),
            "{text}"
        );
        assert!(
            text.trim_end().ends_with("it also wrote `t.csv`."),
            "{text}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("t.csv")).unwrap(),
            "x\n1\n"
        );
        let mut bad = Csv::new(&["x", "y"]);
        bad.row(["1"]);
        let e = out.csv("bad.csv", &bad).unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            "bad.csv: row 1 has 1 fields, the header 2"
        );
        assert!(!dir.join("bad.csv").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
