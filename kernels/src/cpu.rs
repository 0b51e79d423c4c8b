//! The CPU kernel: one online-softmax pass over the pages of a context
//! chunk per thread, then a merge. The algorithm is written once, generic
//! over [`Ops`] (the few vector primitives); [`Scalar`] and [`Avx2`]
//! instantiate it.

use half::f16;
use kvforge_quant::{Quantizer, hadamard_in_place};

use crate::{KernelError, Page, PagedDecode, Result, Span};

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
    let partials: Vec<Partial> = if chunks.len() == 1 {
        vec![O::attend(kern, &queries, spans, want)?]
    } else {
        std::thread::scope(|s| {
            let (last, rest) = chunks.split_last().unwrap_or((&spans, &[]));
            let handles: Vec<_> = rest
                .iter()
                .map(|c| s.spawn(|| O::attend(kern, &queries, c, want)))
                .collect();
            let mine = O::attend(kern, &queries, last, want);
            let mut all: Vec<Partial> = Vec::with_capacity(chunks.len());
            for h in handles {
                all.push(h.join().map_err(|_| {
                    KernelError::Unsupported("an attention worker thread panicked".into())
                })??);
            }
            all.push(mine?);
            Ok::<_, KernelError>(all)
        })?
    };
    // Merge: rescale every chunk to the global maximum per head.
    let hd = d.head_dim;
    let mut m = vec![f32::NEG_INFINITY; d.heads];
    for p in &partials {
        m.iter_mut().zip(&p.m).for_each(|(a, &b)| *a = a.max(b));
    }
    let mut l = vec![0f32; d.heads];
    out.fill(0.0);
    for p in &partials {
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
    if let Some(mass) = mass {
        let inv: Vec<f32> = l
            .iter()
            .map(|&x| if x > 0.0 { 1.0 / x } else { 0.0 })
            .collect();
        let mut at = 0;
        for (p, c) in partials.iter().zip(&chunks) {
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
            at += c.len();
        }
        debug_assert_eq!(at, spans.len());
    }
    if let Some(nv) = key_novelty {
        novelty::<O>(d, kern.per_head, &partials, &chunks, nv);
    }
    Ok(())
}

