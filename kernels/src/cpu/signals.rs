//! The signals eviction policies read from a decode step: each entry's
//! attention mass (H2O, SnapKV) and its keys' novelty (KeyDiff).

use super::{Ops, Partial};
use crate::{PagedDecode, Span};

/// Adds each entry's attention mass (summed over heads, or per KV head
/// with `per_head`) from the chunks' per-span tiles, given the merged
/// maximum `m` and denominator `l` per head.
pub(super) fn add_mass(
    kern: &PagedDecode,
    partials: &[Partial],
    chunks: &[&[Span<'_>]],
    m: &[f32],
    l: &[f32],
    mass: &mut [f32],
) {
    let d = kern.dims;
    let inv: Vec<f32> = l
        .iter()
        .map(|&x| if x > 0.0 { 1.0 / x } else { 0.0 })
        .collect();
    for (p, c) in partials.iter().zip(chunks) {
        for (si, span) in c.iter().enumerate() {
            let tiles = &p.tiles[si * d.heads..(si + 1) * d.heads];
            let weight =
                |(h, &(mloc, sum)): (usize, &(f32, f32))| sum * (mloc - m[h]).exp() * inv[h];
            if kern.per_head {
                let group = d.heads / d.kv_heads;
                for (h, tile) in tiles.iter().enumerate() {
                    mass[span.entry * d.kv_heads + h / group] += weight((h, tile));
                }
            } else {
                mass[span.entry] += tiles.iter().enumerate().map(weight).sum::<f32>();
            }
        }
    }
}

/// KeyDiff's signal per entry from the chunks' key sums: with `m̂` the
/// unit mean key per KV head, an entry's novelty is `1 − Σ_heads (Σ_keys
/// k̂)·m̂ / (keys × kv_heads)`, the mean of `1 − cos(k, m̂)` over its keys
/// and heads; with `per_head`, one value per entry and KV head (the mean
/// over its keys only), at `entry × kv_heads + head`.
pub(super) fn novelty<O: Ops>(
    d: crate::Dims,
    per_head: bool,
    partials: &[Partial],
    chunks: &[&[Span<'_>]],
    out: &mut [f32],
) {
    let (row, hd, h) = (d.row(), d.head_dim, d.kv_heads);
    let mut mean = vec![0f32; row];
    for p in partials {
        O::axpy(&mut mean, 1.0, &p.keys);
    }
    let total: usize = chunks.iter().flat_map(|c| c.iter()).map(|s| s.tokens).sum();
    O::scale(&mut mean, 1.0 / total.max(1) as f32);
    for m in mean.chunks_exact_mut(hd) {
        let norm = O::dot(m, m).sqrt().max(1e-12);
        O::scale(m, 1.0 / norm);
    }
    let per = if per_head { h } else { 1 };
    let mut dots = vec![0f32; out.len()];
    let mut keys = vec![0usize; out.len() / per];
    for (p, c) in partials.iter().zip(chunks) {
        for (si, span) in c.iter().enumerate() {
            let units = &p.units[si * row..(si + 1) * row];
            if per_head {
                for (j, (u, m)) in units
                    .chunks_exact(hd)
                    .zip(mean.chunks_exact(hd))
                    .enumerate()
                {
                    dots[span.entry * h + j] += O::dot(u, m);
                }
            } else {
                dots[span.entry] += O::dot(units, &mean);
            }
            keys[span.entry] += span.tokens;
        }
    }
    for (i, (o, &dot)) in out.iter_mut().zip(&dots).enumerate() {
        let k = keys[i / per];
        if k > 0 {
            *o += 1.0 - dot / (k * h / per) as f32;
        }
    }
}
