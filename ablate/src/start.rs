//! What a run does before its first item: the input files present, the
//! model loaded, settings that could never act refused, and what an
//! earlier run of the same file left for `--resume`.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use kvforge_engine::{Device, Llama, LlamaConfig, Tokenizer};

use crate::config::Experiment;
use crate::items::{Item, WORKLOADS};
use crate::record::Record;

/// The records of the earlier run in `out` of this very experiment file
/// (`text`), for `--resume`.
pub(crate) fn resumed(config: &Path, text: &str, out: &Path) -> Result<Vec<Record>> {
    let stamp = out.join("experiment.toml");
    match kvforge_engine::input::read_text(&stamp, kvforge_engine::input::MAX_CONFIG_BYTES) {
        Ok(old) if old == text => load_records(&out.join("items.jsonl")),
        Ok(_) => bail!(
            "{} changed since the run in {}; run without --resume to start over",
            config.display(),
            out.display()
        ),
        Err(_) => bail!("--resume: no earlier run in {}", out.display()),
    }
}

/// The (configuration, workload) pairs `records` hold every item of,
/// none failed. The unit of resumption is one workload of one
/// configuration: its items share an engine (a later chat reuses what an
/// earlier one cached), so a workload cut short runs again from its first
/// item.
pub(crate) fn completed(
    exp: &Experiment,
    items: &[Item],
    records: &[Record],
) -> BTreeSet<(String, String)> {
    let group_items = |w: &str| items.iter().filter(|i| i.workload == w).count();
    let mut done = BTreeSet::new();
    for m in exp.matrix() {
        for w in WORKLOADS {
            if !exp.runs(m.name(), w) {
                continue;
            }
            let ok = records
                .iter()
                .filter(|r| r.config == m.name() && r.workload == w && r.error.is_none())
                .count();
            if ok > 0 && ok == group_items(w) {
                done.insert((m.name().to_string(), w.to_string()));
            }
        }
    }
    done
}

/// Drops from `records` what a resume does not keep (the groups not in
/// `done`) and rewrites the log at `items_path` to what is left.
pub(crate) fn keep_completed(
    records: &mut Vec<Record>,
    done: &BTreeSet<(String, String)>,
    items_path: &Path,
) -> Result<()> {
    records.retain(|r| done.contains(&(r.config.clone(), r.workload.clone())));
    let kept: String = records
        .iter()
        .map(|r| serde_json::to_string(r).map(|l| l + "\n"))
        .collect::<Result<_, _>>()?;
    std::fs::write(items_path, kept).with_context(|| format!("writing {}", items_path.display()))
}

/// A mechanism whose setting means it can never act on this model or
/// these chats (a cold window or an eviction window as long as the
/// context, a lifecycle that protects every turn) is refused: it would
/// silently measure the full cache under its name (F14).
pub(crate) fn check_engages(exp: &Experiment, max_ctx: usize) -> Result<(), String> {
    use kvforge_engine::mechanisms::LifecycleSpec;
    // Turns before the recall question: what a lifecycle must drop from
    // to change the answer.
    let turns = exp.workloads.chat.as_ref().map(|c| c.turns as u64);
    for m in exp.matrix() {
        let name = m.name();
        // A tier policy replaces the window and sink it would check.
        if let Some(q) = m.cold.as_ref().filter(|_| m.tier.is_none())
            && q.sink.saturating_add(q.window) >= max_ctx
        {
            return Err(format!(
                "config {name:?}: cold sink {} + window {} cover the model's whole context of {max_ctx} tokens: nothing would ever be quantized",
                q.sink, q.window
            ));
        }
        if let Some(e) = &m.eviction {
            let get = |k: &str| e.params.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
            if get("sink").saturating_add(get("window")) >= max_ctx as u64 {
                return Err(format!(
                    "config {name:?}: eviction sink + window cover the model's whole context of {max_ctx} tokens: nothing would ever be evicted"
                ));
            }
        }
        // Turns a lifecycle never drops: the first and the newest `keep`,
        // or the newest `protect` rounds.
        let kept = match m.lifecycle {
            Some(LifecycleSpec::RecentTurns { keep }) => Some(u64::from(keep).saturating_add(1)),
            Some(
                LifecycleSpec::Rule { protect, .. }
                | LifecycleSpec::Free { protect, .. }
                | LifecycleSpec::Constrained { protect, .. },
            ) => Some(u64::from(protect)),
            None => None,
        };
        if let (Some(kept), Some(turns)) = (kept, turns)
            && kept >= turns
            && exp.runs(name, "chat")
        {
            return Err(format!(
                "config {name:?}: the lifecycle keeps {kept} turns of chats of {turns} before the recall question: it would never drop anything"
            ));
        }
    }
    Ok(())
}

