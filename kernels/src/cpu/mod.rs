//! The CPU kernel: one online-softmax pass over the pages of a context
//! chunk per thread, then a merge. The algorithm is written once, generic
//! over [`Ops`] (the few vector primitives); [`Scalar`] and [`Avx2`]
//! instantiate it.

use half::f16;
use kvforge_quant::{Quantizer, hadamard_in_place};

use crate::{KernelError, Page, PagedDecode, Result, Span};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;
mod signals;

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::run_avx2;
#[cfg(target_arch = "aarch64")]
pub(crate) use neon::run_neon;
use signals::{add_mass, novelty};

/// The vector primitives the kernel is built from.
pub(crate) trait Ops {
    /// `Σ a[i]·b[i]` over `a.len()` elements (`b` at least as long).
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `acc[i] += w·x[i]`.
    fn axpy(acc: &mut [f32], w: f32, x: &[f32]);
    /// `acc[i] *= f`.
    fn scale(acc: &mut [f32], f: f32);
    /// `s[i] = exp(s[i] − m)`; returns their sum.
    fn exp_sum(s: &mut [f32], m: f32) -> f32;
    /// `dst[i] = src[i]` widened to f32.
    fn widen(src: &[f16], dst: &mut [f32]);
    /// `s[i] = q · rows[i·stride ..][..q.len()]` for every `i < s.len()`.
    fn scores(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
        for (i, x) in s.iter_mut().enumerate() {
            *x = Self::dot(q, &rows[i * stride..]);
        }
    }
    /// `acc += Σ_i w·s[i]·rows[i·stride ..][..acc.len()]`.
    fn accumulate(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
        for (i, &p) in s.iter().enumerate() {
            Self::axpy(acc, p * w, &rows[i * stride..]);
        }
    }
    /// [`attend_chunk`] compiled for this instruction set.
    fn attend(k: &PagedDecode, q: &Queries<'_>, spans: &[Span<'_>], want: Want) -> Result<Partial>;
}

/// The scaled query, and its Hadamard-rotated twin for rotated cold keys.
pub(crate) struct Queries<'a> {
    plain: &'a [f32],
    rotated: Option<&'a [f32]>,
}

/// What a chunk keeps besides the output.
#[derive(Clone, Copy)]
pub(crate) struct Want {
    /// Every page's own maximum and sum per head (the attention mass).
    tiles: bool,
    /// Key sums per KV head and unit-key sums per page and KV head (key
    /// novelty).
    novelty: bool,
}

/// A chunk's softmax state per query head; per page and head the page's
/// own maximum and sum (for the attention mass); the sum of its keys per
/// KV head and, per page and KV head, the sum of its unit keys (for key
/// novelty).
pub(crate) struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    tiles: Vec<(f32, f32)>,
    keys: Vec<f32>,
    units: Vec<f32>,
}

/// The plain-Rust twin.
pub(crate) struct Scalar;

impl Ops for Scalar {
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
        acc.iter_mut().zip(x).for_each(|(a, x)| *a += w * x);
    }

    fn scale(acc: &mut [f32], f: f32) {
        acc.iter_mut().for_each(|a| *a *= f);
    }

    fn exp_sum(s: &mut [f32], m: f32) -> f32 {
        let mut sum = 0.0;
        for x in s.iter_mut() {
            *x = (*x - m).exp();
            sum += *x;
        }
        sum
    }

    fn widen(src: &[f16], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }

    fn attend(k: &PagedDecode, q: &Queries<'_>, spans: &[Span<'_>], want: Want) -> Result<Partial> {
        attend_chunk::<Scalar>(k, q, spans, want)
    }
}

/// Per-thread buffers: one page's keys and values widened or dequantized,
/// and one head's scores over a page.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
}

