//! Weights from a GGUF file: dequantized to a dtype, or on the CPU kept in
//! the file's blocks for the kernels' quantized matmul; llama.cpp's
//! interleaving of the Q/K rows undone either way.

use std::borrow::Cow;
use std::sync::Arc;

use kvforge_kernels::QMatrix;
use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

use super::*;

/// GGUF tensor `name` (`want` = `[rows, cols]`) in its blocks, if the
/// kernels read its format; its rows reordered as [`unpermute`] would for
/// `heads`.
fn block_matrix(
    g: &GgufFile,
    name: &str,
    want: [i64; 2],
    heads: Option<usize>,
) -> Result<Option<QMatrix>> {
    let (dtype, bytes, shape) = g.raw(name)?;
    let Some(format) = dtype.weight_format() else {
        return Ok(None);
    };
    let (rows, cols) = (want[0] as usize, want[1] as usize);
    if shape != [rows, cols] {
        return Err(EngineError::Model(format!(
            "tensor {name} has shape {shape:?}, expected {want:?}"
        )));
    }
    if cols % format.block().0 != 0 || cols % kvforge_kernels::qmatmul::BLOCK != 0 {
        return Ok(None);
    }
    let bytes = match heads {
        None => Cow::Borrowed(bytes),
        Some(h) => {
            let (per_row, per_head) = (bytes.len() / rows, rows / h);
            let half = per_head / 2;
            let mut out = Vec::with_capacity(bytes.len());
            for r in 0..rows {
                let (head, rem) = (r / per_head, r % per_head);
                let old = head * per_head + 2 * (rem % half) + rem / half;
                out.extend_from_slice(&bytes[old * per_row..(old + 1) * per_row]);
            }
            Cow::Owned(out)
        }
    };
    Ok(Some(QMatrix::from_ggml(format, rows, cols, &bytes)?))
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
    /// Loads a GGUF LLaMA model, dequantizing every tensor to `kind`.
    pub fn from_gguf(g: &GgufFile, device: Device, kind: Kind) -> Result<Self> {
        Self::gguf(g, device, kind, false)
    }

    /// Loads a GGUF LLaMA model on the CPU in f32, its matrices kept in
    /// the file's blocks where the kernels read the format (Q4_0, Q4_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K), the others dequantized.
    pub fn from_gguf_blocks(g: &GgufFile) -> Result<Self> {
        Self::gguf(g, Device::Cpu, Kind::Float, true)
    }

    fn gguf(g: &GgufFile, device: Device, kind: Kind, blocks: bool) -> Result<Self> {
        let cfg = Self::config_from_gguf(g)?;
        let load = |name: &str, want: &[i64]| -> Result<Tensor> {
            let (data, shape) = g.dequantize(name)?;
            let shape: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
            if shape != want {
                return Err(EngineError::Model(format!(
                    "tensor {name} has shape {shape:?}, expected {want:?}"
                )));
            }
            Ok(Tensor::f_from_slice(&data)?
                .f_reshape(shape)?
                .f_to_device(device)?
                .f_to_kind(kind)?)
        };
        let matrix = |name: &str, want: [i64; 2], heads: Option<usize>| -> Result<Weight> {
            if blocks {
                if let Some(q) = block_matrix(g, name, want, heads)? {
                    return Ok(Weight::Blocks(Arc::new(q)));
                }
            }
            let t = load(name, &want)?;
            Ok(Weight::Dense(match heads {
                Some(h) => unpermute(t, h)?,
                None => t,
            }))
        };
        let (d, hd, ff) = (cfg.d_model as i64, cfg.head_dim as i64, cfg.ffn as i64);
        let (nh, nkv) = (cfg.n_heads as i64, cfg.n_kv_heads as i64);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let name = |s: &str| format!("blk.{i}.{s}.weight");
            let m = |s: &str, want: [i64; 2]| matrix(&name(s), want, None);
            layers.push(Layer {
                attn_norm: load(&name("attn_norm"), &[d])?,
                wq: matrix(&name("attn_q"), [nh * hd, d], Some(cfg.n_heads))?,
                wk: matrix(&name("attn_k"), [nkv * hd, d], Some(cfg.n_kv_heads))?,
                wv: m("attn_v", [nkv * hd, d])?,
                wo: m("attn_output", [d, nh * hd])?,
                ffn_norm: load(&name("ffn_norm"), &[d])?,
                w_gate: m("ffn_gate", [ff, d])?,
                w_up: m("ffn_up", [ff, d])?,
                w_down: m("ffn_down", [d, ff])?,
            });
        }
        let v = cfg.vocab as i64;
        let embed = matrix("token_embd.weight", [v, d], None)?;
        let lm_head = if g.tensors.contains_key("output.weight") {
            matrix("output.weight", [v, d], None)?
        } else {
            embed.share()
        };
        let norm = load("output_norm.weight", &[d])?;
        Self::assemble(cfg, embed, layers, norm, lm_head, device, kind)
    }
}
