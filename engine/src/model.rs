//! LLaMA in tch: RMSNorm, rotary embeddings (HF `rotate_half` layout),
//! grouped-query attention, SwiGLU, tied or separate output head.
//!
//! Touvron et al., "LLaMA: Open and Efficient Foundation Language Models"
//! (2023). Weights come from GGUF (dequantized at load; llama.cpp's Q/K row
//! permutation undone) or from a Hugging Face safetensors directory.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, Value};
use crate::kv::{KvDims, KvStore};

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

    fn check(&self) -> Result<()> {
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
fn check_tensor_set(g: &GgufFile, n_layers: usize) -> Result<()> {
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

struct Layer {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
}

/// A LLaMA-family decoder with its weights on one device in one dtype.
pub struct Llama {
    /// Dimensions.
    pub cfg: LlamaConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    /// RoPE cos / sin tables, `[positions, head_dim]`: built for the
    /// positions used so far (doubling as needed, up to the context length),
    /// not up front for whatever context a model file claims.
    rope: std::sync::Mutex<(Tensor, Tensor)>,
    device: Device,
    kind: Kind,
}

// SAFETY: the weight tensors are written only while the model is built
// (and by `with_weight_kind`, which takes it by value); afterwards every
// method reads them through `&self`, and libtorch ops that only read a
// tensor are safe from several threads (its handles count references
// atomically). The RoPE tables sit behind a mutex.
unsafe impl Sync for Llama {}

/// Positions the RoPE tables cover at first.
const ROPE_INITIAL: usize = 4096;

/// RoPE cos / sin tables for `positions` positions.
fn rope_tables(
    cfg: &LlamaConfig,
    positions: usize,
    kind: Kind,
    device: Device,
) -> Result<(Tensor, Tensor)> {
    let half = (cfg.head_dim / 2) as i64;
    let inv: Vec<f64> = (0..half)
        .map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / cfg.head_dim as f64))
        .collect();
    let inv = Tensor::f_from_slice(&inv)?;
    let pos = Tensor::f_arange(positions as i64, (Kind::Double, Device::Cpu))?;
    let freqs = pos.f_outer(&inv)?;
    let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
    let cos = emb.f_cos()?.f_to_kind(kind)?.f_to_device(device)?;
    let sin = emb.f_sin()?.f_to_kind(kind)?.f_to_device(device)?;
    Ok((cos, sin))
}

