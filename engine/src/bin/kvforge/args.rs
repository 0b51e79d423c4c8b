//! The flags every command shares: the model and how it runs, sampling,
//! the cache's mechanisms (flags, or a mechanisms file with `--config`),
//! and a chat's prefix reuse and metrics.

use std::path::PathBuf;

use clap::Args;
use kvforge_engine::{
    Attention, CacheManager, Engine, EngineConfig, EngineError, IndexKind, Mechanisms, Message,
    Registry, ReuseConfig, SamplingParams, Tokenizer, TurnTail, parse_device, parse_dtype,
};

use super::flags::MechanismFlags;
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
    /// Weight storage dtype: f32, bf16 or f16 (dense). Default: a GGUF
    /// model's matrices stay in the file's blocks (read by the quantized
    /// matmul) on the CPU with f32 compute; elsewhere --dtype.
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
    pub(crate) mechanisms: MechanismFlags,
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
        self.mechanisms.spec()?;
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
        if let Some(flag) = self.mechanisms.given().or_else(|| self.mechanisms.detail()) {
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

    /// How `engine` stores its weight matrices: `gguf` (the file's
    /// blocks) or a dtype.
    pub(crate) fn weights_label<'a>(&'a self, engine: &Engine) -> &'a str {
        if engine.model().has_block_weights() {
            "gguf"
        } else {
            self.weights.as_deref().unwrap_or(&self.dtype)
        }
    }

    pub(crate) fn engine(&self) -> Result<Engine, EngineError> {
        self.check()?;
        kvforge_engine::set_cpu_threads(self.threads);
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
            None => self.mechanisms.apply(&mut cfg)?,
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
