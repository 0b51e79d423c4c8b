//! Weights: from GGUF or a Hugging Face directory, drawn at random (tests,
//! GPU shapes), stored in another dtype, shared between engines.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

use super::*;

/// Undo llama.cpp's interleaving of Q/K rows so `rotate_half` RoPE applies.
pub(super) fn unpermute(w: Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.size2()?;
    let h = heads as i64;
    Ok(w.f_reshape([h, out / h / 2, 2, inp])?
        .f_transpose(1, 2)?
        .f_reshape([out, inp])?)
}

impl Llama {
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

    pub(super) fn assemble(
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
}
