//! Recording a text's K and V, and each vector's best cosine match across
//! positions, layers and texts, at token and block granularity, with the
//! exact duplicates after INT4 quantization.

use std::collections::BTreeSet;

use anyhow::{Context, Result};
use kvforge_engine::{Device, Engine, Kind, Tensor};
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Quantizer};

use crate::sharing::Sharing;
use crate::vectors::{unit, values};
use crate::{Args, Text};

/// One text's KV: per layer, `[heads, tokens, head_dim]` f32.
pub(crate) struct Kv {
    pub(crate) k_post: Vec<Tensor>,
    pub(crate) k_pre: Vec<Tensor>,
    /// `k_pre` less its mean over the text's positions (per layer and
    /// head): a component every key shares adds the same logit to every
    /// key, so attention does not see it, but it inflates cosines.
    pub(crate) k_pre_c: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
}

impl Kv {
    pub(crate) fn kind(&self, kind: &str) -> &[Tensor] {
        match kind {
            "k_post" => &self.k_post,
            "k_pre" => &self.k_pre,
            "k_pre_c" => &self.k_pre_c,
            _ => &self.v,
        }
    }
}

pub(crate) const KINDS: [&str; 4] = ["k_post", "k_pre", "k_pre_c", "v"];

pub(crate) fn record(e: &Engine, tokens: &[u32]) -> Result<Kv> {
    let c = e.model_config();
    // A sharing store that shares nothing records what the model stores.
    let mut r = Sharing::new(e, tokens.len(), false, None, false)?;
    for chunk in tokens.chunks(512) {
        let _ = e.model().forward(chunk, &mut r, false)?;
    }
    let mut kv = Kv {
        k_post: Vec::new(),
        k_pre: Vec::new(),
        k_pre_c: Vec::new(),
        v: Vec::new(),
    };
    let stored = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone).context("no tokens");
    for l in 0..c.n_layers {
        let k = Tensor::f_cat(&r.k_post[l], 0)?; // [n, h, d]
        kv.k_post.push(k.f_transpose(0, 1)?.f_contiguous()?);
        let pre = stored(&r.k_pre[l])?;
        kv.k_pre_c
            .push(&pre - pre.f_mean_dim([1i64].as_slice(), true, Kind::Float)?);
        kv.k_pre.push(pre);
        kv.v.push(stored(&r.v[l])?);
    }
    Ok(kv)
}

/// Best cosine of every row of `x` (`[h, n, d]`) with an earlier row of
/// the same head: `[h, n - 1]` (the first row has none).
pub(crate) fn best_earlier(x: &Tensor) -> Result<Tensor> {
    let u = unit(x)?;
    let s = u.f_bmm(&u.f_transpose(1, 2)?)?;
    let n = x.size()[1];
    let later = Tensor::f_ones([n, n], (Kind::Bool, Device::Cpu))?.f_triu(0)?;
    let s = s.f_masked_fill(&later, -2.0)?;
    Ok(s.f_amax([-1i64].as_slice(), false)?.f_narrow(1, 1, n - 1)?)
}

/// Best cosine of every row of `x` with any row of `y` (same head).
pub(crate) fn best_in(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let s = unit(x)?.f_bmm(&unit(y)?.f_transpose(1, 2)?)?;
    Ok(s.f_amax([-1i64].as_slice(), false)?)
}

/// Cosine of matching rows of `x` and `y`.
pub(crate) fn paired(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok((unit(x)? * unit(y)?).f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?)
}

/// `[h, n, d]` → `[h, n / block, block · d]`.
pub(crate) fn blocks(x: &Tensor, block: usize) -> Result<Tensor> {
    let s = x.size();
    Ok(x.f_reshape([s[0], s[1] / block as i64, block as i64 * s[2]])?)
}

/// One statistic: the best cosines of a set of vectors.
pub(crate) struct Stat {
    pub(crate) text: String,
    pub(crate) axis: &'static str,
    pub(crate) granularity: &'static str,
    pub(crate) kind: String,
    pub(crate) layer: Option<usize>,
    pub(crate) best: Vec<f32>,
    /// Vectors whose INT4 codes equal an earlier one's (token and block
    /// rows of the positions axis only).
    pub(crate) int4_dup: Option<f64>,
}

impl Stat {
    pub(crate) fn frac(&self, t: f64) -> f64 {
        let hit = self.best.iter().filter(|&&c| f64::from(c) >= t).count();
        hit as f64 / self.best.len().max(1) as f64
    }
    pub(crate) fn mean(&self) -> f64 {
        self.best.iter().map(|&c| f64::from(c)).sum::<f64>() / self.best.len().max(1) as f64
    }
}