/// KeyDiff's signal per entry from the chunks' key sums: with `m̂` the
/// unit mean key per KV head, an entry's novelty is `1 − Σ_heads (Σ_keys
/// k̂)·m̂ / (keys × kv_heads)`, the mean of `1 − cos(k, m̂)` over its keys
/// and heads; with `per_head`, one value per entry and KV head (the mean
/// over its keys only), at `entry × kv_heads + head`.
fn novelty<O: Ops>(
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

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::run_avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{Ops, Partial, Queries, Want, attend_chunk};
    use crate::{PagedDecode, Result, Span};

    /// AVX2 + FMA + F16C. Its methods may only run on a CPU that has them
    /// (the kernel checks before it picks this set).
    pub(crate) struct Avx2;

    /// [`super::run`] with AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn run_avx2(
        kern: &PagedDecode,
        q: &[f32],
        spans: &[Span<'_>],
        out: &mut [f32],
        mass: Option<&mut [f32]>,
        key_novelty: Option<&mut [f32]>,
    ) -> Result<()> {
        super::run::<Avx2>(kern, q, spans, out, mass, key_novelty)
    }

    /// [`attend_chunk`] compiled with AVX2, so that the primitives inline.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend_avx2(
        k: &PagedDecode,
        q: &Queries<'_>,
        spans: &[Span<'_>],
        want: Want,
    ) -> Result<Partial> {
        attend_chunk::<Avx2>(k, q, spans, want)
    }

    #[inline(always)]
    fn hsum(v: __m256) -> f32 {
        // SAFETY (of the intrinsics in this module): `Avx2` is only used
        // on a CPU with AVX2, FMA and F16C (see the type), and every load
        // and store below stays inside the slices it was derived from
        // (the loops step by 8 while `i + 8 <= n`, with `n` bounded by
        // every slice's length).
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }

    /// `e^x` for `x ≤ 0`, 8 lanes: `2^n · p(r)` with `x = n·ln2 + r`,
    /// `|r| ≤ ln2/2`, `p` the degree-6 Taylor polynomial (relative error
    /// below 2e-7). Inputs below −87.3 give about 1e-38 instead of less.
    #[inline(always)]
    fn exp8(x: __m256) -> __m256 {
        // SAFETY: see `hsum`.
        unsafe {
            let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
            let n = _mm256_round_ps(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
            let mut p = _mm256_set1_ps(1.0 / 720.0);
            for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            );
            _mm256_mul_ps(p, _mm256_castsi256_ps(e))
        }
    }

    /// [`Ops::scores`] for a head dim of `8·C`: the query stays in `C`
    /// registers across the rows.
    #[inline(always)]
    fn scores_n<const C: usize>(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
        let n = s.len();
        assert!(q.len() == 8 * C && (n == 0 || rows.len() >= (n - 1) * stride + 8 * C));
        // SAFETY: see `hsum`; the assertion bounds every row read.
        unsafe {
            let mut qv = [_mm256_setzero_ps(); C];
            for (c, v) in qv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(q.as_ptr().add(8 * c));
            }
            for (i, x) in s.iter_mut().enumerate() {
                let r = rows.as_ptr().add(i * stride);
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for c in (0..C).step_by(2) {
                    a0 = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(r.add(8 * c)), a0);
                    a1 = _mm256_fmadd_ps(qv[c + 1], _mm256_loadu_ps(r.add(8 * c + 8)), a1);
                }
                *x = hsum(_mm256_add_ps(a0, a1));
            }
        }
    }

    /// [`Ops::accumulate`] for a head dim of `8·C`: the accumulator stays
    /// in `C` registers across the rows.
    #[inline(always)]
    fn accumulate_n<const C: usize>(
        acc: &mut [f32],
        s: &[f32],
        w: f32,
        rows: &[f32],
        stride: usize,
    ) {
        let n = s.len();
        assert!(acc.len() == 8 * C && (n == 0 || rows.len() >= (n - 1) * stride + 8 * C));
        // SAFETY: see `hsum`; the assertion bounds every row read.
        unsafe {
            let mut av = [_mm256_setzero_ps(); C];
            for (c, v) in av.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(acc.as_ptr().add(8 * c));
            }
            for (i, &p) in s.iter().enumerate() {
                let r = rows.as_ptr().add(i * stride);
                let pw = _mm256_set1_ps(p * w);
                for (c, v) in av.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(pw, _mm256_loadu_ps(r.add(8 * c)), *v);
                }
            }
            for (c, v) in av.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(8 * c), *v);
            }
        }
    }

    impl Ops for Avx2 {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            // SAFETY: see `hsum`.
            unsafe {
                let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= n {
                    s0 =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                    s1 = _mm256_fmadd_ps(
                        _mm256_loadu_ps(pa.add(i + 8)),
                        _mm256_loadu_ps(pb.add(i + 8)),
                        s1,
                    );
                    i += 16;
                }
                if i + 8 <= n {
                    s0 =
                        _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), s0);
                    i += 8;
                }
                let mut s = hsum(_mm256_add_ps(s0, s1));
                while i < n {
                    s += a[i] * b[i];
                    i += 1;
                }
                s
            }
        }

        #[inline(always)]
        fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
            let n = acc.len().min(x.len());
            let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
            // SAFETY: see `hsum`.
            unsafe {
                let wv = _mm256_set1_ps(w);
                let mut i = 0;
                while i + 8 <= n {
                    let a = _mm256_loadu_ps(pa.add(i));
                    _mm256_storeu_ps(
                        pa.add(i),
                        _mm256_fmadd_ps(wv, _mm256_loadu_ps(px.add(i)), a),
                    );
                    i += 8;
                }
                while i < n {
                    acc[i] += w * x[i];
                    i += 1;
                }
            }
        }

        #[inline(always)]
        fn scale(acc: &mut [f32], f: f32) {
            let n = acc.len();
            let pa = acc.as_mut_ptr();
            // SAFETY: see `hsum`.
            unsafe {
                let fv = _mm256_set1_ps(f);
                let mut i = 0;
                while i + 8 <= n {
                    _mm256_storeu_ps(pa.add(i), _mm256_mul_ps(fv, _mm256_loadu_ps(pa.add(i))));
                    i += 8;
                }
                while i < n {
                    acc[i] *= f;
                    i += 1;
                }
            }
        }

        #[inline(always)]
        fn exp_sum(s: &mut [f32], m: f32) -> f32 {
            let n = s.len();
            let ps = s.as_mut_ptr();
            // SAFETY: see `hsum`.
            unsafe {
                let mv = _mm256_set1_ps(m);
                let mut acc = _mm256_setzero_ps();
                let mut i = 0;
                while i + 8 <= n {
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ps.add(i)), mv));
                    _mm256_storeu_ps(ps.add(i), e);
                    acc = _mm256_add_ps(acc, e);
                    i += 8;
                }
                let mut sum = hsum(acc);
                while i < n {
                    s[i] = (s[i] - m).exp();
                    sum += s[i];
                    i += 1;
                }
                sum
            }
        }

        #[inline(always)]
        fn widen(src: &[f16], dst: &mut [f32]) {
            let n = src.len().min(dst.len());
            let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
            // SAFETY: see `hsum`; `f16` is a `u16` in memory.
            unsafe {
                let mut i = 0;
                while i + 8 <= n {
                    let h = _mm_loadu_si128(ps.add(i).cast::<__m128i>());
                    _mm256_storeu_ps(pd.add(i), _mm256_cvtph_ps(h));
                    i += 8;
                }
                while i < n {
                    dst[i] = src[i].to_f32();
                    i += 1;
                }
            }
        }

        #[inline(always)]
        fn scores(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
            match q.len() {
                64 => scores_n::<8>(q, rows, stride, s),
                128 => scores_n::<16>(q, rows, stride, s),
                _ => s.iter_mut().enumerate().for_each(|(i, x)| {
                    *x = Self::dot(q, &rows[i * stride..]);
                }),
            }
        }

        #[inline(always)]
        fn accumulate(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
            match acc.len() {
                64 => accumulate_n::<8>(acc, s, w, rows, stride),
                128 => accumulate_n::<16>(acc, s, w, rows, stride),
                _ => s.iter().enumerate().for_each(|(i, &p)| {
                    Self::axpy(acc, p * w, &rows[i * stride..]);
                }),
            }
        }

        fn attend(
            k: &PagedDecode,
            q: &Queries<'_>,
            spans: &[Span<'_>],
            want: Want,
        ) -> Result<Partial> {
            // SAFETY: `Avx2` only runs on a CPU with AVX2, FMA and F16C.
            unsafe { attend_avx2(k, q, spans, want) }
        }
    }
}

