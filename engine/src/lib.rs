//! The kvforge engine: a LLaMA forward pass in `tch` (libtorch) on CPU and
//! CUDA, with its KV cache in fixed-size blocks handed out by
//! `kvforge-pool`, and the `kvforge` command line.
//!
//! # Layers
//!
//! * [`gguf`]: a GGUF reader (metadata, tensor table, dequantization).
//! * [`tokenizer`]: GPT-2 byte-level BPE from GGUF metadata or
//!   `tokenizer.json`; the ChatML template.
//! * [`model`]: [`Llama`] — weights and the forward pass over a [`KvStore`].
//! * [`cache`]: [`PagedKvCache`] — the tensors behind the blocks of the
//!   tensor-free [`Coordinator`] (`kvforge-coordinator`, which owns the
//!   block tables, tiered pools, prefix index and policies): each forward
//!   step plans, carries the plan out (writes, quantization into the cold
//!   tier, [`KvQuant`]), attends, and commits or aborts. Also
//!   [`ContiguousCache`], a test oracle.
//! * [`attention`]: the [`AttentionBackend`] seam and its
//!   [`ReferenceBackend`] (gather + SDPA over a [`StepView`]);
//!   [`fused`]: [`FusedBackend`], decode steps through `kvforge-kernels`'
//!   paged attention (the table read in place, one pass).
//! * [`generate`]: seeded sampling and the generation loop.
//! * [`ppl`]: window and streaming perplexity over the cache.
//! * [`manager`]: [`CacheManager`] — prefix reuse across turns, requests and
//!   sessions through a `kvforge-prefix` index, with metrics;
//!   [`metrics`]: the same snapshot in Prometheus' text format.
//!
//! # Invariants
//!
//! * The paged cache never reads a slot it did not write for that sequence:
//!   positions map to `block.index() * block_size + offset` through the
//!   sequence's own block table.
//! * A failed forward step leaves the sequence's length unchanged.
//! * Every bad input (file, request, parameter, device) is an
//!   [`EngineError`] with a one-line message; nothing on those paths panics.

#![deny(missing_docs)]

pub mod attention;
pub mod cache;
pub mod constrain;
mod error;
pub mod fused;
pub mod generate;
pub mod gguf;
pub mod lifecycle;
pub mod manager;
pub mod metrics;
pub mod model;
pub mod ppl;
mod tier;
pub mod tokenizer;

use std::path::Path;

pub use attention::{Attended, AttentionBackend, KvTensors, Observe, ReferenceBackend, StepView};
pub use cache::{ContiguousCache, KvStore, PagedKvCache, Sequence};
pub use constrain::{Constrained, Constraint};
pub use error::{EngineError, Result};
pub use fused::FusedBackend;
pub use generate::{Generation, Sampler, SamplingParams};
pub use kvforge_coordinator::{
    Coordinator, CoordinatorConfig, DedupConfig, EvictionConfig, LabelSource, LifecycleConfig,
    Score, SimHashConfig, Trigger,
};
pub use kvforge_kernels::DEFAULT_MIN_SPLIT;
pub use kvforge_kernels::Isa;
pub use kvforge_quant::Axis;
pub use lifecycle::LifecycleReport;
pub use manager::{CacheManager, IndexKind, ReuseConfig, SessionId, TurnReport, TurnTail};
pub use model::{Llama, LlamaConfig};
pub use ppl::PplReport;
/// The libtorch bindings this engine is built on (threads, CUDA queries).
pub use tch;
pub use tch::{Device, Kind, Tensor};
pub use tier::{ColdBlock, KvQuant};
pub use tokenizer::{Message, Tokenizer};

/// Parses `cpu`, `cuda` or `cuda:N`, checking that CUDA is usable.
pub fn parse_device(s: &str) -> Result<Device> {
    let device = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => Device::Cuda(0),
        other => match other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => Device::Cuda(n),
            None => {
                return Err(EngineError::Device(format!(
                    "unknown device {s:?}; use cpu, cuda or cuda:N"
                )));
            }
        },
    };
    if !tch::Cuda::is_available() {
        return Err(EngineError::Device(
            "CUDA requested but not available (no GPU, no driver, or a CPU-only libtorch)".into(),
        ));
    }
    if let Device::Cuda(n) = device {
        let count = tch::Cuda::device_count() as usize;
        if n >= count {
            return Err(EngineError::Device(format!(
                "cuda:{n} requested but only {count} GPU(s) present"
            )));
        }
    }
    Ok(device)
}