pub(crate) fn code_bytes(q: &QuantizedBlock) -> Vec<u8> {
    let mut out = q.packed.clone();
    for x in q.scales.iter().chain(&q.mins) {
        out.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    out
}

/// The share of rows of `x` (`[h, n, d]`, rows of `shape`) whose INT4
/// codes equal an earlier row's of the same head.
pub(crate) fn int4_duplicates(x: &Tensor, shape: BlockShape, q: &dyn Quantizer) -> Result<f64> {
    let data = values(x)?;
    let s = x.size();
    let (heads, n) = (s[0] as usize, s[1] as usize);
    let row = shape.len();
    let (mut dup, mut total) = (0usize, 0usize);
    for h in 0..heads {
        let mut seen = BTreeSet::new();
        for i in 0..n {
            let start = (h * n + i) * row;
            let codes = code_bytes(&q.quantize(shape, &data[start..start + row])?);
            if !seen.insert(codes) {
                dup += 1;
            }
            total += 1;
        }
    }
    Ok(dup as f64 / total.max(1) as f64)
}

pub(crate) fn measure(e: &Engine, a: &Args, t: &Text) -> Result<Vec<Stat>> {
    let kv = record(e, &t.tokens)?;
    let other = t.other.as_ref().map(|o| record(e, o)).transpose()?;
    let c = e.model_config();
    let hd = c.head_dim;
    let int4 = |axis: Axis, group: usize| -> Result<GroupQuantizer> {
        Ok(GroupQuantizer::new(QuantConfig::new(4, group, axis)?))
    };
    let (tok_q, key_block_q) = (int4(Axis::PerToken, 32)?, int4(Axis::PerChannel, a.block)?);
    let token_shape = BlockShape {
        tokens: 1,
        heads: 1,
        head_dim: hd,
    };
    let block_shape = BlockShape {
        tokens: a.block,
        heads: 1,
        head_dim: hd,
    };
    let mut out = Vec::new();
    let mut stat = |axis, granularity, kind: &str, layer, best: &Tensor, dup| -> Result<()> {
        out.push(Stat {
            text: t.name.clone(),
            axis,
            granularity,
            kind: kind.into(),
            layer,
            best: values(best)?,
            int4_dup: dup,
        });
        Ok(())
    };
    for kind in KINDS {
        let layers = kv.kind(kind);
        for (l, x) in layers.iter().enumerate() {
            let bx = blocks(x, a.block)?;
            // Codes of what the cold tier could store (not of centred keys).
            let stored = kind != "k_pre_c";
            let tok_dup = stored
                .then(|| int4_duplicates(x, token_shape, &tok_q))
                .transpose()?;
            // Block slabs as the cold tier lays them out: [tokens, head_dim].
            let block_q: &dyn Quantizer = if kind == "v" { &tok_q } else { &key_block_q };
            let block_dup = stored
                .then(|| int4_duplicates(&bx, block_shape, block_q))
                .transpose()?;
            stat(
                "positions",
                "token",
                kind,
                Some(l),
                &best_earlier(x)?,
                tok_dup,
            )?;
            stat(
                "positions",
                "block",
                kind,
                Some(l),
                &best_earlier(&bx)?,
                block_dup,
            )?;
            if l > 0 {
                stat(
                    "layers",
                    "token",
                    kind,
                    Some(l),
                    &paired(x, &layers[l - 1])?,
                    None,
                )?;
            }
            if let Some(o) = &other {
                stat(
                    "sequences",
                    "token",
                    kind,
                    Some(l),
                    &best_in(x, &o.kind(kind)[l])?,
                    None,
                )?;
            }
        }
    }
    out.extend(cold_block(&t.name, &kv, other.as_ref(), a.block)?);
    Ok(out)
}

/// The whole cold block — every layer's K (rotated) and V, one vector —
/// against the earlier blocks, and against `other`'s.
fn cold_block(text: &str, kv: &Kv, other: Option<&Kv>, block: usize) -> Result<Vec<Stat>> {
    let whole = |kv: &Kv| -> Result<Tensor> {
        let parts: Vec<Tensor> = kv
            .k_post
            .iter()
            .chain(&kv.v)
            .map(|x| {
                let b = blocks(x, block)?; // [h, nb, block·d]
                Ok(b.f_transpose(0, 1)?.f_flatten(1, -1)?) // [nb, h·block·d]
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::f_cat(&parts, 1)?.f_unsqueeze(0)?)
    };
    let stat = |axis, best: &Tensor| -> Result<Stat> {
        Ok(Stat {
            text: text.to_string(),
            axis,
            granularity: "cold-block",
            kind: "k_post+v".into(),
            layer: None,
            best: values(best)?,
            int4_dup: None,
        })
    };
    let w = whole(kv)?;
    let mut out = vec![stat("positions", &best_earlier(&w)?)?];
    if let Some(o) = other {
        out.push(stat("sequences", &best_in(&w, &whole(o)?)?)?);
    }
    Ok(out)
}
