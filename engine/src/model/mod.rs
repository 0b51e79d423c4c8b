//! LLaMA in tch: RMSNorm, rotary embeddings (HF `rotate_half` layout),
//! grouped-query attention, SwiGLU, tied or separate output head.
//!
//! Touvron et al., "LLaMA: Open and Efficient Foundation Language Models"
//! (2023). Weights come from GGUF (on the CPU kept in the file's blocks,
//! which the kernels' quantized matmul reads, or dequantized at load;
//! llama.cpp's Q/K row permutation undone either way) or from a Hugging
//! Face safetensors directory.
//!
//! `config.rs`: the dimensions; `from_gguf.rs` and `load.rs`: the
//! weights; `weight.rs`: a matrix dense or in blocks; `fused.rs`: RMSNorm,
//! RoPE and SwiGLU as one loop each on f32 CPU tensors; here: the forward
//! pass over a [`KvStore`].

use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::kv::KvStore;

mod config;
mod from_gguf;
mod fused;
mod load;
mod weight;

pub use config::LlamaConfig;
use weight::{Weight, matmul_blocks};

struct Layer {
    attn_norm: Tensor,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Tensor,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

impl Layer {
    /// The matrices, in the order of the forward pass.
    fn matrices(&self) -> [&Weight; 7] {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
    }
}

/// A LLaMA-family decoder with its weights on one device in one dtype (its
/// matrices possibly in another dtype, or in GGUF blocks on the CPU).
pub struct Llama {
    /// Dimensions.
    pub cfg: LlamaConfig,
    embed: Weight,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Weight,
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

impl Llama {
    /// Feeds the dimensions and every weight's bytes (as stored: dtype
    /// included) to `h`: equal for the same model, different for any
    /// other weights.
    pub fn fingerprint(&self, h: &mut xxhash_rust::xxh3::Xxh3) -> Result<()> {
        h.update(format!("{:?}", self.cfg).as_bytes());
        let norms = |t: &Tensor| Weight::Dense(t.shallow_clone());
        let mut all = vec![self.embed.share(), norms(&self.norm), self.lm_head.share()];
        for l in &self.layers {
            all.push(norms(&l.attn_norm));
            all.extend(l.matrices()[..4].iter().map(|w| w.share()));
            all.push(norms(&l.ffn_norm));
            all.extend(l.matrices()[4..].iter().map(|w| w.share()));
        }
        for w in &all {
            w.fingerprint(h)?;
        }
        Ok(())
    }

    /// `x @ w^T`, bridging a weight stored in another dtype or in blocks.
    fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let w = match w {
            Weight::Dense(w) => w,
            Weight::Blocks(q) => {
                let y = matmul_blocks(x, &[q])?.pop();
                let y = y.ok_or_else(|| EngineError::Model("no matmul output".into()))?;
                return Ok(y.f_to_kind(x.kind())?);
            }
        };
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

    /// [`linear`](Self::linear) of `x` with each of `ws`: blocks share one
    /// quantization of `x`.
    fn project<const N: usize>(&self, x: &Tensor, ws: [&Weight; N]) -> Result<[Tensor; N]> {
        let blocks: Vec<_> = ws
            .iter()
            .filter_map(|w| match w {
                Weight::Blocks(q) => Some(&**q),
                Weight::Dense(_) => None,
            })
            .collect();
        let ys = if blocks.len() == N {
            matmul_blocks(x, &blocks)?
                .into_iter()
                .map(|y| Ok(y.f_to_kind(x.kind())?))
                .collect::<Result<Vec<_>>>()?
        } else {
            ws.iter()
                .map(|w| self.linear(x, w))
                .collect::<Result<Vec<_>>>()?
        };
        ys.try_into()
            .map_err(|_| EngineError::Model("a projection lost an output".into()))
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The compute dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if let Some(y) = fused::rms_norm(x, w, self.cfg.rms_eps)? {
            return Ok(y);
        }
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
        if let Some(y) = fused::rotate(x, cos, sin)? {
            return Ok(y);
        }
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
        let mut x = self.embed.rows(&ids, self.kind, self.device)?; // [n, d]
        let (nh, nkv, hd) = (c.n_heads as i64, c.n_kv_heads as i64, c.head_dim as i64);
        for (l, layer) in self.layers.iter().enumerate() {
            let h = self.rms_norm(&x, &layer.attn_norm)?;
            let [q, k, v] = self.project(&h, [&layer.wq, &layer.wk, &layer.wv])?;
            let q = q.f_reshape([n, nh, hd])?;
            let k = k.f_reshape([n, nkv, hd])?;
            let v = v.f_reshape([n, nkv, hd])?;
            let q = self.rotate(&q, cos, sin)?;
            let k = self.rotate(&k, cos, sin)?;
            let att = attend(l, &q, &k, &v)?.f_reshape([n, nh * hd])?;
            x += self.linear(&att, &layer.wo)?;
            let h = self.rms_norm(&x, &layer.ffn_norm)?;
            let [gate, up] = self.project(&h, [&layer.w_gate, &layer.w_up])?;
            let act = match fused::swiglu(&gate, &up)? {
                Some(a) => a,
                None => gate.f_silu()? * up,
            };
            x += self.linear(&act, &layer.w_down)?;
        }
        Ok(x)
    }

    /// Final norm and output head: logits `[rows, vocab]` in f32.
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.rms_norm(x, &self.norm)?;
        Ok(self.linear(&x, &self.lm_head)?.f_to_kind(Kind::Float)?)
    }
}
