//! `kvforge`: generate text or chat with a LLaMA-family model through the
//! paged KV cache.
//!
//! ```text
//! kvforge generate --prompt "What is a KV cache?"
//! kvforge chat                      # interactive, multi-turn, streams tokens
//! ```
//!
//! Every error is one line on stderr and a non-zero exit. `KVFORGE_LOG=debug`
//! logs every prefix-cache block lookup (position, key, hit or miss) to
//! stderr.

#![allow(clippy::print_stdout)] // a CLI: stdout is its output

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kvforge_engine::{
    Attention, Axis, CacheManager, DedupConfig, Engine, EngineConfig, EngineError, EvictionConfig,
    Generation, IndexKind, KvQuant, LabelSource, LifecycleConfig, Message, PplReport, ReuseConfig,
    SamplingParams, Sequence, SimHashConfig, Tokenizer, TurnTail, parse_device, parse_dtype,
};

/// The model `cargo xtask setup` installs.
const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Largest `--block-size`: a block is one unit of the KV pool, and larger
/// blocks only waste memory (a libtorch allocation error otherwise).
const MAX_BLOCK_SIZE: usize = 4096;

/// Largest text file `ppl` / `bench` read.
const MAX_TEXT_BYTES: u64 = 256 << 20;

#[derive(Parser)]
#[command(
    name = "kvforge",
    version,
    about = "LLaMA inference over a paged, pooled KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to a prompt (chat template applied unless --raw);
    /// several `--prompt`s are decoded together as one batch.
    Generate {
        /// The prompt; repeat it to decode several as one batch (prompt
        /// `i` samples with seed + i).
        #[arg(long, required = true)]
        prompt: Vec<String>,
        /// Feed the prompt as is, without the chat template.
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Interactive multi-turn chat on stdin; an empty line or EOF ends it.
    /// A session in the prefix cache: each turn prefills only its new tokens.
    Chat {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        reuse: Reuse,
    },
    /// Perplexity of a text file: window (llama.cpp style) and streaming
    /// through the cache. `<doc …>` files (the setup's wiki.utf8) are split
    /// into articles and the longest is used. Prints one JSON line per mode;
    /// with --kv-quant a third line, streaming over the quantized cold tier,
    /// with its change against the unquantized cache.
    Ppl {
        /// Text file (default: the setup's Wikipedia calibration text).
        #[arg(long, default_value = "data/exllamav2/wiki.utf8")]
        text: PathBuf,
        /// Tokens scored in total (the article is cut to this length).
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        /// Window for window perplexity.
        #[arg(long, default_value_t = 512)]
        window: usize,
        /// Streaming: tokens prefilled before scoring starts.
        #[arg(long, default_value_t = 512)]
        prefix: usize,
        /// Streaming: tokens per step after the prefix.
        #[arg(long, default_value_t = 64)]
        chunk: usize,
        /// Streaming: greedy decode steps timed at the final context.
        #[arg(long, default_value_t = 16)]
        decode: usize,
        #[command(flatten)]
        common: Common,
    },
    /// Prefill the first --context tokens of a text file, then decode
    /// --max-tokens greedy tokens; prints one JSON line of speeds.
    Bench {
        /// Text to take the prompt from.
        #[arg(long)]
        text: PathBuf,
        /// Prompt length in tokens.
        #[arg(long, default_value_t = 1024)]
        context: usize,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(Args)]
struct Common {
    /// GGUF file or Hugging Face directory (default: the model setup installs).
    #[arg(long)]
    model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Weight storage dtype (default: --dtype). `--weights f16` with f32
    /// compute roughly doubles CPU decode speed.
    #[arg(long)]
    weights: Option<String>,
    /// KV cache storage dtype: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Attention backend: fused (the paged kernel for CPU decode steps)
    /// or reference (gather + SDPA).
    #[arg(long, default_value = "fused")]
    attention: String,
    /// Maximum new tokens per reply.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold in (0, 1].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating past the end-of-sequence token (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// CPU threads for libtorch (0 = its default; at most the machine's).
    #[arg(long, default_value_t = 0)]
    threads: i32,
    /// Let control tokens written in prompts (`<|im_start|>` …) act as
    /// control tokens. Off by default: user text stays text.
    #[arg(long)]
    allow_special: bool,
    #[command(flatten)]
    tier: Tier,
}

/// The quantized cold tier (off unless --kv-quant is given).
#[derive(Args)]
struct Tier {
    /// Quantize KV blocks older than --kv-window: int8, int4 or int2.
    #[arg(long)]
    kv_quant: Option<String>,
    /// Newest tokens kept in full precision (a multiple of --block-size).
    #[arg(long, default_value_t = 128)]
    kv_window: usize,
    /// Quantization group size along the head dim (must divide it).
    /// Per-channel key groups span one block's tokens.
    #[arg(long, default_value_t = 32)]
    kv_group: usize,
    /// Key groups: channel (KIVI: along a block's tokens) or token.
    #[arg(long, default_value = "channel")]
    kv_keys: String,
    /// Hadamard-rotate keys before quantizing.
    #[arg(long)]
    kv_rotate: bool,
    /// First tokens kept in full precision (attention sinks; a multiple of
    /// --block-size; 0 = none).
    #[arg(long, default_value_t = 32)]
    kv_sink: usize,
    /// Evict (StreamingLLM): keep only the newest N tokens besides
    /// --evict-sink; whole blocks in between are dropped (0 = off).
    #[arg(long, default_value_t = 0)]
    evict_window: usize,
    /// First tokens eviction never drops (attention sinks).
    #[arg(long, default_value_t = 4)]
    evict_sink: usize,
    /// Store identical quantized blocks once (needs --kv-quant).
    #[arg(long)]
    kv_share: bool,
    /// Store near-duplicate quantized blocks once: blocks whose dequantized
    /// K/V have at least this cosine (in (0, 1]), found by random-hyperplane
    /// hashing (needs --kv-quant; replaces --kv-share's exact matching).
    #[arg(long)]
    kv_share_cos: Option<f32>,
    /// Chat: drop turns older than the newest N (the first turn stays;
    /// 0 = keep everything).
    #[arg(long, default_value_t = 0)]
    keep_turns: u32,
    /// Chat: the context lifecycle — segments (sentences) labelled keep /
    /// compress / drop by the seed's rule (`rule`), or by the model in a
    /// labelling pass decoded freely (`free`) or under the label grammar
    /// (`constrained`), the rule standing in for missing labels.
    #[arg(long)]
    lifecycle: Option<String>,
    /// Lifecycle: newest rounds always kept.
    #[arg(long, default_value_t = 2)]
    lifecycle_protect: u32,
    /// Lifecycle: K, rounds a dropped segment waits before its KV is freed
    /// (0 = at once).
    #[arg(long, default_value_t = 2)]
    lifecycle_delay: u32,
    /// Lifecycle: segments this long or longer labelled compress are
    /// summarised by the model (0 = compression off).
    #[arg(long, default_value_t = 512)]
    lifecycle_compress_min: u64,
    /// Bytes all KV tiers may hold, in MiB (0 = the hot tier's capacity).
    #[arg(long, default_value_t = 0)]
    kv_budget_mib: u64,
}

impl Tier {
    fn apply(&self, cfg: &mut EngineConfig) -> Result<(), EngineError> {
        cfg.kv_quant = self.spec()?;
        cfg.eviction = (self.evict_window > 0).then_some(EvictionConfig::SinkWindow {
            sink: self.evict_sink,
            window: self.evict_window,
        });
        cfg.dedup = match self.kv_share_cos {
            Some(threshold) => Some(DedupConfig::SimHash(SimHashConfig {
                threshold,
                ..SimHashConfig::default()
            })),
            None => self.kv_share.then_some(DedupConfig::Exact),
        };
        cfg.lifecycle = (self.keep_turns > 0).then_some(LifecycleConfig::RecentTurns {
            keep: self.keep_turns,
        });
        if let Some(name) = &self.lifecycle {
            if self.keep_turns > 0 {
                return Err(EngineError::Request(
                    "--lifecycle and --keep-turns are two lifecycles: give one".into(),
                ));
            }
            let source = match name.as_str() {
                "rule" => LabelSource::Rule,
                "free" => LabelSource::Free,
                "constrained" => LabelSource::Constrained,
                _ => {
                    return Err(EngineError::Request(format!(
                        "unknown --lifecycle {name:?}; choose rule, free or constrained"
                    )));
                }
            };
            cfg.lifecycle = Some(LifecycleConfig::Labels {
                source,
                protect: self.lifecycle_protect,
                delay: self.lifecycle_delay,
                min_match: 6,
                compress_min: (self.lifecycle_compress_min > 0)
                    .then_some(self.lifecycle_compress_min),
            });
        }
        cfg.kv_budget = self.kv_budget_mib.checked_mul(1 << 20).ok_or_else(|| {
            EngineError::Request(format!(
                "--kv-budget-mib {} is too large",
                self.kv_budget_mib
            ))
        })?;
        Ok(())
    }

    fn spec(&self) -> Result<Option<KvQuant>, EngineError> {
        let Some(format) = &self.kv_quant else {
            return Ok(None);
        };
        let key_axis = match self.kv_keys.as_str() {
            "channel" => Axis::PerChannel,
            "token" => Axis::PerToken,
            other => {
                return Err(EngineError::Request(format!(
                    "unknown --kv-keys {other:?}; use channel or token"
                )));
            }
        };
        Ok(Some(KvQuant {
            group_size: self.kv_group,
            window: self.kv_window,
            rotate: self.kv_rotate,
            key_axis,
            sink: self.kv_sink,
            ..KvQuant::parse(format)?
        }))
    }
}

#[derive(Args)]
struct Reuse {
    /// Prefix index: hash-chain or radix.
    #[arg(long, default_value = "hash-chain")]
    index: String,
    /// The partial last block of each turn: copy (cached; a request that
    /// continues it copies it), seal (cached; new tokens start a new
    /// block) or skip (not cached).
    #[arg(long, default_value = "copy")]
    turn_tail: String,
    /// Recompute everything (no prefix cache).
    #[arg(long)]
    no_reuse: bool,
    /// Namespace (tenant) of the session.
    #[arg(long, default_value = "default")]
    namespace: String,
    /// Print the metrics snapshot as JSON on stderr after each turn.
    #[arg(long)]
    metrics: bool,
    /// Write the metrics snapshot in Prometheus' text format to this file
    /// at the start and after each turn (replaced atomically, for a
    /// node-exporter textfile collector or a scraper).
    #[arg(long)]
    metrics_file: Option<PathBuf>,
}

impl Reuse {
    /// Writes the Prometheus snapshot to `--metrics-file` (if given):
    /// a sibling temporary file, then a rename.
    fn write_metrics(&self, manager: &CacheManager) -> Result<(), EngineError> {
        let Some(path) = &self.metrics_file else {
            return Ok(());
        };
        let text = kvforge_engine::metrics::prometheus(&manager.metrics());
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| EngineError::Request(format!("--metrics-file {}: {e}", path.display())))
    }

    fn config(&self) -> Result<ReuseConfig, EngineError> {
        Ok(ReuseConfig {
            enabled: !self.no_reuse,
            index: self.index.parse::<IndexKind>()?,
            tail: self.turn_tail.parse::<TurnTail>()?,
            seed: None,
        })
    }
}

