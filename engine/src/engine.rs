//! [`Engine`]: a model, its tokenizer and a paged KV cache, built from an
//! [`EngineConfig`]; the parsers of device and dtype names.

use std::path::Path;

use kvforge_coordinator::{DedupConfig, LifecycleConfig};
use tch::{Device, Kind};

use crate::attention::ReferenceBackend;
use crate::cache::PagedKvCache;
use crate::error::{EngineError, Result};
use crate::gguf;
use crate::model::{Llama, LlamaConfig};
use crate::policies::Policies;
use crate::tier::KvQuant;
use crate::tokenizer::Tokenizer;

/// The number of CUDA devices libtorch sees (0 without a GPU, a driver or
/// a CUDA build of libtorch).
pub fn cuda_devices() -> usize {
    if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

/// Waits until every kernel queued on `device` has run (a no-op on the
/// CPU): what a timing of GPU work must call before reading the clock.
pub fn synchronize(device: Device) {
    if let Device::Cuda(n) = device {
        tch::Cuda::synchronize(n as i64);
    }
}

/// Sets how many threads libtorch's CPU kernels (intra-op) and the
/// kernels' quantized matmul use, for the whole process; 0 or less leaves
/// the defaults (the matmul's pool is built once, at its first use: a
/// later call changes libtorch's only).
pub fn set_cpu_threads(n: i32) {
    if n > 0 {
        tch::set_num_threads(n);
        kvforge_kernels::set_global_threads(n as usize);
    }
}

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
    let count = cuda_devices();
    if count == 0 {
        return Err(EngineError::Device(
            "CUDA requested but not available (no GPU, no driver, or a CPU-only libtorch)".into(),
        ));
    }
    if let Device::Cuda(n) = device {
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
///
/// Front ends drive it through [`prefill`](Engine::prefill) and
/// [`decode`](Engine::decode), which take and return token ids and logits
/// rows, never tensors; the parts are reached through the accessors below.
pub struct Engine {
    pub(crate) model: Llama,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) cache: PagedKvCache,
}

/// How to size and place an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Device for weights and KV.
    pub device: Device,
    /// Compute dtype.
    pub kind: Kind,
    /// Storage of the weight matrices: `None` keeps a GGUF model's
    /// matrices in the file's blocks on the CPU with f32 compute (the
    /// kernels' quantized matmul: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K;
    /// other formats, devices and dtypes dequantize to the compute dtype);
    /// `Some(kind)` stores them dense in `kind`.
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
    /// Sharing of identical cold blocks (needs `kv_quant`).
    pub dedup: Option<DedupConfig>,
    /// Dropping old turns at turn ends.
    pub lifecycle: Option<LifecycleConfig>,
    /// Bytes all KV tiers may hold in use (0 = the hot tier's capacity).
    pub kv_budget: u64,
    /// How attention reads the cache.
    pub attention: Attention,
    /// The policy objects: eviction and which hot blocks go cold (filled
    /// by [`Mechanisms::apply`](crate::mechanisms::Mechanisms::apply) and
    /// [`evict_with`](Self::evict_with) from the registry's names, or
    /// directly with a researcher's own).
    pub policies: Policies,
}

/// The attention backend a cache uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// [`ReferenceBackend`]: gather + SDPA for every step.
    Reference,
    /// [`FusedBackend`](crate::fused::FusedBackend): the paged kernel for CPU decode steps, the
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
            dedup: None,
            lifecycle: None,
            kv_budget: 0,
            attention: Attention::Fused,
            policies: Policies::default(),
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
            let blocks =
                cfg.weight_kind.is_none() && cfg.device == Device::Cpu && cfg.kind == Kind::Float;
            let model = if blocks {
                Llama::from_gguf_blocks(&g)?
            } else {
                Llama::from_gguf(&g, cfg.device, cfg.kind)?
            };
            (model, Tokenizer::from_gguf(&g)?)
        };
        Self::new(model, tokenizer, cfg)
    }

    /// A 128-bit fingerprint of the model: its dimensions, every weight's
    /// bytes and its tokenizer. Two engines share KV through a remote tier
    /// only under the same fingerprint. Reads every weight once.
    pub fn fingerprint(&self) -> Result<u128> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"kvforge/model/v1\0");
        self.model.fingerprint(&mut h)?;
        h.update(self.tokenizer.to_json()?.as_bytes());
        Ok(h.digest128())
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model's dimensions.
    pub fn model_config(&self) -> &LlamaConfig {
        &self.model.cfg
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The KV cache (its views, statistics and sequence operations).
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// The KV cache, to reconfigure it (cold tier, remote tier, policies,
    /// attention backend).
    pub fn cache_mut(&mut self) -> &mut PagedKvCache {
        &mut self.cache
    }

    /// Wraps a model and tokenizer with a fresh cache.
    pub fn new(model: Llama, tokenizer: Tokenizer, cfg: &EngineConfig) -> Result<Self> {
        let model = match cfg.weight_kind {
            Some(k) if k != model.kind() || model.has_block_weights() => {
                model.with_weight_kind(k)?
            }
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
        c.dedup = cfg.dedup;
        c.lifecycle = cfg.lifecycle;
        c.budget_bytes = cfg.kv_budget;
        cache.configure_with(c, cfg.kv_quant, cfg.policies.clone())?;
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
