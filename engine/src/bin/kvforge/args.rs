//! The flags every command shares: the model and how it runs, sampling,
//! the cache's mechanisms (flags, or a mechanisms file with `--config`),
//! and a chat's prefix reuse and metrics.

use std::path::PathBuf;

use clap::Args;
use kvforge_engine::{
    Attention, Axis, CacheManager, DedupConfig, Engine, EngineConfig, EngineError, EvictionConfig,
    IndexKind, KvQuant, LabelSource, LifecycleConfig, Mechanisms, Message, Registry, ReuseConfig,
    SamplingParams, SimHashConfig, Tokenizer, TurnTail, parse_device, parse_dtype,
};

use super::{DEFAULT_MODEL, MAX_BLOCK_SIZE};

#[derive(Args)]
pub(crate) struct Common {
    /// GGUF file or Hugging Face directory (default: the model setup installs).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Compute dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// Weight storage dtype (default: --dtype). `--weights f16` with f32
    /// compute roughly doubles CPU decode speed.
    #[arg(long)]
    pub(crate) weights: Option<String>,
    /// KV cache storage dtype: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    pub(crate) kv_dtype: String,
    /// Attention backend: fused (the paged kernel for CPU decode steps)
    /// or reference (gather + SDPA).
    #[arg(long, default_value = "fused")]
    pub(crate) attention: String,
    /// Maximum new tokens per reply.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub(crate) top_k: usize,
    /// Nucleus sampling threshold in (0, 1].
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub(crate) top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Keep generating past the end-of-sequence token (benchmarks).
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_size: usize,
    /// CPU threads for libtorch (0 = its default; at most the machine's).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: i32,
    /// Let control tokens written in prompts (`<|im_start|>` …) act as
    /// control tokens. Off by default: user text stays text.
    #[arg(long)]
    pub(crate) allow_special: bool,
    /// A mechanisms file (TOML; the schema of the ablation's `[[config]]`
    /// tables: prefix, cold, eviction, share, lifecycle, budget_mib,
    /// block_size). It replaces the mechanism flags (--kv-quant,
    /// --evict-window, --kv-share, --kv-share-cos, --keep-turns,
    /// --lifecycle, --kv-budget-mib), which cannot be given with it; its
    /// `prefix` table (if any) replaces chat's --index and --turn-tail.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) tier: Tier,
}

/// The quantized cold tier (off unless --kv-quant is given).
#[derive(Args)]
pub(crate) struct Tier {
    /// Quantize KV blocks older than --kv-window: int8, int4 or int2.
    #[arg(long)]
    pub(crate) kv_quant: Option<String>,
    /// Newest tokens kept in full precision (a multiple of --block-size;
    /// default 128).
    #[arg(long)]
    pub(crate) kv_window: Option<usize>,
    /// Quantization group size along the head dim (must divide it;
    /// default 32). Per-channel key groups span one block's tokens.
    #[arg(long)]
    pub(crate) kv_group: Option<usize>,
    /// Key groups: channel (KIVI: along a block's tokens; the default) or
    /// token.
    #[arg(long)]
    pub(crate) kv_keys: Option<String>,
    /// Hadamard-rotate keys before quantizing.
    #[arg(long)]
    pub(crate) kv_rotate: bool,
    /// First tokens kept in full precision (attention sinks; a multiple of
    /// --block-size; 0 = none; default 32).
    #[arg(long)]
    pub(crate) kv_sink: Option<usize>,
    /// Evict (StreamingLLM): keep only the newest N tokens besides
    /// --evict-sink; whole blocks in between are dropped (0 = off).
    #[arg(long, default_value_t = 0)]
    pub(crate) evict_window: usize,
    /// First tokens eviction never drops (attention sinks; default 4).
    #[arg(long)]
    pub(crate) evict_sink: Option<usize>,
    /// Store identical quantized blocks once (needs --kv-quant).
    #[arg(long)]
    pub(crate) kv_share: bool,
    /// Store near-duplicate quantized blocks once: blocks whose dequantized
    /// K/V have at least this cosine (in (0, 1]), found by random-hyperplane
    /// hashing (needs --kv-quant; replaces --kv-share's exact matching).
    #[arg(long)]
    pub(crate) kv_share_cos: Option<f32>,
    /// Chat: drop turns older than the newest N (the first turn stays;
    /// 0 = keep everything).
    #[arg(long, default_value_t = 0)]
    pub(crate) keep_turns: u32,
    /// Chat: the context lifecycle — segments (sentences) labelled keep /
    /// compress / drop by the seed's rule (`rule`), or by the model in a
    /// labelling pass decoded freely (`free`) or under the label grammar
    /// (`constrained`), the rule standing in for missing labels.
    #[arg(long)]
    pub(crate) lifecycle: Option<String>,
    /// Lifecycle: newest rounds always kept (default 2).
    #[arg(long)]
    pub(crate) lifecycle_protect: Option<u32>,
    /// Lifecycle: K, rounds a dropped segment waits before its KV is freed
    /// (0 = at once; default 2).
    #[arg(long)]
    pub(crate) lifecycle_delay: Option<u32>,
    /// Lifecycle: segments this long or longer labelled compress are
    /// summarised by the model (0 = compression off; default 512).
    #[arg(long)]
    pub(crate) lifecycle_compress_min: Option<u64>,
    /// Bytes all KV tiers may hold, in MiB (0 = the hot tier's capacity).
    #[arg(long, default_value_t = 0)]
    pub(crate) kv_budget_mib: u64,
}