/// The most `items.jsonl` may hold for `--resume`: 4 GiB.
const MAX_LOG_BYTES: u64 = 4 << 30;

/// Every input file exists, or one line saying which setup step installs it.
pub(crate) fn check_inputs(exp: &Experiment) -> Result<()> {
    let need = |p: &Path, what: &str| -> Result<()> {
        if !p.exists() {
            bail!("{} is missing: {what}", p.display());
        }
        Ok(())
    };
    need(
        &exp.model.path,
        "`cargo xtask setup` installs the default model into models/",
    )?;
    let w = &exp.workloads;
    if let Some(c) = &w.chat {
        need(
            &c.data,
            "`cargo xtask setup` installs it (the chitchat-dataset data package)",
        )?;
    }
    if let Some(s) = &w.stream {
        need(
            &s.data,
            "`cargo xtask setup` installs it (exllamav2's wiki.utf8 calibration text)",
        )?;
    }
    if let Some(p) = &w.passkey {
        need(
            &p.data,
            "`cargo xtask setup` installs it (the Paul Graham essays data package)",
        )?;
    }
    Ok(())
}

/// The items an earlier run logged; none when there is no log. A log
/// that cannot be read (not UTF-8, a folder) is an error, not "nothing
/// measured": a resume must not silently measure everything again.
fn load_records(path: &Path) -> Result<Vec<Record>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let bad = |why: String| anyhow::anyhow!("--resume: {why}; fix or remove it to start over");
    let bytes = kvforge_engine::input::read_bytes(path, MAX_LOG_BYTES).map_err(bad)?;
    let lines: Vec<&[u8]> = bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        // The last line may be cut short by an interrupt or a full disk,
        // even inside a character: skip it; any other bad line is an error.
        let parsed = std::str::from_utf8(line)
            .map_err(|e| format!("not UTF-8 text ({e})"))
            .and_then(|l| serde_json::from_str::<Record>(l).map_err(|e| e.to_string()));
        match parsed {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => return Err(bad(format!("{}:{}: {e}", path.display(), i + 1))),
        }
    }
    Ok(out)
}

pub(crate) fn load_model(exp: &Experiment) -> Result<(Llama, Tokenizer)> {
    let g = kvforge_engine::gguf::GgufFile::open(&exp.model.path)?;
    let tok = Tokenizer::from_gguf(&g)?;
    let kind = kvforge_engine::Kind::Float;
    let model = match exp.model.random {
        Some(r) => {
            if r.heads == 0 || r.d_model % r.heads != 0 {
                bail!(
                    "model.random: d_model {} is not a multiple of heads {}",
                    r.d_model,
                    r.heads
                );
            }
            let cfg = LlamaConfig {
                vocab: tok.vocab,
                d_model: r.d_model,
                n_layers: r.layers,
                n_heads: r.heads,
                n_kv_heads: r.kv_heads,
                head_dim: r.d_model / r.heads,
                ffn: r.ffn,
                rms_eps: 1e-5,
                rope_theta: 10_000.0,
                max_ctx: r.max_ctx,
            };
            Llama::random(cfg, exp.model.seed as i64, Device::Cpu, kind)?
        }
        None => Llama::from_gguf(&g, Device::Cpu, kind)?,
    };
    let weights = kvforge_engine::parse_dtype(&exp.model.weights)?;
    let model = if weights == model.kind() {
        model
    } else {
        model.with_weight_kind(weights)?
    };
    Ok((model, tok))
}