impl Common {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
        }
    }

    /// Checks what can be checked without the model: sampling, threads,
    /// block size, cold-tier names.
    fn check(&self) -> Result<(), EngineError> {
        self.params().validate()?;
        self.tier.spec()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.threads < 0 || self.threads as usize > cores {
            return Err(EngineError::Request(format!(
                "--threads {} must be between 0 (libtorch's default) and this machine's {cores} cores",
                self.threads
            )));
        }
        if self.block_size > MAX_BLOCK_SIZE {
            return Err(EngineError::Request(format!(
                "--block-size {} is above the supported {MAX_BLOCK_SIZE} tokens",
                self.block_size
            )));
        }
        Ok(())
    }

    /// The ids of a user's message in the chat template (as text unless
    /// --allow-special).
    fn user_ids(&self, tokenizer: &Tokenizer, msg: &str) -> Result<Vec<u32>, EngineError> {
        let messages = [Message::new("user", msg)];
        if self.allow_special {
            tokenizer.encode(&Tokenizer::chat_prompt(&messages))
        } else {
            tokenizer.chat_ids(&messages)
        }
    }

    fn engine(&self) -> Result<Engine, EngineError> {
        self.check()?;
        if self.threads > 0 {
            tch::set_num_threads(self.threads);
        }
        let mut cfg = EngineConfig {
            device: parse_device(&self.device)?,
            kind: parse_dtype(&self.dtype)?,
            weight_kind: self.weights.as_deref().map(parse_dtype).transpose()?,
            kv_kind: Some(parse_dtype(&self.kv_dtype)?),
            block_size: self.block_size,
            attention: Attention::parse(&self.attention)?,
            ..EngineConfig::default()
        };
        self.tier.apply(&mut cfg)?;
        let path = self
            .model
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
        if self.model.is_none() && !path.exists() {
            return Err(EngineError::Model(format!(
                "{DEFAULT_MODEL} not found; run `cargo xtask setup` (or pass --model PATH)"
            )));
        }
        Engine::load(&path, &cfg)
    }
}