/// The online softmax over `spans`, in order.
#[inline(always)]
fn attend_chunk<O: Ops>(
    kern: &PagedDecode,
    q: &Queries<'_>,
    spans: &[Span<'_>],
    want: Want,
) -> Result<Partial> {
    let d = kern.dims;
    let (hd, kvh, group) = (d.head_dim, d.kv_heads, d.heads / d.kv_heads);
    let row = d.row();
    let mut p = Partial {
        m: vec![f32::NEG_INFINITY; d.heads],
        l: vec![0.0; d.heads],
        acc: vec![0.0; d.heads * hd],
        tiles: if want.tiles {
            vec![(f32::NEG_INFINITY, 0.0); spans.len() * d.heads]
        } else {
            Vec::new()
        },
        keys: vec![0.0; if want.novelty { row } else { 0 }],
        units: vec![0.0; if want.novelty { spans.len() * row } else { 0 }],
    };
    let mut sc = Scratch::default();
    for (si, span) in spans.iter().enumerate() {
        let t = span.tokens;
        let n = t * d.row();
        let (keys, values, qs): (&[f32], &[f32], &[f32]) = match span.page {
            Page::F32 { k, v } => (k, v, q.plain),
            Page::F16 { k, v } => {
                grow(&mut sc.k, n);
                grow(&mut sc.v, n);
                O::widen(k, &mut sc.k[..n]);
                O::widen(v, &mut sc.v[..n]);
                (&sc.k[..n], &sc.v[..n], q.plain)
            }
            Page::Quant { k, v } => {
                let cold = kern.cold.ok_or_else(|| {
                    KernelError::Unsupported("a cold page and no cold format".into())
                })?;
                let full = k.shape.len();
                grow(&mut sc.k, full);
                grow(&mut sc.v, full);
                cold.keys.dequantize(k, &mut sc.k[..full])?;
                cold.values.dequantize(v, &mut sc.v[..full])?;
                let qs = if cold.rotated {
                    q.rotated.unwrap_or(q.plain)
                } else {
                    q.plain
                };
                (&sc.k[..n], &sc.v[..n], qs)
            }
        };
        grow(&mut sc.s, t);
        let s = &mut sc.s[..t];
        if want.novelty {
            let units = &mut p.units[si * row..(si + 1) * row];
            for key in keys[..n].chunks_exact(row) {
                O::axpy(&mut p.keys, 1.0, key);
                for (u, k) in units.chunks_exact_mut(hd).zip(key.chunks_exact(hd)) {
                    O::axpy(u, 1.0 / O::dot(k, k).sqrt().max(1e-12), k);
                }
            }
        }
        for kh in 0..kvh {
            for g in 0..group {
                let h = kh * group + g;
                let qh = &qs[h * hd..(h + 1) * hd];
                let stride = kvh * hd;
                O::scores(qh, &keys[kh * hd..], stride, s);
                let mloc = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let sum = O::exp_sum(s, mloc);
                let m_new = p.m[h].max(mloc);
                let fo = (p.m[h] - m_new).exp();
                let ft = (mloc - m_new).exp();
                let acc = &mut p.acc[h * hd..(h + 1) * hd];
                if fo != 1.0 {
                    O::scale(acc, fo);
                }
                O::accumulate(acc, s, ft, &values[kh * hd..], stride);
                p.l[h] = p.l[h] * fo + sum * ft;
                p.m[h] = m_new;
                if want.tiles {
                    p.tiles[si * d.heads + h] = (mloc, sum);
                }
            }
        }
    }
    Ok(p)
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Splits `spans` into at most `parts` runs of about equal token counts.
fn split<'s, 'a>(spans: &'s [Span<'a>], parts: usize) -> Vec<&'s [Span<'a>]> {
    let total: usize = spans.iter().map(|s| s.tokens).sum();
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut seen) = (0, 0);
    for (i, s) in spans.iter().enumerate() {
        seen += s.tokens;
        let cut = total * (out.len() + 1) / parts;
        if seen >= cut && out.len() + 1 < parts {
            out.push(&spans[start..=i]);
            start = i + 1;
        }
    }
    if start < spans.len() {
        out.push(&spans[start..]);
    }
    out
}