#[cfg(target_arch = "aarch64")]
pub(crate) use neon::run_neon;

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use half::f16;
    use half::slice::HalfFloatSliceExt;

    use super::{Ops, Partial, Queries, Want, attend_chunk};
    use crate::{PagedDecode, Result, Span};

    /// AArch64 Advanced SIMD (NEON, part of every AArch64 CPU): four lanes,
    /// fused multiply-add, the query or accumulator of a 64-wide head in
    /// sixteen of the thirty-two vector registers.
    pub(crate) struct Neon;

    /// [`super::run`] with NEON.
    ///
    /// # Safety
    /// The CPU must support NEON (every AArch64 CPU does).
    #[target_feature(enable = "neon")]
    pub(crate) unsafe fn run_neon(
        kern: &PagedDecode,
        q: &[f32],
        spans: &[Span<'_>],
        out: &mut [f32],
        mass: Option<&mut [f32]>,
        key_novelty: Option<&mut [f32]>,
    ) -> Result<()> {
        super::run::<Neon>(kern, q, spans, out, mass, key_novelty)
    }

    /// [`attend_chunk`] compiled with NEON, so that the primitives inline.
    ///
    /// # Safety
    /// The CPU must support NEON.
    #[target_feature(enable = "neon")]
    unsafe fn attend_neon(
        k: &PagedDecode,
        q: &Queries<'_>,
        spans: &[Span<'_>],
        want: Want,
    ) -> Result<Partial> {
        attend_chunk::<Neon>(k, q, spans, want)
    }

    /// `e^x` for `x ≤ 0`, 4 lanes: the AVX2 path's `2^n · p(r)` with the
    /// degree-6 Taylor polynomial (relative error below 2e-7).
    #[inline(always)]
    fn exp4(x: float32x4_t) -> float32x4_t {
        // SAFETY (of the intrinsics in this module): `Neon` only runs on
        // an AArch64 CPU, which has NEON, and every load and store below
        // stays inside the slices it was derived from (the loops step by
        // 4 while `i + 4 <= n`, with `n` bounded by every slice's length).
        unsafe {
            let x = vmaxq_f32(x, vdupq_n_f32(-87.3));
            let n = vrndnq_f32(vmulq_n_f32(x, std::f32::consts::LOG2_E));
            let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_359_4));
            let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
            let mut p = vdupq_n_f32(1.0 / 720.0);
            for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = vfmaq_f32(vdupq_n_f32(c), p, r);
            }
            let e = vshlq_n_s32::<23>(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)));
            vmulq_f32(p, vreinterpretq_f32_s32(e))
        }
    }

    /// [`Ops::scores`] for a head dim of `4·C`: the query stays in `C`
    /// registers across the rows.
    #[inline(always)]
    fn scores_n<const C: usize>(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
        let n = s.len();
        assert!(q.len() == 4 * C && (n == 0 || rows.len() >= (n - 1) * stride + 4 * C));
        // SAFETY: see `exp4`; the assertion bounds every row read.
        unsafe {
            let mut qv = [vdupq_n_f32(0.0); C];
            for (c, v) in qv.iter_mut().enumerate() {
                *v = vld1q_f32(q.as_ptr().add(4 * c));
            }
            for (i, x) in s.iter_mut().enumerate() {
                let r = rows.as_ptr().add(i * stride);
                let (mut a0, mut a1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                for c in (0..C).step_by(2) {
                    a0 = vfmaq_f32(a0, qv[c], vld1q_f32(r.add(4 * c)));
                    a1 = vfmaq_f32(a1, qv[c + 1], vld1q_f32(r.add(4 * c + 4)));
                }
                *x = vaddvq_f32(vaddq_f32(a0, a1));
            }
        }
    }

    /// [`Ops::accumulate`] for a head dim of `4·C`: the accumulator stays
    /// in `C` registers across the rows.
    #[inline(always)]
    fn accumulate_n<const C: usize>(
        acc: &mut [f32],
        s: &[f32],
        w: f32,
        rows: &[f32],
        stride: usize,
    ) {
        let n = s.len();
        assert!(acc.len() == 4 * C && (n == 0 || rows.len() >= (n - 1) * stride + 4 * C));
        // SAFETY: see `exp4`; the assertion bounds every row read.
        unsafe {
            let mut av = [vdupq_n_f32(0.0); C];
            for (c, v) in av.iter_mut().enumerate() {
                *v = vld1q_f32(acc.as_ptr().add(4 * c));
            }
            for (i, &p) in s.iter().enumerate() {
                let r = rows.as_ptr().add(i * stride);
                for (c, v) in av.iter_mut().enumerate() {
                    *v = vfmaq_n_f32(*v, vld1q_f32(r.add(4 * c)), p * w);
                }
            }
            for (c, v) in av.iter().enumerate() {
                vst1q_f32(acc.as_mut_ptr().add(4 * c), *v);
            }
        }
    }

    impl Ops for Neon {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            // SAFETY: see `exp4`.
            unsafe {
                let (mut s0, mut s1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
                let mut i = 0;
                while i + 8 <= n {
                    s0 = vfmaq_f32(s0, vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
                    s1 = vfmaq_f32(s1, vld1q_f32(pa.add(i + 4)), vld1q_f32(pb.add(i + 4)));
                    i += 8;
                }
                if i + 4 <= n {
                    s0 = vfmaq_f32(s0, vld1q_f32(pa.add(i)), vld1q_f32(pb.add(i)));
                    i += 4;
                }
                let mut s = vaddvq_f32(vaddq_f32(s0, s1));
                while i < n {
                    s += a[i] * b[i];
                    i += 1;
                }
                s
            }
        }

        #[inline(always)]
        fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
            let n = acc.len().min(x.len());
            let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
            // SAFETY: see `exp4`.
            unsafe {
                let mut i = 0;
                while i + 4 <= n {
                    let a = vld1q_f32(pa.add(i));
                    vst1q_f32(pa.add(i), vfmaq_n_f32(a, vld1q_f32(px.add(i)), w));
                    i += 4;
                }
                while i < n {
                    acc[i] += w * x[i];
                    i += 1;
                }
            }
        }

        #[inline(always)]
        fn scale(acc: &mut [f32], f: f32) {
            let n = acc.len();
            let pa = acc.as_mut_ptr();
            // SAFETY: see `exp4`.
            unsafe {
                let mut i = 0;
                while i + 4 <= n {
                    vst1q_f32(pa.add(i), vmulq_n_f32(vld1q_f32(pa.add(i)), f));
                    i += 4;
                }
                while i < n {
                    acc[i] *= f;
                    i += 1;
                }
            }
        }

        #[inline(always)]
        fn exp_sum(s: &mut [f32], m: f32) -> f32 {
            let n = s.len();
            let ps = s.as_mut_ptr();
            // SAFETY: see `exp4`.
            unsafe {
                let mv = vdupq_n_f32(m);
                let mut acc = vdupq_n_f32(0.0);
                let mut i = 0;
                while i + 4 <= n {
                    let e = exp4(vsubq_f32(vld1q_f32(ps.add(i)), mv));
                    vst1q_f32(ps.add(i), e);
                    acc = vaddq_f32(acc, e);
                    i += 4;
                }
                let mut sum = vaddvq_f32(acc);
                while i < n {
                    s[i] = (s[i] - m).exp();
                    sum += s[i];
                    i += 1;
                }
                sum
            }
        }

        #[inline(always)]
        fn widen(src: &[f16], dst: &mut [f32]) {
            // `half` converts with the FP16 instructions where the CPU has
            // them (NEON's own conversion intrinsics need unstable `f16`).
            let n = src.len().min(dst.len());
            src[..n].convert_to_f32_slice(&mut dst[..n]);
        }

        #[inline(always)]
        fn scores(q: &[f32], rows: &[f32], stride: usize, s: &mut [f32]) {
            match q.len() {
                64 => scores_n::<16>(q, rows, stride, s),
                _ => s.iter_mut().enumerate().for_each(|(i, x)| {
                    *x = Self::dot(q, &rows[i * stride..]);
                }),
            }
        }

        #[inline(always)]
        fn accumulate(acc: &mut [f32], s: &[f32], w: f32, rows: &[f32], stride: usize) {
            match acc.len() {
                64 => accumulate_n::<16>(acc, s, w, rows, stride),
                _ => s.iter().enumerate().for_each(|(i, &p)| {
                    Self::axpy(acc, p * w, &rows[i * stride..]);
                }),
            }
        }

        fn attend(
            k: &PagedDecode,
            q: &Queries<'_>,
            spans: &[Span<'_>],
            want: Want,
        ) -> Result<Partial> {
            // SAFETY: `Neon` only runs on an AArch64 CPU (NEON is part of
            // the architecture).
            unsafe { attend_neon(k, q, spans, want) }
        }
    }
}