impl Tier {
    /// A flag that does nothing without another, or two that contradict
    /// each other: one line naming them (F10 of the inputs review).
    pub(crate) fn check_flags(&self) -> Result<(), EngineError> {
        let needs = |given: bool, flag: &str, needed: &str| {
            if given {
                Err(EngineError::Request(format!(
                    "{flag} needs {needed} (without it the flag does nothing)"
                )))
            } else {
                Ok(())
            }
        };
        let cold = self.kv_quant.is_none();
        needs(
            cold && self.kv_window.is_some(),
            "--kv-window",
            "--kv-quant",
        )?;
        needs(cold && self.kv_group.is_some(), "--kv-group", "--kv-quant")?;
        needs(cold && self.kv_keys.is_some(), "--kv-keys", "--kv-quant")?;
        needs(cold && self.kv_sink.is_some(), "--kv-sink", "--kv-quant")?;
        needs(cold && self.kv_rotate, "--kv-rotate", "--kv-quant")?;
        needs(cold && self.kv_share, "--kv-share", "--kv-quant")?;
        needs(
            cold && self.kv_share_cos.is_some(),
            "--kv-share-cos",
            "--kv-quant",
        )?;
        needs(
            self.evict_window == 0 && self.evict_sink.is_some(),
            "--evict-sink",
            "--evict-window",
        )?;
        let lc = self.lifecycle.is_none();
        needs(
            lc && self.lifecycle_protect.is_some(),
            "--lifecycle-protect",
            "--lifecycle",
        )?;
        needs(
            lc && self.lifecycle_delay.is_some(),
            "--lifecycle-delay",
            "--lifecycle",
        )?;
        needs(
            lc && self.lifecycle_compress_min.is_some(),
            "--lifecycle-compress-min",
            "--lifecycle",
        )?;
        if self.kv_share && self.kv_share_cos.is_some() {
            return Err(EngineError::Request(
                "--kv-share (exact) and --kv-share-cos (near duplicates) are two sharings: give one".into(),
            ));
        }
        Ok(())
    }