/// Parses `f32`, `bf16` or `f16`.
pub fn parse_dtype(s: &str) -> Result<Kind> {
    match s {
        "f32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "f16" | "float16" => Ok(Kind::Half),
        _ => Err(EngineError::Request(format!(
            "unknown dtype {s:?}; use f32, bf16 or f16"
        ))),
    }
}

/// A model, its tokenizer and a paged KV cache.
pub struct Engine {
    /// The model.
    pub model: Llama,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The KV cache.
    pub cache: PagedKvCache,
}

/// How to size and place an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Device for weights and KV.
    pub device: Device,
    /// Compute dtype.
    pub kind: Kind,
    /// Storage dtype of the weight matrices (`None` = the compute dtype).
    pub weight_kind: Option<Kind>,
    /// Storage dtype of the KV cache (`None` = the compute dtype). The
    /// default is f16 on every device: what vLLM or llama.cpp users pay,
    /// and the fused decode kernel reads f16 pages at least as fast as
    /// f32 ones (`cargo xtask decode-ab --kv-dtypes f32,f16`).
    pub kv_kind: Option<Kind>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in tokens (0 = the model's context length).
    pub kv_tokens: usize,
    /// A quantized cold tier for tokens older than its window.
    pub kv_quant: Option<KvQuant>,
    /// Eviction (StreamingLLM's sink plus recent window).
    pub eviction: Option<EvictionConfig>,
    /// Sharing of identical cold blocks (needs `kv_quant`).
    pub dedup: Option<DedupConfig>,
    /// Dropping old turns at turn ends.
    pub lifecycle: Option<LifecycleConfig>,
    /// Bytes all KV tiers may hold in use (0 = the hot tier's capacity).
    pub kv_budget: u64,
    /// How attention reads the cache.
    pub attention: Attention,
}

/// The attention backend a cache uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// [`ReferenceBackend`]: gather + SDPA for every step.
    Reference,
    /// [`FusedBackend`]: the paged kernel for CPU decode steps, the
    /// reference for the rest.
    #[default]
    Fused,
}

impl Attention {
    /// `reference` or `fused`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "reference" => Ok(Attention::Reference),
            "fused" => Ok(Attention::Fused),
            _ => Err(EngineError::Request(format!(
                "unknown attention backend {name:?}; choose reference or fused"
            ))),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: Device::Cpu,
            kind: Kind::Float,
            weight_kind: None,
            kv_kind: Some(Kind::Half),
            block_size: 16,
            kv_tokens: 0,
            kv_quant: None,
            eviction: None,
            dedup: None,
            lifecycle: None,
            kv_budget: 0,
            attention: Attention::Fused,
        }
    }
}

impl Engine {
    /// Loads a GGUF file, or a Hugging Face directory (`config.json`,
    /// `*.safetensors`, `tokenizer.json`).
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Self> {
        let (model, tokenizer) = if path.is_dir() {
            let model = Llama::from_hf_dir(path, cfg.device, cfg.kind)?;
            let tok = Tokenizer::from_file(&path.join("tokenizer.json"), "<|im_end|>")
                .or_else(|_| Tokenizer::from_file(&path.join("tokenizer.json"), "</s>"))?;
            (model, tok)
        } else {
            let g = gguf::GgufFile::open(path)?;
            let model = Llama::from_gguf(&g, cfg.device, cfg.kind)?;
            (model, Tokenizer::from_gguf(&g)?)
        };
        Self::new(model, tokenizer, cfg)
    }

    /// Wraps a model and tokenizer with a fresh cache.
    pub fn new(model: Llama, tokenizer: Tokenizer, cfg: &EngineConfig) -> Result<Self> {
        let model = match cfg.weight_kind {
            Some(k) if k != model.kind() => model.with_weight_kind(k)?,
            _ => model,
        };
        let kv = if cfg.kv_tokens == 0 {
            model.cfg.max_ctx
        } else {
            cfg.kv_tokens
        };
        let kv_kind = cfg.kv_kind.unwrap_or(model.kind());
        let mut cache = PagedKvCache::new(&model.cfg, cfg.block_size, kv, model.device(), kv_kind)?;
        let mut c = cache.base_config();
        c.eviction = cfg.eviction;
        c.dedup = cfg.dedup;
        c.lifecycle = cfg.lifecycle;
        c.budget_bytes = cfg.kv_budget;
        cache.configure(c, cfg.kv_quant)?;
        if cfg.attention == Attention::Reference {
            cache.set_backend(Box::new(ReferenceBackend));
        }
        Ok(Engine {
            model,
            tokenizer,
            cache,
        })
    }
}
