//! Weights from a Hugging Face directory, drawn at random (tests, GPU
//! shapes), stored in another dtype, exported, shared between engines
//! (`from_gguf.rs`: from a GGUF file).

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};

use super::*;

impl Llama {
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
            let attn_norm = take(&format!("{p}.input_layernorm.weight"))?;
            let ffn_norm = take(&format!("{p}.post_attention_layernorm.weight"))?;
            let mut m = |s: &str| Ok::<_, EngineError>(Weight::Dense(take(&format!("{p}.{s}"))?));
            layers.push(Layer {
                attn_norm,
                wq: m("self_attn.q_proj.weight")?,
                wk: m("self_attn.k_proj.weight")?,
                wv: m("self_attn.v_proj.weight")?,
                wo: m("self_attn.o_proj.weight")?,
                ffn_norm,
                w_gate: m("mlp.gate_proj.weight")?,
                w_up: m("mlp.up_proj.weight")?,
                w_down: m("mlp.down_proj.weight")?,
            });
        }
        let embed = Weight::Dense(take("model.embed_tokens.weight")?);
        let norm = take("model.norm.weight")?;
        let lm_head = match take("lm_head.weight") {
            Ok(t) => Weight::Dense(t),
            Err(_) => embed.share(),
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

    pub(super) fn random_drawn_on(
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
        let w = |o: i64, i: i64| -> Result<Weight> {
            let draw_kind = if draw == Device::Cpu {
                Kind::Float
            } else {
                kind
            };
            Ok(Weight::Dense(
                (Tensor::f_randn([o, i], (draw_kind, draw))? / (i as f64).sqrt())
                    .f_to_device(device)?
                    .f_to_kind(kind)?,
            ))
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
        let lm_head = embed.share();
        let norm = ones(d)?;
        Self::assemble(cfg, embed, layers, norm, lm_head, device, kind)
    }

    pub(super) fn assemble(
        cfg: LlamaConfig,
        embed: Weight,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Weight,
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
    /// compute dtype (GGUF blocks dequantized): f16 weights halve the bytes
    /// a CPU decode step streams from memory, and small-batch f16 GEMV is
    /// fast there. Larger batches (prefill) upcast the weight per call
    /// instead.
    pub fn with_weight_kind(mut self, weight_kind: Kind) -> Result<Self> {
        let device = self.device;
        let conv =
            |w: &Weight| -> Result<Weight> { Ok(Weight::Dense(w.dense(weight_kind, device)?)) };
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
        let tied = self.lm_head.same(&self.embed);
        self.embed = conv(&self.embed)?;
        self.lm_head = if tied {
            self.embed.share()
        } else {
            conv(&self.lm_head)?
        };
        Ok(self)
    }

    /// Whether the matrices are GGUF blocks the kernels read (else dense
    /// tensors).
    pub fn has_block_weights(&self) -> bool {
        matches!(self.lm_head, Weight::Blocks(_))
            || self
                .layers
                .iter()
                .any(|l| matches!(l.wq, Weight::Blocks(_)))
    }

    /// Bytes the weights hold (matrices as stored, norms).
    pub fn weight_bytes(&self) -> usize {
        let t = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        let w = |w: &Weight| match w {
            Weight::Dense(x) => t(x),
            Weight::Blocks(q) => q.bytes(),
        };
        let head = if self.lm_head.same(&self.embed) {
            0
        } else {
            w(&self.lm_head)
        };
        w(&self.embed)
            + head
            + t(&self.norm)
            + self
                .layers
                .iter()
                .map(|l| {
                    t(&l.attn_norm)
                        + t(&l.ffn_norm)
                        + l.matrices().iter().map(|m| w(m)).sum::<usize>()
                })
                .sum::<usize>()
    }

    /// The weights under Hugging Face LLaMA names (`model.layers.0.self_attn.q_proj.weight`,
    /// …), in the layout `from_hf_dir` loads (GGUF blocks dequantized to
    /// the compute dtype): write them with `Tensor::write_safetensors` next
    /// to a `config.json` to export a model.
    pub fn named_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let dense = |w: &Weight| w.dense(self.kind, self.device);
        let mut v = vec![
            ("model.embed_tokens.weight".to_string(), dense(&self.embed)?),
            ("model.norm.weight".to_string(), self.norm.shallow_clone()),
        ];
        if !self.lm_head.same(&self.embed) {
            v.push(("lm_head.weight".to_string(), dense(&self.lm_head)?));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            v.push((
                format!("{p}.input_layernorm.weight"),
                l.attn_norm.shallow_clone(),
            ));
            v.push((
                format!("{p}.post_attention_layernorm.weight"),
                l.ffn_norm.shallow_clone(),
            ));
            for (name, w) in [
                ("self_attn.q_proj", &l.wq),
                ("self_attn.k_proj", &l.wk),
                ("self_attn.v_proj", &l.wv),
                ("self_attn.o_proj", &l.wo),
                ("mlp.gate_proj", &l.w_gate),
                ("mlp.up_proj", &l.w_up),
                ("mlp.down_proj", &l.w_down),
            ] {
                v.push((format!("{p}.{name}.weight"), dense(w)?));
            }
        }
        Ok(v)
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
            "tie_word_embeddings": self.lm_head.same(&self.embed),
        })
    }

    /// A second handle on the same weights (no copy): several engines, each
    /// with a cache of its own, run one loaded model.
    pub fn share(&self) -> Llama {
        let t = |x: &Tensor| x.shallow_clone();
        let rope = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        Llama {
            cfg: self.cfg.clone(),
            embed: self.embed.share(),
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    attn_norm: t(&l.attn_norm),
                    wq: l.wq.share(),
                    wk: l.wk.share(),
                    wv: l.wv.share(),
                    wo: l.wo.share(),
                    ffn_norm: t(&l.ffn_norm),
                    w_gate: l.w_gate.share(),
                    w_up: l.w_up.share(),
                    w_down: l.w_down.share(),
                })
                .collect(),
            norm: t(&self.norm),
            lm_head: self.lm_head.share(),
            rope: std::sync::Mutex::new((t(&rope.0), t(&rope.1))),
            device: self.device,
            kind: self.kind,
        }
    }
}
