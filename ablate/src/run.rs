//! Runs an experiment: every configuration of the matrix on every
//! workload, one item at a time, each item appended to `items.jsonl` as it
//! finishes (so an interrupted run keeps what it measured, and `--resume`
//! skips the workloads it completed), the report rewritten after each
//! configuration. The items and their inputs are in [`items`](crate::items),
//! how one engine measures an item in `runner.rs`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_engine::{Llama, Tokenizer};

use crate::config::{Experiment, Mechanisms};
use crate::export::{export_inputs, export_passkey};
use crate::items::{Inputs, Item, WORKLOADS, check_fits, item_seed};
use crate::output::{Output, Provenance};
use crate::record::Record;
use crate::report::{self, RunInfo};
use crate::runner::Runner;
use crate::start::{check_engages, check_inputs, completed, keep_completed, load_model, resumed};
use crate::target::Sizes;

/// What to run and where.
#[derive(Clone, Debug)]
pub struct Options {
    /// The experiment file.
    pub config: PathBuf,
    /// Output folder (default `target/ablate/<name>`).
    pub out: Option<PathBuf>,
    /// Keep the items an earlier run of the same file measured.
    pub resume: bool,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// What relative paths in the experiment file (and the default output
    /// folder) are relative to: the project root.
    pub root: PathBuf,
    /// What the file's policy names are built by: [`registry`](crate::registry),
    /// or one that knows more (the Python package's builds Python classes).
    pub registry: kvforge_engine::Registry,
}

/// What a run did: where its report is, how many items it measured and
/// how many of those failed (their errors are in the report).
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The output folder.
    pub out: PathBuf,
    /// Items measured by this invocation (a resumed run skips the rest).
    pub measured: usize,
    /// Of those, the items that failed.
    pub failed: usize,
}

/// Runs the experiment of `opts`.
pub fn run(opts: &Options) -> Result<Outcome> {
    let started = Instant::now();
    // Read once: what is parsed is what the stamp keeps.
    let (mut exp, text) = Experiment::read(&opts.config, opts.registry.clone())?;
    exp.rebase(&opts.root);
    check_inputs(&exp)?;
    let out = out_folder(opts, &exp);
    crate::output::check_folder(&out)?;
    let items_path = out.join("items.jsonl");
    let mut records = match opts.resume {
        true => resumed(&opts.config, &text, &out)?,
        false => Vec::new(),
    };
    let provenance = Provenance {
        commit: crate::output::commit(&opts.root),
        ..Provenance::capture()
    };
    let mut output = Output::with_provenance(&out, provenance)?;
    let mut info = RunInfo {
        config_path: opts.config.display().to_string(),
        config_text: text.clone(),
        wall_secs: 0.0,
    };
    kvforge_engine::set_cpu_threads(exp.model.threads);
    let (model, tok) = load_model(&exp)?;
    let inputs = Inputs::load(&exp, &tok, model.cfg.max_ctx)?;
    // Whatever the file check could not see without the model (a group
    // size against the head dim, a context the model lacks) fails here,
    // before anything runs, not as a report full of failed items.
    check_fits(&inputs, &tok, model.cfg.max_ctx)?;
    check_engages(&exp, model.cfg.max_ctx)
        .map_err(|e| anyhow::anyhow!("{}: {e}", opts.config.display()))?;
    let sizes = probe(&exp, &model, &tok, &opts.config)?;
    let items = inputs.items();
    export_passkey(&inputs, &items, &tok, &out)?;
    export_inputs(&inputs, &items, &tok, &out)?;
    // Only now is the stamp written: a run that could not start leaves an
    // earlier run's folder resumable.
    write_file(&out.join("experiment.toml"), &text)?;
    let done = completed(&exp, &items, &records);
    keep_completed(&mut records, &done, &items_path)?;
    // What is left: for each configuration and workload, its items.
    let todo = |m: &Mechanisms, w: &str| -> Vec<&Item> {
        items
            .iter()
            .filter(|i| {
                i.workload == w
                    && exp.runs(m.name(), w)
                    && !done.contains(&(m.name().to_string(), w.to_string()))
            })
            .collect()
    };
    let count = exp
        .matrix()
        .iter()
        .flat_map(|m| WORKLOADS.map(|w| todo(m, w).len()))
        .sum::<usize>();
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&items_path)
        .with_context(|| format!("opening {}", items_path.display()))?;
    let mut measure = Measure {
        exp: &exp,
        model: &model,
        tok: &tok,
        inputs: &inputs,
        sizes: &sizes,
        commit: output.provenance().commit.clone(),
        log,
        items_path,
        bar: progress_bar(opts.progress, count),
        measured: 0,
        failed: 0,
    };
    for m in exp.matrix() {
        for workload in WORKLOADS {
            let mine = todo(m, workload);
            if mine.is_empty() {
                continue;
            }
            // The configuration's metrics after the workload, as a
            // scraper would see them.
            if let Some(text) = measure.workload(&mut records, m, workload, &mine)? {
                let path = out.join(format!("metrics/{}-{workload}.prom", m.name()));
                write_file(&path, &text)?;
            }
        }
        info.wall_secs = started.elapsed().as_secs_f64();
        report::write(&mut output, &exp, &records, &info)?;
    }
    measure.bar.finish_and_clear();
    info.wall_secs = started.elapsed().as_secs_f64();
    report::write(&mut output, &exp, &records, &info)?;
    Ok(Outcome {
        out,
        measured: measure.measured,
        failed: measure.failed,
    })
}

