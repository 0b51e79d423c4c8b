//! Vector helpers: unit rows for cosines, a tensor's values, and RoPE's
//! rotation (applied with `sign` 1, undone with -1).

use anyhow::Result;
use kvforge_engine::{Device, Kind, Tensor};

/// `[heads, items, dim]` rows scaled to unit length.
pub(crate) fn unit(x: &Tensor) -> Result<Tensor> {
    let n = x.f_norm_scalaropt_dim(2, [-1i64].as_slice(), true)?;
    Ok(x / n.f_clamp_min(1e-12)?)
}

pub(crate) fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(t.f_flatten(0, -1)?.f_contiguous()?)?)
}

/// RoPE cos / sin for positions `0..n`, `[n, 1, head_dim]`.
pub(crate) fn rope_tables(c: &kvforge_engine::LlamaConfig, n: usize) -> Result<(Tensor, Tensor)> {
    let half = (c.head_dim / 2) as i64;
    let inv: Vec<f64> = (0..half)
        .map(|i| c.rope_theta.powf(-2.0 * i as f64 / c.head_dim as f64))
        .collect();
    let pos = Tensor::f_arange(n as i64, (Kind::Double, Device::Cpu))?;
    let freqs = pos.f_outer(&Tensor::f_from_slice(&inv)?)?;
    let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
    Ok((
        emb.f_cos()?.f_to_kind(Kind::Float)?,
        emb.f_sin()?.f_to_kind(Kind::Float)?,
    ))
}

/// `x·cos + sign·rotate_half(x)·sin`: RoPE with `sign` 1, undone with −1.
pub(crate) fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, sign: f64) -> Result<Tensor> {
    let half = x.size()[2] / 2;
    let (x1, x2) = (x.f_narrow(-1, 0, half)?, x.f_narrow(-1, half, half)?);
    let rot = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
    Ok(x * cos + rot * sin * sign)
}