fn report(engine: &Engine, g: &Generation) {
    let (hot, cold) = engine.cache.tier_bytes();
    let blocks = engine
        .cache
        .tier_stats()
        .first()
        .map_or(0, |t| t.pool.in_use);
    eprintln!(
        "[{} prompt tokens, prefill {:.1} tok/s | {} new tokens, decode {:.1} tok/s | KV {} hot bytes in {} blocks + {} cold bytes]",
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        g.tokens.len(),
        g.decode_tokens_per_sec(),
        hot,
        blocks,
        cold,
    );
}

/// Writes one line of output; `false` once stdout is closed (e.g. `| head`),
/// so the caller stops instead of panicking the way `println!` would.
fn emit(line: impl std::fmt::Display) -> bool {
    stream(&format!("{line}\n"))
}

fn stream(piece: &str) -> bool {
    let mut out = std::io::stdout().lock();
    // A closed stdout (e.g. `| head`) just ends the generation.
    out.write_all(piece.as_bytes())
        .and_then(|_| out.flush())
        .is_ok()
}

fn generate(prompts: &[String], raw: bool, common: &Common) -> Result<(), EngineError> {
    let engine = common.engine()?;
    let encode = |p: &String| {
        if raw {
            engine.tokenizer.encode(p)
        } else {
            common.user_ids(&engine.tokenizer, p)
        }
    };
    if prompts.len() > 1 {
        return generate_batch(&engine, prompts, &encode, common);
    }
    let ids = encode(&prompts[0])?;
    let mut seq = Sequence::default();
    let g = engine.generate(&mut seq, &ids, &common.params(), &mut |_, piece| {
        stream(piece)
    })?;
    emit("");
    report(&engine, &g);
    engine.cache.free(&mut seq)
}