/// `--out`, or `target/ablate/<name>` under the root.
fn out_folder(opts: &Options, exp: &Experiment) -> PathBuf {
    opts.out.clone().unwrap_or_else(|| {
        let dir = Path::new("target/ablate").join(&exp.name);
        if opts.root == Path::new(".") {
            dir
        } else {
            opts.root.join(dir)
        }
    })
}

/// Each configuration's engine once, as a check (of `config`, the
/// experiment file); its block sizes are what a `target_kv` is resolved
/// with.
fn probe(
    exp: &Experiment,
    model: &Llama,
    tok: &Tokenizer,
    config: &Path,
) -> Result<BTreeMap<String, Sizes>> {
    let mut sizes = BTreeMap::new();
    for m in exp.matrix() {
        match Runner::new(exp, m, model, tok) {
            Ok(r) => sizes.insert(m.name().to_string(), r.sizes()),
            Err(e) => bail!("{}: config {:?}: {e:#}", config.display(), m.name()),
        };
    }
    Ok(sizes)
}

/// Writes `text` to `path`, creating its folder.
fn write_file(path: &Path, text: &str) -> Result<()> {
    path.parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(path, text))
        .with_context(|| format!("writing {}", path.display()))
}

fn progress_bar(shown: bool, items: usize) -> ProgressBar {
    let bar = if shown {
        ProgressBar::new(items as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} items {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// What the item loop reads, and where it logs each item it measured.
struct Measure<'a> {
    exp: &'a Experiment,
    model: &'a Llama,
    tok: &'a Tokenizer,
    inputs: &'a Inputs,
    /// Each configuration's block sizes, from its probe engine.
    sizes: &'a BTreeMap<String, Sizes>,
    commit: String,
    log: std::fs::File,
    items_path: PathBuf,
    bar: ProgressBar,
    measured: usize,
    failed: usize,
}

impl<'a> Measure<'a> {
    /// Runs configuration `m` on `items` of `workload`, appending each
    /// record to the log and to `records` as it finishes; returns the
    /// metrics (Prometheus' text) of the engine of its last sizing.
    fn workload(
        &mut self,
        records: &mut Vec<Record>,
        m: &Mechanisms,
        workload: &'static str,
        items: &[&Item],
    ) -> Result<Option<String>> {
        // One engine per sizing: items that resolve `target_kv` alike
        // share it (a later chat reuses what an earlier one cached).
        let mut runners: Vec<(Mechanisms, Result<Runner<'a>, String>)> = Vec::new();
        for &item in items {
            self.bar
                .set_message(format!("{} · {} {}", m.name(), workload, item.name));
            let t0 = Instant::now();
            let got = self.sized(records, m, item).and_then(|(sized, knob)| {
                let at = match runners.iter().position(|(r, _)| *r == sized) {
                    Some(i) => i,
                    None => {
                        let r = Runner::new(self.exp, &sized, self.model, self.tok)
                            .map_err(|e| format!("{e:#}"));
                        runners.push((sized, r));
                        runners.len() - 1
                    }
                };
                let mut rec = match &mut runners[at].1 {
                    Ok(r) => r.item(self.inputs, item).map_err(|e| format!("{e:#}"))?,
                    Err(e) => return Err(e.clone()),
                };
                if let Some((t, tokens)) = knob {
                    rec.values.insert("target_kv".into(), t);
                    rec.values.insert("knob_tokens".into(), tokens as f64);
                }
                Ok(rec)
            });
            let mut rec = match got {
                Ok(rec) => rec,
                Err(e) => Record {
                    error: Some(e.replace('\n', " ")),
                    ..Record::default()
                },
            };
            rec.config = m.name().to_string();
            rec.workload = workload.into();
            rec.item = item.name.clone();
            rec.seed = item_seed(self.inputs, item);
            rec.secs = t0.elapsed().as_secs_f64();
            rec.commit = self.commit.clone();
            self.measured += 1;
            self.failed += usize::from(rec.error.is_some());
            let line = serde_json::to_string(&rec)?;
            writeln!(self.log, "{line}")
                .and_then(|()| self.log.flush())
                .with_context(|| format!("appending to {}", self.items_path.display()))?;
            records.push(rec);
            self.bar.inc(1);
        }
        Ok(match runners.last() {
            Some((_, Ok(r))) => Some(r.prometheus()),
            _ => None,
        })
    }

    /// `m` as it runs `item`: itself, or with `target_kv` resolved against
    /// the baseline's record of the item (and the target and knob's value
    /// to record).
    fn sized(
        &self,
        records: &[Record],
        m: &Mechanisms,
        item: &Item,
    ) -> Result<(Mechanisms, Option<(f64, usize)>), String> {
        let Some(t) = m.target_kv else {
            return Ok((m.clone(), None));
        };
        let full = full_bytes(records, self.exp.baseline(), item)?;
        let s = self.sizes[m.name()];
        let (sized, knob) =
            crate::target::resolve(m, t, full, s, step_blocks(self.exp, item, s.block))?;
        Ok((sized, Some((t, knob))))
    }
}

/// The KV bytes the baseline kept on `item` (once compressed:
/// [`iso::bytes`](crate::iso::bytes)), what a `target_kv` is a share of.
fn full_bytes(records: &[Record], base: &str, item: &Item) -> Result<u64, String> {
    records
        .iter()
        .find(|r| {
            r.config == base
                && r.workload == item.workload
                && r.item == item.name
                && r.error.is_none()
        })
        .map(|r| crate::iso::bytes(r).0)
        .filter(|b| b.is_finite() && *b > 0.0)
        .map(|b| b as u64)
        .ok_or_else(|| {
            format!(
                "target_kv: the baseline {base:?} has no measurement of {} (it failed or did not run)",
                item.name
            )
        })
}

/// Blocks the step an item's KV share is read after writes beyond what
/// the policies kept before it: a stream is read after each chunk (its
/// blocks; one more when chunks do not start on a block boundary); a chat
/// or a pass key after a decoded token (the block it lands in).
fn step_blocks(exp: &Experiment, item: &Item, block: usize) -> u64 {
    match (&exp.workloads.stream, item.workload) {
        (Some(s), "stream") if block > 0 => {
            let aligned = s.prefix % block == 0 && s.chunk % block == 0;
            (s.chunk.div_ceil(block) + usize::from(!aligned)) as u64
        }
        _ => 1,
    }
}
