//! Runs an experiment: every configuration of the matrix on every
//! workload, one item at a time, each item appended to `items.jsonl` as it
//! finishes (so an interrupted run keeps what it measured, and `--resume`
//! skips the workloads it completed), the report rewritten after each
//! configuration.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_engine::{
    CacheManager, Device, Engine, EngineConfig, Llama, LlamaConfig, Message, ReuseConfig,
    SamplingParams, Sequence, Tokenizer,
};

use crate::config::{ChatWorkload, Experiment, Mechanisms, PasskeyWorkload, StreamWorkload};
use crate::inputs::SplitMix;
use crate::output::{Output, Provenance};
use crate::record::Record;
use crate::report::{self, RunInfo};

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
    let (mut exp, text) = Experiment::read(&opts.config)?;
    exp.rebase(&opts.root);
    check_inputs(&exp)?;
    let out = opts.out.clone().unwrap_or_else(|| {
        let dir = Path::new("target/ablate").join(&exp.name);
        if opts.root == Path::new(".") {
            dir
        } else {
            opts.root.join(dir)
        }
    });
    crate::output::check_folder(&out)?;
    let items_path = out.join("items.jsonl");
    let stamp_path = out.join("experiment.toml");
    let mut records = Vec::new();
    if opts.resume {
        match kvforge_engine::input::read_text(&stamp_path, kvforge_engine::input::MAX_CONFIG_BYTES)
        {
            Ok(old) if old == text => records = load_records(&items_path)?,
            Ok(_) => bail!(
                "{} changed since the run in {}; run without --resume to start over",
                opts.config.display(),
                out.display()
            ),
            Err(_) => bail!("--resume: no earlier run in {}", out.display()),
        }
    }
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
    // Each configuration's engine once, as a check; its block sizes are
    // what a `target_kv` is resolved with.
    let mut sizes = BTreeMap::new();
    for m in exp.matrix() {
        match Runner::new(&exp, m, &model, &tok) {
            Ok(r) => sizes.insert(m.name().to_string(), r.sizes()),
            Err(e) => bail!("{}: config {:?}: {e:#}", opts.config.display(), m.name()),
        };
    }
    let items = inputs.items();
    export_passkey(&inputs, &items, &tok, &out)?;
    export_inputs(&inputs, &items, &tok, &out)?;
    // Only now is the stamp written: a run that could not start leaves an
    // earlier run's folder resumable.
    std::fs::write(&stamp_path, &text)
        .with_context(|| format!("writing {}", stamp_path.display()))?;
    // The unit of resumption is one workload of one configuration: its
    // items share an engine (a later chat reuses what an earlier one
    // cached), so a workload cut short runs again from its first item.
    let group_items = |w: &str| items.iter().filter(|i| i.workload == w).count();
    let mut done: std::collections::BTreeSet<(String, String)> = Default::default();
    for m in exp.matrix() {
        for w in ["chat", "stream", "passkey"] {
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
    records.retain(|r| done.contains(&(r.config.clone(), r.workload.clone())));
    let kept: String = records
        .iter()
        .map(|r| serde_json::to_string(r).map(|l| l + "\n"))
        .collect::<Result<_, _>>()?;
    std::fs::write(&items_path, kept)
        .with_context(|| format!("writing {}", items_path.display()))?;
    let todo: usize = exp
        .matrix()
        .iter()
        .map(|m| {
            items
                .iter()
                .filter(|i| {
                    exp.runs(m.name(), i.workload)
                        && !done.contains(&(m.name().to_string(), i.workload.to_string()))
                })
                .count()
        })
        .sum();
    let bar = if opts.progress {
        ProgressBar::new(todo as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} items {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut measured, mut failed) = (0, 0);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&items_path)
        .with_context(|| format!("opening {}", items_path.display()))?;
    for m in exp.matrix() {
        for workload in ["chat", "stream", "passkey"] {
            let mine: Vec<&Item> = items
                .iter()
                .filter(|i| {
                    i.workload == workload
                        && exp.runs(m.name(), workload)
                        && !done.contains(&(m.name().to_string(), workload.into()))
                })
                .collect();
            if mine.is_empty() {
                continue;
            }
            let target = m.target_kv;
            // One engine per sizing: items that resolve `target_kv` alike
            // share it (a later chat reuses what an earlier one cached).
            let mut runners: Vec<(Mechanisms, Result<Runner, String>)> = Vec::new();
            for item in mine {
                bar.set_message(format!("{} · {} {}", m.name(), workload, item.name));
                let t0 = Instant::now();
                let sized = match target {
                    None => Ok((m.clone(), None)),
                    Some(t) => full_bytes(&records, exp.baseline(), item)
                        .and_then(|full| {
                            let s = sizes[m.name()];
                            crate::target::resolve(m, t, full, s, step_blocks(&exp, item, s.block))
                        })
                        .map(|(r, knob)| (r, Some((t, knob)))),
                };
                let got = sized.and_then(|(sized, knob)| {
                    let at = match runners.iter().position(|(r, _)| *r == sized) {
                        Some(i) => i,
                        None => {
                            let r = Runner::new(&exp, &sized, &model, &tok)
                                .map_err(|e| format!("{e:#}"));
                            runners.push((sized, r));
                            runners.len() - 1
                        }
                    };
                    let mut rec = match &mut runners[at].1 {
                        Ok(r) => r.item(&inputs, item).map_err(|e| format!("{e:#}"))?,
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
                rec.seed = item_seed(&inputs, item);
                rec.secs = t0.elapsed().as_secs_f64();
                rec.commit = output.provenance().commit.clone();
                measured += 1;
                failed += usize::from(rec.error.is_some());
                let line = serde_json::to_string(&rec)?;
                writeln!(log, "{line}")
                    .and_then(|()| log.flush())
                    .with_context(|| format!("appending to {}", items_path.display()))?;
                records.push(rec);
                bar.inc(1);
            }
            // The configuration's metrics after the workload, as a
            // scraper would see them.
            if let Some((_, Ok(r))) = runners.last() {
                let dir = out.join("metrics");
                let path = dir.join(format!("{}-{workload}.prom", m.name()));
                std::fs::create_dir_all(&dir)
                    .and_then(|()| {
                        std::fs::write(
                            &path,
                            kvforge_engine::metrics::prometheus(&r.manager.metrics()),
                        )
                    })
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        info.wall_secs = started.elapsed().as_secs_f64();
        report::write(&mut output, &exp, &records, &info)?;
    }
    bar.finish_and_clear();
    info.wall_secs = started.elapsed().as_secs_f64();
    report::write(&mut output, &exp, &records, &info)?;
    Ok(Outcome {
        out,
        measured,
        failed,
    })
}

/// A mechanism whose setting means it can never act on this model or
/// these chats (a cold window or an eviction window as long as the
/// context, a lifecycle that protects every turn) is refused: it would
/// silently measure the full cache under its name (F14).
fn check_engages(exp: &Experiment, max_ctx: usize) -> Result<(), String> {
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

/// The seed of `item`'s random choices (none for a stream).
fn item_seed(inputs: &Inputs, item: &Item) -> Option<u64> {
    match item.workload {
        "chat" => Some(chat_seed(inputs, item)),
        "passkey" => Some(passkey_seed(inputs, item)),
        _ => None,
    }
}

fn chat_seed(inputs: &Inputs, item: &Item) -> u64 {
    inputs.seed ^ item.index as u64
}

/// Greedy tokens of a pass-key answer.
const PASSKEY_ANSWER: usize = 8;

/// Every chat fits the model's context even if each answer runs to
/// `answer_tokens` (positions past the context fail the item mid-run).
fn check_fits(inputs: &Inputs, tok: &Tokenizer, max_ctx: usize) -> Result<()> {
    let Some((w, chats)) = &inputs.chat else {
        return Ok(());
    };
    for (i, chat) in chats.iter().enumerate() {
        // The system prompt and the first turn; the planted fact's sentence
        // (32 tokens cover it); the other turns, the recall question and
        // its primer; an answer after each.
        let first = [
            Message::new("system", SYSTEM),
            Message::new("user", &chat[0]),
        ];
        let mut need = tok.chat_ids(&first)?.len() + 32 + tok.encode_text(RECALL_PRIMER)?.len();
        for text in chat[1..]
            .iter()
            .map(String::as_str)
            .chain([RECALL_QUESTION])
        {
            need += tok.user_turn_ids(true, text)?.len();
        }
        need += w.answer_tokens * (chat.len() + 1);
        if need > max_ctx {
            bail!(
                "workloads.chat: chat {i} may need {need} positions (its turns plus answer_tokens = {} per answer), more than the model's context of {max_ctx} tokens",
                w.answer_tokens
            );
        }
    }
    Ok(())
}

/// The most `items.jsonl` may hold for `--resume`: 4 GiB.
const MAX_LOG_BYTES: u64 = 4 << 30;

/// Every input file exists, or one line saying which setup step installs it.
fn check_inputs(exp: &Experiment) -> Result<()> {
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

fn load_model(exp: &Experiment) -> Result<(Llama, Tokenizer)> {
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

/// One unit of work of a workload.
struct Item {
    workload: &'static str,
    name: String,
    /// Chat index, context length, or passkey (length, depth).
    index: usize,
    depth: f64,
    /// A stream's article.
    article: usize,
}

/// Token streams of the workloads, tokenized once.
struct Inputs {
    chat: Option<(ChatWorkload, Vec<Vec<String>>)>,
    /// One token stream per article, each as long as the longest context.
    stream: Option<(StreamWorkload, Vec<Vec<u32>>)>,
    passkey: Option<(PasskeyWorkload, Vec<u32>)>,
    seed: u64,
}

/// The first run of digits in `answer` (empty if none): what is scored.
fn first_number(answer: &str) -> String {
    answer
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect()
}

/// The last user turn of a chat, and the start of the answer.
const RECALL_QUESTION: &str = "What is my locker code?";
const RECALL_PRIMER: &str = "Your locker code is";

/// The system prompt every chat starts with (the shared prefix prefix
/// reuse finds across sessions).
const SYSTEM: &str = "You are SmolLM, a friendly assistant in a long conversation. Answer the user \
in one or two short sentences. Be warm and curious, and keep to the topic the user brings up. \
If the user tells you something about themselves, such as a name, a plan or a number, remember \
it exactly: they may ask for it later, and then you repeat it word for word. Do not invent facts \
about the user. If you do not know something, say so plainly. Never use lists or headings; write \
plain sentences. Do not repeat the question back. Do not greet the user again after the first turn.";

impl Inputs {
    fn load(exp: &Experiment, tok: &Tokenizer, max_ctx: usize) -> Result<Inputs> {
        let w = &exp.workloads;
        let chat = match &w.chat {
            Some(c) => Some((
                c.clone(),
                crate::inputs::load_chats(&c.data, c.turns, c.chats, c.turns..=usize::MAX)?,
            )),
            None => None,
        };
        let stream = match &w.stream {
            Some(s) => {
                let need = s.contexts.iter().copied().max().unwrap_or(0);
                if need.saturating_add(s.decode) > max_ctx {
                    bail!(
                        "workloads.stream: context {need} plus decode {} exceed the model's context of {max_ctx} tokens",
                        s.decode
                    );
                }
                let text = crate::inputs::read_text(&s.data)?;
                let mut articles = kvforge_engine::ppl::articles(&text).into_iter();
                let mut streams = Vec::new();
                for k in 0..s.articles {
                    let mut ids = Vec::new();
                    for a in articles.by_ref() {
                        ids.extend(tok.encode_text(&a)?);
                        if ids.len() >= need {
                            break;
                        }
                    }
                    if ids.len() < need {
                        bail!(
                            "{}: too little text for stream {} of {} ({} tokens left, a stream needs {need})",
                            s.data.display(),
                            k + 1,
                            s.articles,
                            ids.len()
                        );
                    }
                    ids.truncate(need);
                    streams.push(ids);
                }
                Some((s.clone(), streams))
            }
            None => None,
        };
        let passkey = match &w.passkey {
            Some(p) => {
                let need = p.lengths.iter().copied().max().unwrap_or(0);
                if need.saturating_add(PASSKEY_ANSWER) > max_ctx {
                    bail!(
                        "workloads.passkey: length {need} plus the {PASSKEY_ANSWER}-token answer exceed the model's context of {max_ctx} tokens"
                    );
                }
                Some((p.clone(), haystack(&p.data, tok, need)?))
            }
            None => None,
        };
        Ok(Inputs {
            chat,
            stream,
            passkey,
            seed: exp.model.seed,
        })
    }

    fn items(&self) -> Vec<Item> {
        let mut v = Vec::new();
        if let Some((_, chats)) = &self.chat {
            for i in 0..chats.len() {
                v.push(Item {
                    workload: "chat",
                    name: format!("chat{i}"),
                    index: i,
                    depth: 0.0,
                    article: 0,
                });
            }
        }
        if let Some((s, _)) = &self.stream {
            for article in 0..s.articles {
                for &c in &s.contexts {
                    v.push(Item {
                        workload: "stream",
                        // One article keeps the name it always had.
                        name: match s.articles {
                            1 => format!("ctx{c}"),
                            _ => format!("a{article}-ctx{c}"),
                        },
                        index: c,
                        depth: 0.0,
                        article,
                    });
                }
            }
        }
        if let Some((p, _)) = &self.passkey {
            for &l in &p.lengths {
                for &d in &p.depths {
                    v.push(Item {
                        workload: "passkey",
                        name: format!("len{l}-depth{d:.2}"),
                        index: l,
                        depth: d,
                        article: 0,
                    });
                }
            }
        }
        v
    }
}

/// One pass-key item's tokens: what is prefilled (compressed by the
/// cache's policies as it streams in), and the question asked after it.
pub struct PasskeyPrompt {
    /// The five-digit key.
    pub key: u64,
    /// Instructions, haystack with the needle at its depth.
    pub context: Vec<u32>,
    /// `What is the pass key? The pass key is` (a completion prompt).
    pub question: Vec<u32>,
}

impl PasskeyPrompt {
    /// What is prefilled (and compressed) and what is asked after it: the
    /// context and the question, or, when the compression is to see the
    /// question, everything but the question's last token and that token.
    pub fn split(&self, question_seen: bool) -> (Vec<u32>, Vec<u32>) {
        match self.question.split_last() {
            Some((last, head)) if question_seen => {
                let mut context = self.context.clone();
                context.extend_from_slice(head);
                (context, vec![*last])
            }
            _ => (self.context.clone(), self.question.clone()),
        }
    }
}

/// The pass-key item of `length` tokens (context and question) with the
/// needle at `depth` of the haystack `hay`; the key comes from `seed`.
pub fn passkey_prompt(
    tok: &Tokenizer,
    hay: &[u32],
    length: usize,
    depth: f64,
    seed: u64,
) -> Result<PasskeyPrompt> {
    let key = 10_000 + SplitMix::new(seed).next_u64() % 90_000;
    // A completion prompt (no chat template): SmolLM2-135M answers it,
    // it does not answer the same text as a chat turn.
    let head = tok.encode_text(
        "There is an important pass key hidden inside a lot of irrelevant text. \
         Find it and memorize it. I will quiz you about the pass key.\n",
    )?;
    let needle = tok.encode_text(&format!(
        "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    ))?;
    let question = tok.encode_text("\nWhat is the pass key? The pass key is")?;
    let fixed = head.len() + needle.len() + question.len();
    let Some(room) = length.checked_sub(fixed).filter(|&r| r > 0) else {
        bail!("a {length}-token prompt has no room for a haystack ({fixed} tokens of frame)");
    };
    let cut = ((room as f64) * depth).round() as usize;
    let mut context = head;
    context.extend(&hay[..cut]);
    context.extend(&needle);
    context.extend(&hay[cut..room]);
    Ok(PasskeyPrompt {
        key,
        context,
        question,
    })
}

/// Writes every pass-key item of the run (name, length, depth, key, context
/// and question token ids) to `passkey_items.jsonl` in `out`, so that
/// another implementation (`scripts/kvpress_passkey.py`) can run the very
/// same tokens.
fn export_passkey(inputs: &Inputs, items: &[Item], tok: &Tokenizer, out: &Path) -> Result<()> {
    let Some((w, hay)) = &inputs.passkey else {
        return Ok(());
    };
    let mut lines = String::new();
    for item in items.iter().filter(|i| i.workload == "passkey") {
        let p = passkey_prompt(tok, hay, item.index, item.depth, passkey_seed(inputs, item))?;
        let (context, question) = p.split(w.question_seen);
        let line = serde_json::json!({
            "item": item.name,
            "length": item.index,
            "depth": item.depth,
            "key": p.key.to_string(),
            "question_seen": w.question_seen,
            "context": context,
            "question": question,
        });
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    let path = out.join("passkey_items.jsonl");
    std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))
}

/// A chat's planted code and its user messages: the code in the second,
/// the recall question after the last.
fn chat_users(chat: &[String], seed: u64) -> (u64, Vec<String>) {
    let code = 1000 + SplitMix::new(seed).next_u64() % 9000;
    let mut users: Vec<String> = chat.to_vec();
    if let Some(second) = users.get_mut(1) {
        *second = format!("By the way, my locker code is {code}. Please remember it. {second}");
    }
    users.push(RECALL_QUESTION.into());
    (code, users)
}

/// Writes every item's seed and token ids to `inputs.jsonl` in `out`
/// (the same for every configuration): a chat's code and each user
/// message's ids (the answers between them are the model's own), a
/// stream's ids, a pass key's key, context and question.
fn export_inputs(inputs: &Inputs, items: &[Item], tok: &Tokenizer, out: &Path) -> Result<()> {
    let mut lines = String::new();
    for item in items {
        let seed = item_seed(inputs, item);
        let line = match item.workload {
            "chat" => {
                let (_, chats) = inputs.chat.as_ref().context("no chat workload")?;
                let (code, users) = chat_users(&chats[item.index], chat_seed(inputs, item));
                let ids = users
                    .iter()
                    .map(|u| tok.encode_text(u))
                    .collect::<Result<Vec<_>, _>>()?;
                serde_json::json!({"workload": "chat", "item": item.name, "seed": seed,
                    "code": code.to_string(), "system": SYSTEM, "users": ids})
            }
            "stream" => {
                let (_, ids) = inputs.stream.as_ref().context("no stream workload")?;
                serde_json::json!({"workload": "stream", "item": item.name,
                    "article": item.article, "tokens": &ids[item.article][..item.index]})
            }
            _ => {
                let (w, hay) = inputs.passkey.as_ref().context("no passkey workload")?;
                let p =
                    passkey_prompt(tok, hay, item.index, item.depth, passkey_seed(inputs, item))?;
                let (context, question) = p.split(w.question_seen);
                serde_json::json!({"workload": "passkey", "item": item.name, "seed": seed,
                    "key": p.key.to_string(), "context": context, "question": question})
            }
        };
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    let path = out.join("inputs.jsonl");
    std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))
}

/// The seed of a pass-key item's key.
fn passkey_seed(inputs: &Inputs, item: &Item) -> u64 {
    inputs.seed ^ (item.index as u64) << 8 ^ (item.depth * 1000.0) as u64
}

/// The essays of `dir` in name order, tokenized until `need` tokens.
fn haystack(dir: &Path, tok: &Tokenizer, need: usize) -> Result<Vec<u32>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut ids = Vec::new();
    for f in files {
        let text = crate::inputs::read_text(&f)?;
        ids.extend(tok.encode_text(&format!("{}\n\n", text.trim()))?);
        if ids.len() >= need {
            return Ok(ids);
        }
    }
    bail!(
        "{}: the essays hold fewer than {need} tokens",
        dir.display()
    )
}

/// The engine of one configuration for one workload.
struct Runner<'a> {
    manager: CacheManager,
    tok: &'a Tokenizer,
}

/// Engine and reuse configuration of `m` (its eviction policy built by
/// the bench's [`registry`](crate::registry)).
fn configure(exp: &Experiment, m: &Mechanisms) -> Result<(EngineConfig, ReuseConfig)> {
    let mut cfg = EngineConfig {
        weight_kind: None,
        kv_kind: Some(kvforge_engine::parse_dtype(crate::HOT_KV)?),
        block_size: exp.model.block_size,
        ..EngineConfig::default()
    };
    // The harness's own keys are resolved (or used) here, not by the engine.
    let m = Mechanisms {
        target_kv: None,
        workloads: None,
        ..m.clone()
    };
    let reuse = m
        .apply(&mut cfg, &crate::registry(), Some(exp.model.seed))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((cfg, reuse))
}

impl<'a> Runner<'a> {
    fn new(exp: &Experiment, m: &Mechanisms, model: &Llama, tok: &'a Tokenizer) -> Result<Self> {
        let (cfg, reuse) = configure(exp, m)?;
        let engine = Engine::new(model.share(), tok.clone(), &cfg)?;
        let manager = CacheManager::new(engine, reuse)?;
        Ok(Runner { manager, tok })
    }

    fn item(&mut self, inputs: &Inputs, item: &Item) -> Result<Record> {
        match item.workload {
            "chat" => {
                let (w, chats) = inputs.chat.as_ref().context("no chat workload")?;
                self.chat(w, &chats[item.index], chat_seed(inputs, item))
            }
            "stream" => {
                let (w, ids) = inputs.stream.as_ref().context("no stream workload")?;
                let mut r = self.stream(w, &ids[item.article][..item.index])?;
                r.values.insert("article".into(), item.article as f64);
                Ok(r)
            }
            _ => {
                let (w, hay) = inputs.passkey.as_ref().context("no passkey workload")?;
                self.passkey(w, hay, item.index, item.depth, passkey_seed(inputs, item))
            }
        }
    }

    /// Block sizes of its cache (hot, and cold when it has a cold tier).
    fn sizes(&self) -> crate::target::Sizes {
        let cache = &self.engine().cache();
        let t = cache.tier_stats();
        crate::target::Sizes {
            block: cache.block_size(),
            hot: t.first().map_or(0, |t| t.pool.block_bytes),
            cold: t.get(1).map(|t| t.pool.block_bytes),
        }
    }

    fn engine(&self) -> &Engine {
        self.manager.engine()
    }

    /// One conversation as one session: the planted fact in the second
    /// user message, the recall question after the last.
    fn chat(&self, w: &ChatWorkload, chat: &[String], seed: u64) -> Result<Record> {
        let tok = self.tok;
        let (code, users) = chat_users(chat, seed);
        let params = SamplingParams {
            max_tokens: w.answer_tokens,
            ..SamplingParams::default()
        };
        let before = self.manager.metrics();
        let id = self.manager.open_session("chat");
        let mut rec = Record::default();
        let mut closed = true;
        let mut peak_all: f64 = 0.0;
        let mut answer = String::new();
        let out = (|| -> Result<()> {
            for (t, text) in users.iter().enumerate() {
                let mut ids = if t == 0 {
                    tok.chat_ids(&[Message::new("system", SYSTEM), Message::new("user", text)])?
                } else {
                    tok.user_turn_ids(!closed, text)?
                };
                if t + 1 == users.len() {
                    // The answer's start is given, as in pass key retrieval.
                    ids.extend(tok.encode_text(RECALL_PRIMER)?);
                }
                let cache = &self.engine().cache();
                let mut peak = cache.bytes_in_use();
                let r = self.manager.turn(id, &ids, &params, &mut |_, _| {
                    peak = peak.max(cache.bytes_in_use());
                    true
                })?;
                closed = r.generation.stopped_at_eos;
                let m = self.manager.metrics();
                let now = cache.bytes_in_use();
                peak = peak.max(now);
                peak_all = peak_all.max(peak as f64);
                let tier = |i: usize| m["tiers"][i]["bytes_in_use"].as_f64().unwrap_or(0.0);
                let f = |a: &str, b: &str| m[a][b].as_f64().unwrap_or(0.0);
                rec.turns.push(BTreeMap::from([
                    ("prompt_tokens".into(), r.prompt_tokens as f64),
                    ("reused_tokens".into(), r.reused_tokens as f64),
                    ("new_tokens".into(), r.generation.tokens.len() as f64),
                    ("ttft_ms".into(), r.ttft_secs * 1e3),
                    ("kv_bytes".into(), now as f64),
                    ("peak_kv_bytes".into(), peak as f64),
                    ("hot_bytes".into(), tier(0)),
                    ("cold_bytes".into(), tier(1)),
                    ("index_hit_rate".into(), f("index", "hit_rate")),
                    ("evicted_entries".into(), f("policies", "evicted_entries")),
                    ("demoted_blocks".into(), f("policies", "demoted_blocks")),
                    (
                        "lifecycle_dropped_entries".into(),
                        f("policies", "lifecycle_dropped_entries"),
                    ),
                    ("shared_blocks".into(), f("sharing", "shared")),
                ]));
                if t + 1 == users.len() {
                    answer = tok.decode_text(&r.generation.tokens)?;
                }
            }
            Ok(())
        })();
        let closed_ok = self.manager.close_session(id);
        out?;
        closed_ok?;
        let after = self.manager.metrics();
        let delta = |k: &str| {
            after["index"][k].as_f64().unwrap_or(0.0) - before["index"][k].as_f64().unwrap_or(0.0)
        };
        let recalled = first_number(&answer) == code.to_string();
        rec.answer = Some(answer);
        let turns = rec.turns.len().max(1) as f64;
        let sum = |k: &str| {
            rec.turns
                .iter()
                .map(|t| t.get(k).copied().unwrap_or(0.0))
                .sum::<f64>()
        };
        rec.values = BTreeMap::from([
            ("turns".into(), rec.turns.len() as f64),
            ("peak_kv_bytes".into(), peak_all),
            ("mean_kv_bytes".into(), sum("peak_kv_bytes") / turns),
            ("recalled".into(), f64::from(u8::from(recalled))),
            ("index_hit_tokens".into(), delta("hit_tokens")),
            ("index_query_tokens".into(), delta("query_tokens")),
            (
                "prompt_tokens".into(),
                rec.turns.last().map_or(0.0, |t| t["prompt_tokens"]),
            ),
        ]);
        Ok(rec)
    }

    fn stream(&self, w: &StreamWorkload, ids: &[u32]) -> Result<Record> {
        let r = self
            .engine()
            .streaming_ppl(ids, w.prefix, w.chunk, w.decode)?;
        Ok(Record {
            values: BTreeMap::from([
                ("context".into(), ids.len() as f64),
                ("ppl".into(), r.ppl),
                ("nll_sum".into(), r.nll_sum),
                ("scored".into(), r.scored as f64),
                ("kv_bytes".into(), r.kv_bytes as f64),
                ("hot_bytes".into(), r.hot_bytes as f64),
                ("cold_bytes".into(), r.cold_bytes as f64),
                ("tok_s".into(), r.tokens_per_sec),
                ("decode_tok_s".into(), r.decode_tokens_per_sec),
                (
                    "dropped_chunks".into(),
                    r.chunks.iter().filter(|c| !c.1.is_finite()).count() as f64,
                ),
            ]),
            // A chunk whose NLL is not finite would not read back (JSON has
            // no NaN); it is left out, and a record that dropped one is
            // not paired chunk by chunk (`dropped_chunks`).
            chunks: r
                .chunks
                .iter()
                .filter(|c| c.1.is_finite())
                .map(|&(n, nll)| [n as f64, nll])
                .collect(),
            ..Record::default()
        })
    }

    fn passkey(
        &self,
        w: &PasskeyWorkload,
        hay: &[u32],
        length: usize,
        depth: f64,
        seed: u64,
    ) -> Result<Record> {
        let tok = self.tok;
        let prompt = passkey_prompt(tok, hay, length, depth, seed)?;
        let (key, (context, question)) = (prompt.key, prompt.split(w.question_seen));
        let engine = self.engine();
        let mut seq = Sequence::default();
        engine.cache().take_step_peak_bytes();
        let out = (|| -> Result<(String, u64, u64)> {
            let mut peak = 0;
            for piece in context.chunks(w.chunk) {
                let _last =
                    engine
                        .model()
                        .forward(piece, &mut engine.cache().view(&mut seq), false)?;
                peak = peak.max(engine.cache().bytes_in_use());
            }
            let params = SamplingParams {
                max_tokens: PASSKEY_ANSWER,
                ..SamplingParams::default()
            };
            let g = engine.generate(&mut seq, &question, &params, &mut |_, _| true)?;
            let end = engine.cache().bytes_in_use();
            Ok((tok.decode_text(&g.tokens)?, peak.max(end), end))
        })();
        let step_peak = engine.cache().take_step_peak_bytes();
        let freed = engine.cache().free(&mut seq);
        let (answer, peak, end) = out?;
        freed?;
        Ok(Record {
            values: BTreeMap::from([
                ("length".into(), (context.len() + question.len()) as f64),
                ("depth".into(), depth),
                (
                    "correct".into(),
                    f64::from(u8::from(first_number(&answer) == key.to_string())),
                ),
                ("kv_bytes".into(), peak as f64),
                // After the answer: what the compressed cache settled to.
                ("end_kv_bytes".into(), end as f64),
                // Inside a step: what it releases at commit still held.
                ("step_peak_kv_bytes".into(), step_peak as f64),
            ]),
            answer: Some(answer),
            ..Record::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::PasskeyPrompt;

    /// Seen or not, the same tokens in the same order; seen, the question
    /// but its last token is prefilled with the context.
    #[test]
    fn a_seen_question_is_prefilled_with_the_context_but_its_last_token() {
        let p = PasskeyPrompt {
            key: 12345,
            context: vec![1, 2, 3],
            question: vec![7, 8, 9],
        };
        assert_eq!(p.split(false), (vec![1, 2, 3], vec![7, 8, 9]));
        assert_eq!(p.split(true), (vec![1, 2, 3, 7, 8], vec![9]));
        let empty = PasskeyPrompt {
            question: vec![],
            ..p
        };
        assert_eq!(empty.split(true), (vec![1, 2, 3], vec![]));
    }
}