/// Runs the kernel with `O`: splits the context, attends each chunk,
/// merges.
pub(crate) fn run<O: Ops>(
    kern: &PagedDecode,
    q: &[f32],
    spans: &[Span<'_>],
    out: &mut [f32],
    mass: Option<&mut [f32]>,
    key_novelty: Option<&mut [f32]>,
) -> Result<()> {
    let d = kern.dims;
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let plain: Vec<f32> = q.iter().map(|x| x * scale).collect();
    let rotated = match kern.cold {
        Some(c) if c.rotated => {
            let mut r = plain.clone();
            r.chunks_exact_mut(d.head_dim)
                .try_for_each(hadamard_in_place)?;
            Some(r)
        }
        _ => None,
    };
    let queries = Queries {
        plain: &plain,
        rotated: rotated.as_deref(),
    };
    let tokens: usize = spans.iter().map(|s| s.tokens).sum();
    let parts = kern.threads.min(tokens / kern.min_split).max(1);
    let want = Want {
        tiles: mass.is_some(),
        novelty: key_novelty.is_some(),
    };
    let chunks = split(spans, parts);
    debug_assert_eq!(chunks.iter().map(|c| c.len()).sum::<usize>(), spans.len());
    let partials = attend_all::<O>(kern, &queries, spans, &chunks, want)?;
    let (m, l) = merge::<O>(d, &partials, out);
    if let Some(mass) = mass {
        add_mass(kern, &partials, &chunks, &m, &l, mass);
    }
    if let Some(nv) = key_novelty {
        novelty::<O>(d, kern.per_head, &partials, &chunks, nv);
    }
    Ok(())
}

/// Attends every chunk, the last one on this thread and the others on
/// scoped threads of their own.
fn attend_all<O: Ops>(
    kern: &PagedDecode,
    queries: &Queries<'_>,
    spans: &[Span<'_>],
    chunks: &[&[Span<'_>]],
    want: Want,
) -> Result<Vec<Partial>> {
    if chunks.len() <= 1 {
        return Ok(vec![O::attend(kern, queries, spans, want)?]);
    }
    std::thread::scope(|s| {
        let (last, rest) = chunks.split_last().unwrap_or((&spans, &[]));
        let handles: Vec<_> = rest
            .iter()
            .map(|c| s.spawn(|| O::attend(kern, queries, c, want)))
            .collect();
        let mine = O::attend(kern, queries, last, want);
        let mut all: Vec<Partial> = Vec::with_capacity(chunks.len());
        for h in handles {
            all.push(h.join().map_err(|_| {
                KernelError::Unsupported("an attention worker thread panicked".into())
            })??);
        }
        all.push(mine?);
        Ok(all)
    })
}

/// Merges the chunks into `out`, each rescaled to the global maximum per
/// head; returns that maximum and the softmax denominator per head.
fn merge<O: Ops>(d: crate::Dims, partials: &[Partial], out: &mut [f32]) -> (Vec<f32>, Vec<f32>) {
    let hd = d.head_dim;
    let mut m = vec![f32::NEG_INFINITY; d.heads];
    for p in partials {
        m.iter_mut().zip(&p.m).for_each(|(a, &b)| *a = a.max(b));
    }
    let mut l = vec![0f32; d.heads];
    out.fill(0.0);
    for p in partials {
        for h in 0..d.heads {
            if p.l[h] == 0.0 {
                continue;
            }
            let f = (p.m[h] - m[h]).exp();
            l[h] += p.l[h] * f;
            O::axpy(
                &mut out[h * hd..(h + 1) * hd],
                f,
                &p.acc[h * hd..(h + 1) * hd],
            );
        }
    }
    for h in 0..d.heads {
        let inv = if l[h] > 0.0 { 1.0 / l[h] } else { 0.0 };
        O::scale(&mut out[h * hd..(h + 1) * hd], inv);
    }
    (m, l)
}