/// Several prompts decoded as one batch: each reply printed as `[i] text`
/// when the batch ends, then one report line per sequence.
fn generate_batch(
    engine: &Engine,
    prompts: &[String],
    encode: &dyn Fn(&String) -> Result<Vec<u32>, EngineError>,
    common: &Common,
) -> Result<(), EngineError> {
    let ids = prompts.iter().map(encode).collect::<Result<Vec<_>, _>>()?;
    let base = common.params();
    let params: Vec<SamplingParams> = (0..ids.len())
        .map(|i| SamplingParams {
            seed: base.seed.wrapping_add(i as u64),
            ..base.clone()
        })
        .collect();
    let mut seqs: Vec<Sequence> = ids.iter().map(|_| Sequence::default()).collect();
    let mut texts = vec![String::new(); ids.len()];
    let result = engine.generate_batch(&mut seqs, &ids, &params, &mut |i, _, piece| {
        texts[i].push_str(piece);
        true
    });
    if let Ok(gens) = &result {
        for (i, t) in texts.iter().enumerate() {
            if !emit(format!("[{i}] {}", t.trim_end())) {
                break;
            }
        }
        for g in gens {
            report(engine, g);
        }
    }
    let freed = seqs.iter_mut().try_for_each(|s| engine.cache.free(s));
    result?;
    freed
}

