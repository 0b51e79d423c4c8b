//! [`LlamaConfig`]: a model's dimensions, read from GGUF metadata or a
//! Hugging Face `config.json`, and checked before any weight is loaded.

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, Value};
use crate::kv::KvDims;

use super::*;

/// Model dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// SwiGLU hidden size.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Maximum positions.
    pub max_ctx: usize,
}

impl From<&LlamaConfig> for KvDims {
    fn from(c: &LlamaConfig) -> Self {
        KvDims {
            layers: c.n_layers,
            kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        }
    }
}

impl LlamaConfig {
    /// A tiny config for tests with random weights.
    pub fn tiny() -> Self {
        LlamaConfig {
            vocab: 97,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            ffn: 64,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            max_ctx: 512,
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Model(m));
        if [
            self.vocab,
            self.d_model,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.ffn,
            self.max_ctx,
        ]
        .contains(&0)
        {
            return bad(format!("config has a zero dimension: {self:?}"));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return bad(format!(
                "{} query heads not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim % 2 != 0 {
            return bad(format!(
                "head dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        // Ranges, checked before anything is allocated from them: a file's
        // claim of 2^32 layers or 2^31 positions is an error, not an abort.
        for (what, v, max) in [
            ("vocabulary", self.vocab, Self::MAX_VOCAB),
            ("hidden size", self.d_model, Self::MAX_DIM),
            ("layer count", self.n_layers, Self::MAX_LAYERS),
            ("head count", self.n_heads, Self::MAX_HEADS),
            ("head dim", self.head_dim, Self::MAX_HEAD_DIM),
            ("feed-forward size", self.ffn, Self::MAX_FFN),
            ("context length", self.max_ctx, Self::MAX_CTX),
        ] {
            if v > max {
                return bad(format!("{what} {v} is above the supported {max}"));
            }
        }
        if self.n_kv_heads > self.n_heads {
            return bad(format!(
                "{} KV heads is more than the {} query heads",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return bad(format!(
                "RMSNorm epsilon {} must be finite and in (0, 1)",
                self.rms_eps
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta >= 1.0) {
            return bad(format!(
                "RoPE base {} must be finite and at least 1",
                self.rope_theta
            ));
        }
        Ok(())
    }

    /// Largest vocabulary a model file may claim.
    pub const MAX_VOCAB: usize = 1 << 22;
    /// Largest hidden size.
    pub const MAX_DIM: usize = 1 << 16;
    /// Most transformer blocks.
    pub const MAX_LAYERS: usize = 1024;
    /// Most query heads.
    pub const MAX_HEADS: usize = 1024;
    /// Largest head dimension.
    pub const MAX_HEAD_DIM: usize = 1024;
    /// Largest feed-forward size.
    pub const MAX_FFN: usize = 1 << 20;
    /// Longest context (the RoPE tables grow to it only as positions are
    /// used).
    pub const MAX_CTX: usize = 1 << 20;
}

/// The tensors of a LLaMA GGUF with `n_layers` blocks, exactly: a missing
/// one, or one the architecture does not have (a block past `n_layers`, say,
/// when the layer count was edited), is an error.
pub(super) fn check_tensor_set(g: &GgufFile, n_layers: usize) -> Result<()> {
    const PER_LAYER: [&str; 9] = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let mut want: std::collections::BTreeSet<String> = (0..n_layers)
        .flat_map(|i| PER_LAYER.iter().map(move |t| format!("blk.{i}.{t}.weight")))
        .collect();
    want.extend(["token_embd.weight".into(), "output_norm.weight".into()]);
    if let Some(missing) = want.iter().find(|n| !g.tensors.contains_key(n.as_str())) {
        return Err(EngineError::Model(format!("GGUF tensor {missing} missing")));
    }
    // Optional: an untied output head.
    let extra = g
        .tensors
        .keys()
        .find(|n| n.as_str() != "output.weight" && !want.contains(n.as_str()));
    if let Some(extra) = extra {
        return Err(EngineError::Model(format!(
            "GGUF tensor {extra} does not belong to a {n_layers}-layer LLaMA (is llama.block_count right?)"
        )));
    }
    Ok(())
}

impl Llama {
    /// The checked configuration of a LLaMA GGUF: architecture,
    /// hyperparameters in range, the tensor set matching the layer count.
    /// Allocates nothing from the file's claims.
    pub fn config_from_gguf(g: &GgufFile) -> Result<LlamaConfig> {
        let arch = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "architecture {arch:?}; only \"llama\" is supported"
            )));
        }
        let u = |k: &str| -> Result<usize> { Ok(g.u64(&format!("llama.{k}"))? as usize) };
        let f = |k: &str, d: f64| {
            g.get(&format!("llama.{k}"))
                .and_then(Value::as_f64)
                .unwrap_or(d)
        };
        let d_model = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = g
            .get("llama.attention.head_count_kv")
            .and_then(Value::as_u64)
            .map_or(n_heads, |v| v as usize);
        let vocab = match g.get("llama.vocab_size").and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => g
                .tensors
                .get("token_embd.weight")
                .map(|t| t.shape[0])
                .unwrap_or(0),
        };
        let cfg = LlamaConfig {
            vocab,
            d_model,
            n_layers: u("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim: g
                .get("llama.rope.dimension_count")
                .and_then(Value::as_u64)
                .map_or(d_model / n_heads.max(1), |v| v as usize),
            ffn: u("feed_forward_length")?,
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: f("rope.freq_base", 10_000.0),
            max_ctx: u("context_length")?,
        };
        cfg.check()?;
        check_tensor_set(g, cfg.n_layers)?;
        Ok(cfg)
    }

    /// The checked configuration in a Hugging Face `config.json`.
    pub fn config_from_hf_json(text: &str) -> Result<LlamaConfig> {
        let j: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| EngineError::Model(format!("config.json: {e}")))?;
        let arch = j["model_type"].as_str().unwrap_or("");
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "model_type {arch:?}; only \"llama\" is supported"
            )));
        }
        let n = |k: &str| -> Result<usize> {
            j[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Model(format!("config.json: {k} missing")))
        };
        let d_model = n("hidden_size")?;
        let n_heads = n("num_attention_heads")?;
        let cfg = LlamaConfig {
            vocab: n("vocab_size")?,
            d_model,
            n_layers: n("num_hidden_layers")?,
            n_heads,
            n_kv_heads: j["num_key_value_heads"]
                .as_u64()
                .map_or(n_heads, |v| v as usize),
            head_dim: j["head_dim"]
                .as_u64()
                .map_or(d_model / n_heads.max(1), |v| v as usize),
            ffn: n("intermediate_size")?,
            rms_eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-5),
            rope_theta: j["rope_theta"].as_f64().unwrap_or(10_000.0),
            max_ctx: n("max_position_embeddings")?,
        };
        cfg.check()?;
        Ok(cfg)
    }
}