/// Undo llama.cpp's interleaving of Q/K rows so `rotate_half` RoPE applies.
fn unpermute(w: Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.size2()?;
    let h = heads as i64;
    Ok(w.f_reshape([h, out / h / 2, 2, inp])?
        .f_transpose(1, 2)?
        .f_reshape([out, inp])?)
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

    /// Loads a GGUF LLaMA model, dequantizing every tensor to `kind`.
    pub fn from_gguf(g: &GgufFile, device: Device, kind: Kind) -> Result<Self> {
        let cfg = Self::config_from_gguf(g)?;
        let load = |name: &str| -> Result<Tensor> {
            let (data, shape) = g.dequantize(name)?;
            let shape: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
            Ok(Tensor::f_from_slice(&data)?
                .f_reshape(shape)?
                .f_to_device(device)?
                .f_to_kind(kind)?)
        };
        let expect = |t: Tensor, name: &str, want: &[i64]| -> Result<Tensor> {
            if t.size() != want {
                return Err(EngineError::Model(format!(
                    "tensor {name} has shape {:?}, expected {want:?}",
                    t.size()
                )));
            }
            Ok(t)
        };
        let (d, hd, ff) = (cfg.d_model as i64, cfg.head_dim as i64, cfg.ffn as i64);
        let (nh, nkv) = (cfg.n_heads as i64, cfg.n_kv_heads as i64);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let t = |s: &str, shape: &[i64]| {
                let name = format!("blk.{i}.{s}.weight");
                expect(load(&name)?, &name, shape)
            };
            layers.push(Layer {
                attn_norm: t("attn_norm", &[d])?,
                wq: unpermute(t("attn_q", &[nh * hd, d])?, cfg.n_heads)?,
                wk: unpermute(t("attn_k", &[nkv * hd, d])?, cfg.n_kv_heads)?,
                wv: t("attn_v", &[nkv * hd, d])?,
                wo: t("attn_output", &[d, nh * hd])?,
                ffn_norm: t("ffn_norm", &[d])?,
                w_gate: t("ffn_gate", &[ff, d])?,
                w_up: t("ffn_up", &[ff, d])?,
                w_down: t("ffn_down", &[d, ff])?,
            });
        }
        let v = cfg.vocab as i64;
        let embed = expect(load("token_embd.weight")?, "token_embd.weight", &[v, d])?;
        let lm_head = if g.tensors.contains_key("output.weight") {
            expect(load("output.weight")?, "output.weight", &[v, d])?
        } else {
            embed.shallow_clone()
        };
        let norm = expect(load("output_norm.weight")?, "output_norm.weight", &[d])?;
        Self::assemble(cfg, embed, layers, norm, lm_head, device, kind)
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

    /// Loads a Hugging Face LLaMA directory (`config.json` + `*.safetensors`).
    pub fn from_hf_dir(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let text = std::fs::read_to_string(dir.join("config.json")).map_err(|e| {
            EngineError::Model(format!("{}: {e}", dir.join("config.json").display()))
        })?;
        let cfg = Self::config_from_hf_json(&text)?;
        let mut tensors = std::collections::HashMap::new();
        let entries = std::fs::read_dir(dir)
            .map_err(|e| EngineError::Model(format!("{}: {e}", dir.display())))?;
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                for (name, t) in Tensor::read_safetensors(&p)
                    .map_err(|e| EngineError::Model(format!("{}: {e}", p.display())))?
                {
                    tensors.insert(name, t);
                }
            }
        }
        let mut take = |name: &str| -> Result<Tensor> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| EngineError::Model(format!("safetensors: {name} missing")))?;
            Ok(t.f_to_device(device)?.f_to_kind(kind)?)
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: take(&format!("{p}.input_layernorm.weight"))?,
                wq: take(&format!("{p}.self_attn.q_proj.weight"))?,
                wk: take(&format!("{p}.self_attn.k_proj.weight"))?,
                wv: take(&format!("{p}.self_attn.v_proj.weight"))?,
                wo: take(&format!("{p}.self_attn.o_proj.weight"))?,
                ffn_norm: take(&format!("{p}.post_attention_layernorm.weight"))?,
                w_gate: take(&format!("{p}.mlp.gate_proj.weight"))?,
                w_up: take(&format!("{p}.mlp.up_proj.weight"))?,
                w_down: take(&format!("{p}.mlp.down_proj.weight"))?,
            });
        }
        let embed = take("model.embed_tokens.weight")?;
        let norm = take("model.norm.weight")?;
        let lm_head = match take("lm_head.weight") {
            Ok(t) => t,
            Err(_) => embed.shallow_clone(),
        };
        Self::assemble(cfg, embed, layers, norm, lm_head, device, kind)
    }

    /// Random weights (seeded) at `cfg`'s shape: for tests and GPU throughput
    /// runs at real model shapes without the real weights. Drawn on the CPU
    /// in f32, so the same seed gives the same model on every device.
    pub fn random(cfg: LlamaConfig, seed: i64, device: Device, kind: Kind) -> Result<Self> {
        Self::random_drawn_on(cfg, seed, device, kind, Device::Cpu)
    }

    /// [`random`](Self::random) with the weights drawn on `device` in
    /// `kind` itself: seconds instead of minutes for an 8B-parameter shape
    /// on a GPU, but the weights differ from the CPU's for the same seed.
    pub fn random_on_device(
        cfg: LlamaConfig,
        seed: i64,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        Self::random_drawn_on(cfg, seed, device, kind, device)
    }

    fn random_drawn_on(
        cfg: LlamaConfig,
        seed: i64,
        device: Device,
        kind: Kind,
        draw: Device,
    ) -> Result<Self> {
        cfg.check()?;
        // libtorch's generator is global: two models built at once (tests
        // run in parallel) would interleave their draws.
        static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _draws = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed);
        let (d, hd, ff, v) = (
            cfg.d_model as i64,
            cfg.head_dim as i64,
            cfg.ffn as i64,
            cfg.vocab as i64,
        );
        let (nh, nkv) = (cfg.n_heads as i64, cfg.n_kv_heads as i64);
        let w = |o: i64, i: i64| -> Result<Tensor> {
            let draw_kind = if draw == Device::Cpu {
                Kind::Float
            } else {
                kind
            };
            Ok(
                (Tensor::f_randn([o, i], (draw_kind, draw))? / (i as f64).sqrt())
                    .f_to_device(device)?
                    .f_to_kind(kind)?,
            )
        };
        let ones = |n: i64| -> Result<Tensor> { Ok(Tensor::f_ones([n], (kind, device))?) };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            layers.push(Layer {
                attn_norm: ones(d)?,
                wq: w(nh * hd, d)?,
                wk: w(nkv * hd, d)?,
                wv: w(nkv * hd, d)?,
                wo: w(d, nh * hd)?,
                ffn_norm: ones(d)?,
                w_gate: w(ff, d)?,
                w_up: w(ff, d)?,
                w_down: w(d, ff)?,
            });
        }
        let embed = w(v, d)?;
        let lm_head = embed.shallow_clone();
        let norm = ones(d)?;
        Self::assemble(cfg, embed, layers, norm, lm_head, device, kind)
    }

    fn assemble(
        cfg: LlamaConfig,
        embed: Tensor,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Tensor,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let rope = rope_tables(&cfg, cfg.max_ctx.min(ROPE_INITIAL), kind, device)?;
        Ok(Llama {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope: std::sync::Mutex::new(rope),
            device,
            kind,
        })
    }

    /// Stores the matrices (projections, embedding, output head) in
    /// `weight_kind` while activations, norms and attention stay in the
    /// compute dtype: f16 weights halve the bytes a CPU decode step streams
    /// from memory, and small-batch f16 GEMV is fast there. Larger batches
    /// (prefill) upcast the weight per call instead.
    pub fn with_weight_kind(mut self, weight_kind: Kind) -> Result<Self> {
        let conv = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_kind(weight_kind)?) };
        for l in &mut self.layers {
            for w in [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ] {
                *w = conv(w)?;
            }
        }
        let tied = self.lm_head.data_ptr() == self.embed.data_ptr();
        self.embed = conv(&self.embed)?;
        self.lm_head = if tied {
            self.embed.shallow_clone()
        } else {
            conv(&self.lm_head)?
        };
        Ok(self)
    }

    /// `x @ w^T`, bridging a weight stored in another dtype.
    fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if w.kind() == x.kind() {
            return Ok(x.f_linear::<Tensor>(w, None)?);
        }
        let rows = x.size().first().copied().unwrap_or(1);
        Ok(if rows <= 8 {
            x.f_to_kind(w.kind())?
                .f_linear::<Tensor>(w, None)?
                .f_to_kind(x.kind())?
        } else {
            x.f_linear::<Tensor>(&w.f_to_kind(x.kind())?, None)?
        })
    }

    /// The weights under Hugging Face LLaMA names (`model.layers.0.self_attn.q_proj.weight`,
    /// …), in the layout `from_hf_dir` loads: write them with
    /// `Tensor::write_safetensors` next to a `config.json` to export a model.
    pub fn named_weights(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![
            (
                "model.embed_tokens.weight".to_string(),
                self.embed.shallow_clone(),
            ),
            ("model.norm.weight".to_string(), self.norm.shallow_clone()),
        ];
        if self.lm_head.data_ptr() != self.embed.data_ptr() {
            v.push(("lm_head.weight".to_string(), self.lm_head.shallow_clone()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (name, t) in [
                ("input_layernorm", &l.attn_norm),
                ("self_attn.q_proj", &l.wq),
                ("self_attn.k_proj", &l.wk),
                ("self_attn.v_proj", &l.wv),
                ("self_attn.o_proj", &l.wo),
                ("post_attention_layernorm", &l.ffn_norm),
                ("mlp.gate_proj", &l.w_gate),
                ("mlp.up_proj", &l.w_up),
                ("mlp.down_proj", &l.w_down),
            ] {
                v.push((format!("{p}.{name}.weight"), t.shallow_clone()));
            }
        }
        v
    }

    /// A Hugging Face `config.json` for this model's dimensions.
    pub fn hf_config(&self) -> serde_json::Value {
        let c = &self.cfg;
        serde_json::json!({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": c.vocab,
            "hidden_size": c.d_model,
            "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.ffn,
            "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_ctx,
            "tie_word_embeddings": self.lm_head.data_ptr() == self.embed.data_ptr(),
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A second handle on the same weights (no copy): several engines, each
    /// with a cache of its own, run one loaded model.
    pub fn share(&self) -> Llama {
        let t = |x: &Tensor| x.shallow_clone();
        let rope = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        Llama {
            cfg: self.cfg.clone(),
            embed: t(&self.embed),
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    attn_norm: t(&l.attn_norm),
                    wq: t(&l.wq),
                    wk: t(&l.wk),
                    wv: t(&l.wv),
                    wo: t(&l.wo),
                    ffn_norm: t(&l.ffn_norm),
                    w_gate: t(&l.w_gate),
                    w_up: t(&l.w_up),
                    w_down: t(&l.w_down),
                })
                .collect(),
            norm: t(&self.norm),
            lm_head: t(&self.lm_head),
            rope: std::sync::Mutex::new((t(&rope.0), t(&rope.1))),
            device: self.device,
            kind: self.kind,
        }
    }

    /// The compute dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let xf = x.f_to_kind(Kind::Float)?;
        let var = xf
            .f_pow_tensor_scalar(2)?
            .f_mean_dim(-1, true, Kind::Float)?;
        let normed = (xf * (var + self.cfg.rms_eps).f_rsqrt()?).f_to_kind(self.kind)?;
        Ok(normed * w)
    }

    /// Positions the RoPE tables cover now (they grow with use).
    pub fn rope_positions(&self) -> usize {
        let t = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        t.0.size()[0] as usize
    }

    /// The cos/sin tables, grown to hold `need` positions.
    fn rope_tables(&self, need: usize) -> Result<(Tensor, Tensor)> {
        let mut t = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if (t.0.size()[0] as usize) < need {
            let positions = need.next_power_of_two().min(self.cfg.max_ctx).max(need);
            *t = rope_tables(&self.cfg, positions, self.kind, self.device)?;
        }
        Ok((t.0.shallow_clone(), t.1.shallow_clone()))
    }

    /// The cos/sin rows of positions `start..start + n`.
    fn rope_range(&self, start: i64, n: i64) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.rope_tables((start + n) as usize)?;
        Ok((cos.f_narrow(0, start, n)?, sin.f_narrow(0, start, n)?))
    }

    /// The cos/sin rows of `positions`, row `i` at `positions[i]`.
    fn rope_at(&self, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        let need = positions.iter().max().map_or(0, |&p| p + 1);
        let (cos, sin) = self.rope_tables(need)?;
        let pos: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let pos = Tensor::f_from_slice(&pos)?.f_to_device(self.device)?;
        Ok((cos.f_index_select(0, &pos)?, sin.f_index_select(0, &pos)?))
    }

    /// `x · cos + rotate_half(x) · sin`, the tables broadcast over heads.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (cos, sin) = (cos.f_unsqueeze(1)?, sin.f_unsqueeze(1)?);
        let half = (self.cfg.head_dim / 2) as i64;
        let x1 = x.f_narrow(-1, 0, half)?;
        let x2 = x.f_narrow(-1, half, half)?;
        let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
        Ok(x * cos + rotated * sin)
    }

    /// Checks that `tokens` may follow `start` positions.
    fn check_input(&self, tokens: &[u32], start: usize) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(EngineError::Request("empty input".into()));
        }
        if start + n > self.cfg.max_ctx {
            return Err(EngineError::Request(format!(
                "{} positions exceed the model's context of {} tokens",
                start + n,
                self.cfg.max_ctx
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(EngineError::Request(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        Ok(())
    }

    /// One decode step for many sequences at once: `tokens[i]` follows
    /// the positions already in `stores[i]`. The weights are read once
    /// for the whole batch (every linear layer is one `[batch, d]`
    /// matmul); attention runs per sequence over its own store. Returns
    /// logits `[batch, vocab]`, row `i` equal (up to rounding) to what
    /// [`forward`](Self::forward) of `tokens[i]` alone on `stores[i]`
    /// gives.
    ///
    /// Every store is prepared before the step and committed after it. On
    /// an error nothing is committed: stores prepared before it keep a
    /// pending step, which a paged view aborts when dropped (drop the
    /// views of a failed batch).
    pub fn forward_batch(&self, tokens: &[u32], stores: &mut [&mut dyn KvStore]) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        if tokens.len() != stores.len() {
            return Err(EngineError::Request(format!(
                "{} tokens for {} sequences",
                tokens.len(),
                stores.len()
            )));
        }
        let starts: Vec<usize> = stores.iter().map(|s| s.len()).collect();
        for (t, &start) in tokens.iter().zip(&starts) {
            self.check_input(std::slice::from_ref(t), start)?;
        }
        for s in stores.iter_mut() {
            s.prepare(1)?;
        }
        let (cos, sin) = self.rope_at(&starts)?;
        let x = self.decoder(tokens, &cos, &sin, &mut |l, q, k, v| {
            let mut att = Vec::with_capacity(stores.len());
            for (i, s) in stores.iter_mut().enumerate() {
                let row = |t: &Tensor| t.f_narrow(0, i as i64, 1);
                att.push(s.attend(l, &row(q)?, &row(k)?, &row(v)?)?);
            }
            Ok(Tensor::f_cat(&att, 0)?)
        })?;
        let logits = self.logits(&x)?;
        for s in stores.iter_mut() {
            s.commit(1)?;
        }
        Ok(logits)
    }

    /// Runs `tokens` through the model after the positions already in
    /// `store`, writing their K/V there. Returns logits `[n, vocab]` for every
    /// new token when `all_logits`, else `[1, vocab]` for the last one.
    pub fn forward(
        &self,
        tokens: &[u32],
        store: &mut dyn KvStore,
        all_logits: bool,
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let n = tokens.len();
        let start = store.len();
        self.check_input(tokens, start)?;
        store.prepare(n)?;
        let out = self.forward_inner(tokens, start, store, all_logits)?;
        store.commit(n)?;
        Ok(out)
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        start: usize,
        store: &mut dyn KvStore,
        all_logits: bool,
    ) -> Result<Tensor> {
        let n = tokens.len() as i64;
        let (cos, sin) = self.rope_range(start as i64, n)?;
        // The store writes this step's K/V and attends over every position
        // it holds (which ones, and how, is its business).
        let x = self.decoder(tokens, &cos, &sin, &mut |l, q, k, v| {
            store.attend(l, q, k, v)
        })?;
        let x = if all_logits {
            x
        } else {
            x.f_narrow(0, n - 1, 1)?
        };
        self.logits(&x)
    }

    /// The decoder stack over `tokens` (one row each), row `i` rotated by
    /// RoPE rows `cos[i]`, `sin[i]`: per layer, `attend(layer, q, k, v)`
    /// (`[rows, heads or kv_heads, head_dim]`) stores K/V and returns the
    /// attention output `[rows, heads, head_dim]`. Returns the hidden states
    /// `[rows, d_model]` before the final norm.
    fn decoder(
        &self,
        tokens: &[u32],
        cos: &Tensor,
        sin: &Tensor,
        attend: &mut dyn FnMut(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let n = tokens.len() as i64;
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::f_from_slice(&ids)?.f_to_device(self.device)?;
        let mut x = self.embed.f_index_select(0, &ids)?.f_to_kind(self.kind)?; // [n, d]
        let (nh, nkv, hd) = (c.n_heads as i64, c.n_kv_heads as i64, c.head_dim as i64);
        for (l, layer) in self.layers.iter().enumerate() {
            let h = self.rms_norm(&x, &layer.attn_norm)?;
            let q = self.linear(&h, &layer.wq)?.f_reshape([n, nh, hd])?;
            let k = self.linear(&h, &layer.wk)?.f_reshape([n, nkv, hd])?;
            let v = self.linear(&h, &layer.wv)?.f_reshape([n, nkv, hd])?;
            let q = self.rotate(&q, cos, sin)?;
            let k = self.rotate(&k, cos, sin)?;
            let att = attend(l, &q, &k, &v)?.f_reshape([n, nh * hd])?;
            x += self.linear(&att, &layer.wo)?;
            let h = self.rms_norm(&x, &layer.ffn_norm)?;
            let gate = self.linear(&h, &layer.w_gate)?.f_silu()?;
            let up = self.linear(&h, &layer.w_up)?;
            x += self.linear(&(gate * up), &layer.w_down)?;
        }
        Ok(x)
    }

    /// Final norm and output head: logits `[rows, vocab]` in f32.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.rms_norm(x, &self.norm)?;
        Ok(self.linear(&x, &self.lm_head)?.f_to_kind(Kind::Float)?)
    }
}