fn chat(common: &Common, reuse: &Reuse) -> Result<(), EngineError> {
    let manager = CacheManager::new(common.engine()?, reuse.config()?)?;
    let params = common.params();
    let session = manager.open_session(&reuse.namespace);
    reuse.write_metrics(&manager)?;
    let stdin = std::io::stdin();
    let mut first = true;
    let mut closed = true; // whether the last reply ended with <|im_end|>
    eprintln!("kvforge chat — empty line or Ctrl-D to quit");
    loop {
        eprint!("> ");
        let mut raw = Vec::new();
        let n = stdin
            .lock()
            .read_until(b'\n', &mut raw)
            .map_err(|e| EngineError::Request(format!("reading stdin: {e}")))?;
        if n == 0 {
            break;
        }
        // A bad turn is reported and skipped; the session goes on unchanged.
        let Ok(line) = std::str::from_utf8(&raw) else {
            eprintln!("error: that line is not valid UTF-8; the session is unchanged");
            continue;
        };
        let msg = line.trim_end_matches(['\n', '\r']);
        if msg.is_empty() {
            break;
        }
        // The previous reply's last token (usually <|im_end|>) is already
        // pending in the session; close the reply if it was cut off.
        let ids = manager.with_engine(|e| {
            if first {
                common.user_ids(&e.tokenizer, msg)
            } else if common.allow_special {
                let end = if closed { "" } else { "<|im_end|>" };
                e.tokenizer.encode(&format!(
                    "{end}\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
                ))
            } else {
                e.tokenizer.user_turn_ids(!closed, msg)
            }
        });
        let turn =
            ids.and_then(|ids| manager.turn(session, &ids, &params, &mut |_, piece| stream(piece)));
        let r = match turn {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}; the session is unchanged");
                continue;
            }
        };
        first = false;
        emit("");
        manager.with_engine(|e| report(e, &r.generation));
        eprintln!(
            "[reused {} of {} prompt tokens]",
            r.reused_tokens, r.prompt_tokens
        );
        if reuse.metrics {
            eprintln!("{}", manager.metrics());
        }
        reuse.write_metrics(&manager)?;
        closed = r.generation.stopped_at_eos;
    }
    manager.close_session(session)
}