    /// The chat-only flag given, if any (a lifecycle acts at turn ends).
    pub(crate) fn chat_only(&self) -> Option<&'static str> {
        if self.keep_turns > 0 {
            Some("--keep-turns")
        } else if self.lifecycle.is_some() {
            Some("--lifecycle")
        } else {
            None
        }
    }

    /// The first mechanism flag given, if any.
    fn given(&self) -> Option<&'static str> {
        [
            (self.kv_quant.is_some(), "--kv-quant"),
            (self.evict_window > 0, "--evict-window"),
            (self.kv_share, "--kv-share"),
            (self.kv_share_cos.is_some(), "--kv-share-cos"),
            (self.keep_turns > 0, "--keep-turns"),
            (self.lifecycle.is_some(), "--lifecycle"),
            (self.kv_budget_mib > 0, "--kv-budget-mib"),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    /// The first detail flag of a mechanism given, if any.
    fn detail(&self) -> Option<&'static str> {
        [
            (self.kv_window.is_some(), "--kv-window"),
            (self.kv_group.is_some(), "--kv-group"),
            (self.kv_keys.is_some(), "--kv-keys"),
            (self.kv_sink.is_some(), "--kv-sink"),
            (self.kv_rotate, "--kv-rotate"),
            (self.evict_sink.is_some(), "--evict-sink"),
            (self.lifecycle_protect.is_some(), "--lifecycle-protect"),
            (self.lifecycle_delay.is_some(), "--lifecycle-delay"),
            (
                self.lifecycle_compress_min.is_some(),
                "--lifecycle-compress-min",
            ),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    pub(crate) fn apply(&self, cfg: &mut EngineConfig) -> Result<(), EngineError> {
        self.check_flags()?;
        cfg.kv_quant = self.spec()?;
        cfg.eviction = (self.evict_window > 0).then_some(EvictionConfig::SinkWindow {
            sink: self.evict_sink.unwrap_or(4),
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
                protect: self.lifecycle_protect.unwrap_or(2),
                delay: self.lifecycle_delay.unwrap_or(2),
                min_match: 6,
                compress_min: Some(self.lifecycle_compress_min.unwrap_or(512)).filter(|&n| n > 0),
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

    pub(crate) fn spec(&self) -> Result<Option<KvQuant>, EngineError> {
        let Some(format) = &self.kv_quant else {
            return Ok(None);
        };
        let key_axis = match self.kv_keys.as_deref().unwrap_or("channel") {
            "channel" => Axis::PerChannel,
            "token" => Axis::PerToken,
            other => {
                return Err(EngineError::Request(format!(
                    "unknown --kv-keys {other:?}; use channel or token"
                )));
            }
        };
        Ok(Some(KvQuant {
            group_size: self.kv_group.unwrap_or(32),
            window: self.kv_window.unwrap_or(128),
            rotate: self.kv_rotate,
            key_axis,
            sink: self.kv_sink.unwrap_or(32),
            ..KvQuant::parse(format)?
        }))
    }
}

#[derive(Args)]
pub(crate) struct Reuse {
    /// Prefix index: hash-chain or radix.
    #[arg(long, default_value = "hash-chain")]
    pub(crate) index: String,
    /// The partial last block of each turn: copy (cached; a request that
    /// continues it copies it), seal (cached; new tokens start a new
    /// block) or skip (not cached).
    #[arg(long, default_value = "copy")]
    pub(crate) turn_tail: String,
    /// Recompute everything (no prefix cache).
    #[arg(long)]
    pub(crate) no_reuse: bool,
    /// Namespace (tenant) of the session.
    #[arg(long, default_value = "default")]
    pub(crate) namespace: String,
    /// Print the metrics snapshot as JSON on stderr after each turn.
    #[arg(long)]
    pub(crate) metrics: bool,
    /// Write the metrics snapshot in Prometheus' text format to this file
    /// at the start and after each turn (replaced atomically, for a
    /// node-exporter textfile collector or a scraper).
    #[arg(long)]
    pub(crate) metrics_file: Option<PathBuf>,
}

impl Reuse {
    /// Writes the Prometheus snapshot to `--metrics-file` (if given):
    /// a sibling temporary file, then a rename.
    pub(crate) fn write_metrics(&self, manager: &CacheManager) -> Result<(), EngineError> {
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

    pub(crate) fn config(&self) -> Result<ReuseConfig, EngineError> {
        Ok(ReuseConfig {
            enabled: !self.no_reuse,
            index: self.index.parse::<IndexKind>()?,
            tail: self.turn_tail.parse::<TurnTail>()?,
            seed: None,
        })
    }
}

impl Common {
    pub(crate) fn params(&self) -> SamplingParams {
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
    pub(crate) fn check(&self) -> Result<(), EngineError> {
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

    /// The mechanisms file given with --config (checked, and refused beside
    /// a mechanism flag).
    pub(crate) fn mechanisms(&self) -> Result<Option<Mechanisms>, EngineError> {
        let Some(path) = &self.config else {
            return Ok(None);
        };
        if let Some(flag) = self.tier.given().or_else(|| self.tier.detail()) {
            return Err(EngineError::Request(format!(
                "--config {} sets the mechanisms: drop {flag} (or write it into the file)",
                path.display()
            )));
        }
        Mechanisms::load(path, self.block_size, &Registry::builtin())
            .map(Some)
            .map_err(EngineError::Request)
    }

    /// The ids of a user's message in the chat template (as text unless
    /// --allow-special).
    pub(crate) fn user_ids(
        &self,
        tokenizer: &Tokenizer,
        msg: &str,
    ) -> Result<Vec<u32>, EngineError> {
        let messages = [Message::new("user", msg)];
        if self.allow_special {
            tokenizer.encode(&Tokenizer::chat_prompt(&messages))
        } else {
            tokenizer.chat_ids(&messages)
        }
    }

    pub(crate) fn engine(&self) -> Result<Engine, EngineError> {
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
        match self.mechanisms()? {
            Some(m) => {
                m.apply(&mut cfg, &Registry::builtin(), None)
                    .map_err(EngineError::Request)?;
            }
            None => self.tier.apply(&mut cfg)?,
        }
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