/// Reads a text file: a regular file of at most [`MAX_TEXT_BYTES`], UTF-8.
fn read_text(path: &std::path::Path) -> Result<String, EngineError> {
    use std::io::Read as _;
    let bad = |why: String| EngineError::Request(format!("cannot read {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut buf = Vec::new();
    file.take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| bad(e.to_string()))?;
    if buf.len() as u64 > MAX_TEXT_BYTES {
        return Err(bad(format!(
            "larger than the {} MiB limit",
            MAX_TEXT_BYTES >> 20
        )));
    }
    String::from_utf8(buf).map_err(|_| bad("not UTF-8 text".into()))
}

/// The first `n` tokens of `body`; `what` and `flag` name them in the error
/// when there are fewer.
fn first_tokens(
    engine: &Engine,
    body: &str,
    n: usize,
    what: &str,
    flag: &str,
) -> Result<Vec<u32>, EngineError> {
    let mut ids = engine.tokenizer.encode(body)?;
    if ids.len() < n {
        return Err(EngineError::Request(format!(
            "{what} holds {} tokens, fewer than {flag} {n}",
            ids.len()
        )));
    }
    ids.truncate(n);
    Ok(ids)
}

fn bench(text: &std::path::Path, context: usize, common: &Common) -> Result<(), EngineError> {
    common.check()?;
    let body = read_text(text)?;
    let engine = common.engine()?;
    let what = text.display().to_string();
    let ids = first_tokens(&engine, &body, context, &what, "--context")?;
    // Warm-up, as the transformers side does.
    let mut seq = Sequence::default();
    let _ = engine.model.forward(
        &ids[..16.min(context)],
        &mut engine.cache.view(&mut seq),
        false,
    )?;
    engine.cache.free(&mut seq)?;
    let params = SamplingParams {
        ignore_eos: true,
        ..common.params()
    };
    let g = engine.generate(&mut seq, &ids, &params, &mut |_, _| true)?;
    emit(format!(
        "{{\"engine\":\"kvforge\",\"dtype\":\"{}\",\"weights\":\"{}\",\"kv\":\"{}\",\"context\":{},\"prefill_tok_s\":{:.3},\"decode_tok_s\":{:.3},\"threads\":{},\"kv_bytes\":{},\"cold_bytes\":{},\"kv_quant\":\"{}\"}}",
        common.dtype,
        common.weights.as_deref().unwrap_or(&common.dtype),
        common.kv_dtype,
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        g.decode_tokens_per_sec(),
        tch::get_num_threads(),
        engine.cache.bytes_in_use(),
        engine.cache.tier_bytes().1,
        engine
            .cache
            .cold_tier()
            .map_or_else(|| "none".into(), |q| q.name()),
    ));
    engine.cache.free(&mut seq)
}

/// `KVFORGE_LOG=error|warn|info|debug|trace` turns on logging to stderr.
fn init_logging() {
    let Ok(level) = std::env::var("KVFORGE_LOG") else {
        return;
    };
    let level = match level.parse::<tracing::Level>() {
        Ok(l) => l,
        Err(_) => {
            eprintln!(
                "KVFORGE_LOG={level:?} is not a level (error, warn, info, debug, trace); logging off"
            );
            return;
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .try_init();
}

fn ppl(
    text: &std::path::Path,
    tokens: usize,
    window: usize,
    stream: (usize, usize, usize),
    common: &Common,
) -> Result<(), EngineError> {
    let (prefix, chunk, decode) = stream;
    // Every argument is checked before the text is read or the model loaded.
    common.check()?;
    if window < 2 || window > tokens {
        return Err(EngineError::Request(format!(
            "window perplexity needs 2 <= --window <= --tokens (window {window}, tokens {tokens})"
        )));
    }
    if prefix == 0 || chunk == 0 || prefix >= tokens {
        return Err(EngineError::Request(format!(
            "streaming perplexity needs 0 < --prefix < --tokens and --chunk > 0 (prefix {prefix}, chunk {chunk}, tokens {tokens})"
        )));
    }
    let body = read_text(text)?;
    let mut engine = common.engine()?;
    let article = kvforge_engine::ppl::longest_article(&body);
    let what = format!("the longest article of {}", text.display());
    let ids = first_tokens(&engine, &article, tokens, &what, "--tokens")?;
    let tier = engine.cache.cold_tier();
    let line = |mode: &str, quant: Option<KvQuant>, r: &PplReport| {
        serde_json::json!({
            "mode": mode, "tokens": tokens, "window": window, "prefix": prefix, "chunk": chunk,
            "dtype": common.dtype, "weights": common.weights.as_deref().unwrap_or(&common.dtype),
            "kv": common.kv_dtype,
            "kv_quant": quant.map_or_else(|| "none".to_string(), |q| q.name()),
            "scored": r.scored, "ppl": r.ppl, "kv_bytes": r.kv_bytes,
            "hot_bytes": r.hot_bytes, "cold_bytes": r.cold_bytes,
            "kv_bytes_per_token": r.kv_bytes_per_token, "tokens_per_sec": r.tokens_per_sec,
            "decode_steps": r.decode_steps, "decode_tok_s": r.decode_tokens_per_sec,
        })
    };
    // Window perplexity runs each window in one step: the cold tier never
    // engages, so it is reported once, for the unquantized cache.
    engine.cache.set_cold_tier(None)?;
    if !emit(line("window", None, &engine.window_ppl(&ids, window)?)) {
        return Ok(());
    }
    let base = engine.streaming_ppl(&ids, prefix, chunk, decode)?;
    if !emit(line("stream", None, &base)) {
        return Ok(());
    }
    if let Some(q) = tier {
        engine.cache.set_cold_tier(Some(q))?;
        let r = engine.streaming_ppl(&ids, prefix, chunk, decode)?;
        let mut out = line("stream", Some(q), &r);
        out["ppl_change"] = (r.ppl / base.ppl - 1.0).into();
        out["kv_cut"] = (1.0 - r.kv_bytes as f64 / base.kv_bytes.max(1) as f64).into();
        if decode > 0 {
            out["decode_ratio"] =
                (r.decode_tokens_per_sec / base.decode_tokens_per_sec.max(1e-9)).into();
        }
        emit(out);
    }
    Ok(())
}

fn main() -> ExitCode {
    init_logging();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help / --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap spreads one problem over several lines; keep it to one.
            let msg = e.to_string();
            let line: Vec<&str> = msg
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
                .collect();
            eprintln!("{} (see kvforge --help)", line.join(" "));
            return ExitCode::from(2);
        }
    };
    let result = match &cli.command {
        Command::Generate {
            prompt,
            raw,
            common,
        } => generate(prompt, *raw, common),
        Command::Chat { common, reuse } => chat(common, reuse),
        Command::Bench {
            text,
            context,
            common,
        } => bench(text, *context, common),
        Command::Ppl {
            text,
            tokens,
            window,
            prefix,
            chunk,
            decode,
            common,
        } => ppl(text, *tokens, *window, (*prefix, *chunk, *decode), common),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
