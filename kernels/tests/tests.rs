//! The kernel against a dense f64 softmax over the same keys and values
//! (cold pages decoded the way the cache decodes them), every instruction
//! set against the scalar twin, and every malformed input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[cfg(feature = "cuda")]
mod cuda;

use kvforge_kernels::{ColdFormat, Dims, Isa, KernelError, Page, PagedDecode, Span};
use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Quantizer, Rotated, f16,
};

/// splitmix64, so the tests need no RNG crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// How one page is stored.
#[derive(Clone, Copy, Debug)]
enum Kind {
    F32,
    F16,
    Cold,
}

/// Owned pages, and the f32 keys and values attention should see for each
/// (`[tokens][kv_heads][head_dim]`).
struct Fixture {
    dims: Dims,
    pages: Vec<(Kind, usize, usize)>, // kind, index into its store, tokens
    f32s: Vec<(Vec<f32>, Vec<f32>)>,
    f16s: Vec<(Vec<f16>, Vec<f16>)>,
    colds: Vec<(QuantizedBlock, QuantizedBlock)>,
    entries: Vec<usize>,
    seen: Vec<(Vec<f32>, Vec<f32>)>,
}

/// A cold format: `bits`, per-channel keys in groups of the block or
/// per-token keys in groups of 8, values per token in groups of `vg`,
/// rotated or not; with the quantizers the cache would decode with.
fn cold_format(
    bits: u32,
    block: usize,
    key_axis: Axis,
    rotated: bool,
    vg: usize,
) -> (ColdFormat, Box<dyn Quantizer>, Box<dyn Quantizer>) {
    let kg = match key_axis {
        Axis::PerChannel => block,
        Axis::PerToken => 8,
    };
    let kc = QuantConfig::new(bits, kg, key_axis).unwrap();
    let vc = QuantConfig::new(bits, vg, Axis::PerToken).unwrap();
    let keys: Box<dyn Quantizer> = if rotated {
        Box::new(Rotated::new(GroupQuantizer::new(kc)))
    } else {
        Box::new(GroupQuantizer::new(kc))
    };
    (
        ColdFormat::new(kc, vc, rotated),
        keys,
        Box::new(GroupQuantizer::new(vc)),
    )
}

/// `pages` random pages of `block` tokens (the last `last` tokens long)
/// of the kinds given in turn; entries: page `i` is entry `2i` (odd
/// entries are "dropped": never named).
fn fixture(
    seed: u64,
    dims: Dims,
    block: usize,
    kinds: &[Kind],
    pages: usize,
    last: usize,
    cold: Option<(&dyn Quantizer, &dyn Quantizer)>,
) -> Fixture {
    let mut r = Rng(seed);
    let mut f = Fixture {
        dims,
        pages: Vec::new(),
        f32s: Vec::new(),
        f16s: Vec::new(),
        colds: Vec::new(),
        entries: Vec::new(),
        seen: Vec::new(),
    };
    let row = dims.kv_heads * dims.head_dim;
    for i in 0..pages {
        let kind = kinds[i % kinds.len()];
        let tokens = if i + 1 == pages { last } else { block };
        // Keys with a common offset per channel (real keys have one) and a
        // spread that makes the softmax far from uniform.
        let k: Vec<f32> = r
            .vec(row * block, 2.0)
            .iter()
            .enumerate()
            .map(|(j, x)| x + 0.5 * ((j % dims.head_dim) as f32 * 0.37).sin())
            .collect();
        let v = r.vec(row * block, 1.0);
        let n = tokens * row;
        match kind {
            Kind::F32 => {
                f.pages.push((kind, f.f32s.len(), tokens));
                f.seen.push((k[..n].to_vec(), v[..n].to_vec()));
                f.f32s.push((k[..n].to_vec(), v[..n].to_vec()));
            }
            Kind::F16 => {
                let h = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y)).collect::<Vec<_>>();
                let w = |x: &[f16]| x.iter().map(|y| y.to_f32()).collect::<Vec<_>>();
                let (kh, vh) = (h(&k[..n]), h(&v[..n]));
                f.pages.push((kind, f.f16s.len(), tokens));
                f.seen.push((w(&kh), w(&vh)));
                f.f16s.push((kh, vh));
            }
            Kind::Cold => {
                let (kq, vq) = cold.expect("cold pages need quantizers");
                let shape = BlockShape {
                    tokens: block,
                    heads: dims.kv_heads,
                    head_dim: dims.head_dim,
                };
                let (qk, qv) = (
                    kq.quantize(shape, &k).unwrap(),
                    vq.quantize(shape, &v).unwrap(),
                );
                let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
                kq.dequantize(&qk, &mut dk).unwrap();
                vq.dequantize(&qv, &mut dv).unwrap();
                f.pages.push((kind, f.colds.len(), tokens));
                f.seen.push((dk[..n].to_vec(), dv[..n].to_vec()));
                f.colds.push((qk, qv));
            }
        }
        f.entries.push(2 * i);
    }
    f
}

impl Fixture {
    fn spans(&self) -> Vec<Span<'_>> {
        self.pages
            .iter()
            .zip(&self.entries)
            .map(|(&(kind, at, tokens), &entry)| {
                let page = match kind {
                    Kind::F32 => Page::F32 {
                        k: &self.f32s[at].0,
                        v: &self.f32s[at].1,
                    },
                    Kind::F16 => Page::F16 {
                        k: &self.f16s[at].0,
                        v: &self.f16s[at].1,
                    },
                    Kind::Cold => Page::Quant {
                        k: &self.colds[at].0,
                        v: &self.colds[at].1,
                    },
                };
                Span {
                    page,
                    tokens,
                    entry,
                }
            })
            .collect()
    }

    /// Dense softmax in f64: the output and the mass per entry.
    fn dense(&self, q: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (out, per_head) = self.dense_per_head(q);
        let h = self.dims.kv_heads;
        let mass = per_head.chunks_exact(h).map(|e| e.iter().sum()).collect();
        (out, mass)
    }

    /// Dense softmax in f64: the output and the mass per entry and KV head
    /// (summed over the query heads of its group), at `entry × kv_heads +
    /// head`.
    fn dense_per_head(&self, q: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let d = self.dims;
        let (hd, group) = (d.head_dim, d.heads / d.kv_heads);
        let mut out = vec![0f64; d.heads * hd];
        let mut mass = vec![0f64; 2 * self.pages.len() * d.kv_heads];
        for h in 0..d.heads {
            let kh = h / group;
            let qh = &q[h * hd..(h + 1) * hd];
            let mut scores = Vec::new();
            for (p, (k, _)) in self.seen.iter().enumerate() {
                for t in 0..self.pages[p].2 {
                    let key = &k[(t * d.kv_heads + kh) * hd..][..hd];
                    let s: f64 = qh
                        .iter()
                        .zip(key)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    scores.push((p, t, s / (hd as f64).sqrt()));
                }
            }
            let m = scores.iter().map(|x| x.2).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|x| (x.2 - m).exp()).sum();
            for &(p, t, s) in &scores {
                let w = (s - m).exp() / z;
                mass[self.entries[p] * d.kv_heads + kh] += w;
                let val = &self.seen[p].1[(t * d.kv_heads + kh) * hd..][..hd];
                for (o, x) in out[h * hd..(h + 1) * hd].iter_mut().zip(val) {
                    *o += w * f64::from(*x);
                }
            }
        }
        (out, mass)
    }
}

impl Fixture {
    /// KeyDiff's signal per entry in f64: `1 − cos(key, mean key)` per key
    /// and KV head (the mean over every key), averaged over the entry's
    /// keys and the heads (with `per_head`, per entry and head, at `entry ×
    /// kv_heads + head`); 0 for entries without keys.
    fn dense_novelty(&self, per_head: bool) -> Vec<f64> {
        let d = self.dims;
        let hd = d.head_dim;
        let per = if per_head { d.kv_heads } else { 1 };
        let at = |e: usize, kh: usize| e * per + if per_head { kh } else { 0 };
        let mut out = vec![0f64; 2 * self.pages.len() * per];
        let mut count = vec![0usize; out.len()];
        for kh in 0..d.kv_heads {
            let key = |p: usize, t: usize| -> Vec<f64> {
                self.seen[p].0[(t * d.kv_heads + kh) * hd..][..hd]
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect()
            };
            let mut mean = vec![0f64; hd];
            for (p, page) in self.pages.iter().enumerate() {
                for t in 0..page.2 {
                    mean.iter_mut().zip(key(p, t)).for_each(|(m, x)| *m += x);
                }
            }
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            let mn = norm(&mean);
            for (p, page) in self.pages.iter().enumerate() {
                for t in 0..page.2 {
                    let k = key(p, t);
                    let cos = k.iter().zip(&mean).map(|(a, b)| a * b).sum::<f64>()
                        / (norm(&k).max(1e-12) * mn.max(1e-12));
                    out[at(self.entries[p], kh)] += 1.0 - cos;
                    count[at(self.entries[p], kh)] += 1;
                }
            }
        }
        for (o, c) in out.iter_mut().zip(count) {
            if c > 0 {
                *o /= c as f64;
            }
        }
        out
    }
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// A kernel for `dims` reading `fmt`, on `isa`, split over `threads`
/// threads from `split` keys each.
fn kernel(dims: Dims, fmt: ColdFormat, isa: Isa, threads: usize, split: usize) -> PagedDecode {
    PagedDecode::new(dims)
        .unwrap()
        .with_cold(fmt)
        .unwrap()
        .with_isa(isa)
        .unwrap()
        .with_threads(threads, split)
}

fn isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.supported()).collect()
}

/// Runs `kern` and returns the output and the mass.
fn run(kern: &PagedDecode, f: &Fixture, q: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let d = f.dims;
    let mut out = vec![f32::NAN; d.heads * d.head_dim];
    let mut mass = vec![0f32; 2 * f.pages.len()];
    kern.run(q, &f.spans(), &mut out, Some(&mut mass)).unwrap();
    (out, mass)
}

/// Every tier mix, with GQA groups of 1, 3 and 4, ragged last pages, every
/// cold format, rotation on and off, one and three threads: the output and
/// the mass per entry equal a dense f64 softmax over the keys and values
/// the cache would decode, and entries never named get no mass.
#[test]
fn matches_a_dense_softmax_over_every_tier_mix() {
    let mixes: [&[Kind]; 5] = [
        &[Kind::F32],
        &[Kind::F16],
        &[Kind::Cold],
        &[Kind::Cold, Kind::F32],
        &[Kind::F32, Kind::Cold, Kind::F16, Kind::Cold],
    ];
    let shapes = [
        Dims {
            heads: 3,
            kv_heads: 3,
            head_dim: 16,
        },
        Dims {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        },
        Dims {
            heads: 8,
            kv_heads: 2,
            head_dim: 32,
        },
    ];
    let mut seed = 1;
    for dims in shapes {
        for (bits, axis, rotated, vg) in [
            (8, Axis::PerChannel, false, 8),
            (4, Axis::PerChannel, false, 8),
            (4, Axis::PerToken, true, 8),
            (2, Axis::PerChannel, true, 8),
            (4, Axis::PerChannel, false, 32),
            (2, Axis::PerChannel, true, 32),
            (4, Axis::PerToken, false, 32),
        ] {
            if dims.head_dim % vg != 0 {
                continue;
            }
            let block = 16;
            let (fmt, kq, vq) = cold_format(bits, block, axis, rotated, vg);
            for mix in mixes {
                seed += 1;
                let last = 1 + (seed as usize * 7) % block;
                let f = fixture(seed, dims, block, mix, 9, last, Some((&*kq, &*vq)));
                let q = Rng(seed ^ 0xabc).vec(dims.heads * dims.head_dim, 1.5);
                let (want, want_mass) = f.dense(&q);
                for isa in isas() {
                    for threads in [1, 3] {
                        let kern = kernel(dims, fmt, isa, threads, 16);
                        let (out, mass) = run(&kern, &f, &q);
                        let what = format!(
                            "{dims:?} int{bits} {axis:?} rot={rotated} vg={vg} {mix:?} {isa:?} x{threads}"
                        );
                        close(&what, &out, &want, 2e-5);
                        close(&format!("{what} mass"), &mass, &want_mass, 2e-5);
                        assert!(mass.iter().skip(1).step_by(2).all(|&m| m == 0.0));
                    }
                }
            }
        }
    }
}

/// The fast path and the scalar twin agree closely on long contexts where
/// rounding accumulates, split or not.
#[test]
fn every_instruction_set_agrees_with_the_scalar_twin() {
    let dims = Dims {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    let (fmt, kq, vq) = cold_format(4, 32, Axis::PerChannel, false, 32);
    let f = fixture(
        77,
        dims,
        32,
        &[Kind::Cold, Kind::Cold, Kind::F32],
        64,
        5,
        Some((&*kq, &*vq)),
    );
    let q = Rng(5).vec(dims.heads * dims.head_dim, 3.0);
    let base = PagedDecode::new(dims).unwrap().with_cold(fmt).unwrap();
    let scalar = base.with_isa(Isa::Scalar).unwrap();
    let (want, want_mass) = run(&scalar, &f, &q);
    let widen = |x: &[f32]| x.iter().map(|&y| f64::from(y)).collect::<Vec<_>>();
    for isa in isas() {
        for threads in [1, 2, 4] {
            let k = base.with_isa(isa).unwrap().with_threads(threads, 64);
            let (out, mass) = run(&k, &f, &q);
            close(&format!("{isa:?} x{threads}"), &out, &widen(&want), 1e-5);
            close(
                &format!("{isa:?} x{threads} mass"),
                &mass,
                &widen(&want_mass),
                1e-5,
            );
        }
    }
}

/// Two spans of one entry add up; the mass over all entries is one per
/// query head; without a mass buffer the output is the same.
#[test]
fn mass_is_per_entry_and_sums_to_the_heads() {
    let dims = Dims {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let mut f = fixture(3, dims, 4, &[Kind::F32], 6, 4, None);
    f.entries = vec![0, 0, 1, 1, 1, 3];
    let q = Rng(9).vec(32, 1.0);
    for isa in isas() {
        let k = PagedDecode::new(dims).unwrap().with_isa(isa).unwrap();
        let mut mass = vec![0f32; 4];
        let mut out = vec![0f32; 32];
        k.run(&q, &f.spans(), &mut out, Some(&mut mass)).unwrap();
        assert_eq!(mass[2], 0.0);
        assert!((mass.iter().sum::<f32>() - 4.0).abs() < 1e-5, "{mass:?}");
        let mut plain = vec![0f32; 32];
        k.run(&q, &f.spans(), &mut plain, None).unwrap();
        assert_eq!(out, plain);
    }
}

/// The mass per entry and KV head (head-wise eviction's input) equals the
/// dense softmax's, summed over each KV head's query heads, for every
/// tier mix, split over threads or not; summed over the heads it is the
/// plain per-entry mass; a buffer that is not a whole number of heads per
/// entry is refused.
#[test]
fn mass_per_head_is_each_kv_heads_share() {
    let dims = Dims {
        heads: 6,
        kv_heads: 2,
        head_dim: 32,
    };
    let (fmt, kq, vq) = cold_format(4, 8, Axis::PerChannel, false, 32);
    let mixes: [&[Kind]; 2] = [&[Kind::F32, Kind::F16], &[Kind::Cold, Kind::F32]];
    for (m, mix) in mixes.iter().enumerate() {
        let mut f = fixture(60 + m as u64, dims, 8, mix, 7, 3, Some((&*kq, &*vq)));
        f.entries = vec![0, 2, 2, 4, 6, 8, 12];
        let q = Rng(11).vec(dims.heads * dims.head_dim, 1.0);
        let (_, want) = f.dense_per_head(&q);
        for isa in isas() {
            for threads in [1, 3] {
                let k = kernel(dims, fmt, isa, threads, 8).with_per_head(true);
                let mut out = vec![0f32; dims.heads * dims.head_dim];
                let mut mass = vec![0f32; want.len()];
                k.run(&q, &f.spans(), &mut out, Some(&mut mass)).unwrap();
                close(&format!("{mix:?} {isa:?} x{threads}"), &mass, &want, 2e-5);
                let plain = kernel(dims, fmt, isa, threads, 8);
                let mut summed = vec![0f32; want.len() / 2];
                let mut out2 = vec![0f32; out.len()];
                plain
                    .run(&q, &f.spans(), &mut out2, Some(&mut summed))
                    .unwrap();
                let folded: Vec<f64> = mass
                    .chunks_exact(2)
                    .map(|h| f64::from(h[0] + h[1]))
                    .collect();
                close("summed over heads", &summed, &folded, 1e-5);
                assert_eq!(out, out2, "the output does not depend on it");
            }
        }
    }
    let k = PagedDecode::new(dims).unwrap().with_per_head(true);
    let f = fixture(9, dims, 8, &[Kind::F32], 2, 8, None);
    let mut out = vec![0f32; dims.heads * dims.head_dim];
    let mut odd = vec![0f32; 5];
    let r = k.run(&[0.1; 192], &f.spans(), &mut out, Some(&mut odd));
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
}

/// Key novelty from the same pass equals the dense computation for every
/// tier mix (rotated cold keys excepted: refused), with entries spread over
/// several pages, split over threads or not.
#[test]
fn key_novelty_is_the_distance_from_the_mean_key() {
    let dims = Dims {
        heads: 6,
        kv_heads: 2,
        head_dim: 32,
    };
    let (fmt, kq, vq) = cold_format(4, 8, Axis::PerChannel, false, 32);
    let mixes: [&[Kind]; 3] = [
        &[Kind::F32],
        &[Kind::F16, Kind::Cold],
        &[Kind::Cold, Kind::F32, Kind::F16],
    ];
    for (m, mix) in mixes.iter().enumerate() {
        let mut f = fixture(40 + m as u64, dims, 8, mix, 7, 3, Some((&*kq, &*vq)));
        // Pages 1 and 2 are one entry; page 5 another's only page.
        f.entries = vec![0, 2, 2, 4, 6, 8, 12];
        let q = Rng(7).vec(dims.heads * dims.head_dim, 1.0);
        for (isa, per_head) in isas().into_iter().flat_map(|i| [(i, false), (i, true)]) {
            let want = f.dense_novelty(per_head);
            for threads in [1, 3] {
                let k = kernel(dims, fmt, isa, threads, 8).with_per_head(per_head);
                let mut out = vec![0f32; dims.heads * dims.head_dim];
                let mut nv = vec![0f32; want.len()];
                k.run_observed(&q, &f.spans(), &mut out, None, Some(&mut nv))
                    .unwrap();
                let case = format!("{mix:?} {isa:?} x{threads} per head {per_head}");
                close(&case, &nv, &want, 1e-5);
                // Entries 1 and 13 hold no keys.
                let per = nv.len() / 14;
                let empty = nv[per..2 * per].iter().chain(&nv[13 * per..]);
                assert!(empty.into_iter().all(|&x| x == 0.0), "entries without keys");
                let mut plain = vec![0f32; out.len()];
                k.run(&q, &f.spans(), &mut plain, None).unwrap();
                assert_eq!(out, plain, "the output does not depend on it");
            }
        }
    }
    // Rotated cold keys: refused, output untouched.
    let (rot, kq, vq) = cold_format(4, 8, Axis::PerChannel, true, 32);
    let f = fixture(9, dims, 8, &[Kind::Cold], 2, 8, Some((&*kq, &*vq)));
    let k = PagedDecode::new(dims).unwrap().with_cold(rot).unwrap();
    let mut out = vec![7f32; dims.heads * dims.head_dim];
    let mut nv = vec![0f32; 4];
    let r = k.run_observed(&[0.1; 192], &f.spans(), &mut out, None, Some(&mut nv));
    assert!(matches!(r, Err(KernelError::Unsupported(_))), "{r:?}");
    assert!(out.iter().all(|&x| x == 7.0));
    // A novelty buffer too short for the entries.
    let mut short = vec![0f32; 2];
    let r = k.run_observed(&[0.1; 192], &f.spans(), &mut out, None, Some(&mut short));
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
    // Per head: a buffer that is not a whole number of heads per entry.
    let k = PagedDecode::new(dims).unwrap().with_per_head(true);
    let f = fixture(9, dims, 8, &[Kind::F32], 2, 8, None);
    let mut odd = vec![0f32; 5];
    let r = k.run_observed(&[0.1; 192], &f.spans(), &mut out, None, Some(&mut odd));
    assert!(matches!(r, Err(KernelError::Shape(_))), "{r:?}");
}

/// Every malformed input is an error before anything is read, and the
/// output buffer is untouched.
#[test]
fn malformed_inputs_are_errors_not_panics() {
    let dims = Dims {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    for bad in [
        Dims {
            heads: 4,
            kv_heads: 3,
            head_dim: 8,
        },
        Dims {
            heads: 0,
            kv_heads: 0,
            head_dim: 8,
        },
        Dims {
            heads: 2,
            kv_heads: 2,
            head_dim: 0,
        },
    ] {
        assert!(matches!(PagedDecode::new(bad), Err(KernelError::Shape(_))));
    }
    let (fmt, kq, vq) = cold_format(4, 8, Axis::PerChannel, false, 8);
    let f = fixture(
        4,
        dims,
        8,
        &[Kind::F32, Kind::Cold],
        2,
        4,
        Some((&*kq, &*vq)),
    );
    let k = PagedDecode::new(dims).unwrap();
    let q = vec![0.5f32; 32];
    let mut out = vec![7f32; 32];
    let spans = f.spans();
    let expect = |r: Result<(), KernelError>, what: &str, out: &[f32]| {
        let e = r.expect_err(what);
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        assert!(out.iter().all(|&x| x == 7.0), "{what}: output touched");
    };
    // A cold page without a cold format.
    expect(k.run(&q, &spans, &mut out, None), "no cold format", &out);
    let k = k.with_cold(fmt).unwrap();
    // Query or output of the wrong length.
    expect(k.run(&q[..31], &spans, &mut out, None), "short query", &out);
    let mut short = vec![7f32; 31];
    expect(k.run(&q, &spans, &mut short, None), "short output", &short);
    // No keys at all.
    expect(k.run(&q, &[], &mut out, None), "empty", &out);
    // A page shorter than its token count; a zero-token span.
    let mut s = spans.clone();
    s[0].tokens = 5;
    expect(k.run(&q, &s, &mut out, None), "page too short", &out);
    s[0].tokens = 0;
    expect(k.run(&q, &s, &mut out, None), "zero tokens", &out);
    // A cold span reading past its block.
    let mut s = spans.clone();
    s[1].tokens = 9;
    expect(k.run(&q, &s, &mut out, None), "cold span too long", &out);
    // An entry past the mass buffer.
    let mut mass = vec![0f32; 2];
    expect(k.run(&q, &spans, &mut out, Some(&mut mass)), "entry", &out);
    // A cold page quantized another way than the kernel reads.
    let (other, _, _) = cold_format(8, 8, Axis::PerChannel, false, 8);
    let k8 = PagedDecode::new(dims).unwrap().with_cold(other).unwrap();
    expect(k8.run(&q, &spans, &mut out, None), "other format", &out);
    // A corrupt cold page (non-finite scale): decoding refuses it.
    let mut bad = f.colds[0].0.clone();
    bad.scales[0] = f16::INFINITY;
    let corrupt = [Span {
        page: Page::Quant {
            k: &bad,
            v: &f.colds[0].1,
        },
        tokens: 4,
        entry: 0,
    }];
    assert!(matches!(
        k.run(&q, &corrupt, &mut out, None),
        Err(KernelError::Quant(_))
    ));
    // Truncated codes, a missing minimum.
    let mut short = f.colds[0].0.clone();
    short.packed.pop();
    let mut no_min = f.colds[0].1.clone();
    no_min.mins.pop();
    for (kb, vb) in [(&short, &f.colds[0].1), (&f.colds[0].0, &no_min)] {
        let span = [Span {
            page: Page::Quant { k: kb, v: vb },
            tokens: 4,
            entry: 0,
        }];
        let r = k.run(&q, &span, &mut out, None);
        assert!(matches!(r, Err(KernelError::Quant(_))), "{r:?}");
        assert!(out.iter().all(|&x| x == 7.0), "output touched");
    }
    // Rotation with a head dim that is not a power of two.
    let odd = PagedDecode::new(Dims {
        heads: 2,
        kv_heads: 1,
        head_dim: 12,
    })
    .unwrap();
    let (rot, _, _) = cold_format(4, 8, Axis::PerChannel, true, 8);
    assert!(matches!(
        odd.with_cold(rot),
        Err(KernelError::Unsupported(_))
    ));
    // A cold page whose heads differ from the kernel's.
    let wide = PagedDecode::new(Dims {
        heads: 4,
        kv_heads: 4,
        head_dim: 8,
    })
    .unwrap()
    .with_cold(fmt)
    .unwrap();
    let cold_only = [spans[1]];
    expect(wide.run(&q, &cold_only, &mut out, None), "heads", &out);
}

/// Random ragged tables (random kinds, lengths and entries) through every
/// instruction set and thread count, against the dense reference.
#[test]
fn random_tables() {
    let dims = Dims {
        heads: 6,
        kv_heads: 2,
        head_dim: 32,
    };
    let (fmt, kq, vq) = cold_format(4, 8, Axis::PerChannel, false, 32);
    let kinds = [Kind::F32, Kind::F16, Kind::Cold];
    for seed in 0..40u64 {
        let mut r = Rng(seed);
        let pages = 1 + r.below(20);
        let mix: Vec<Kind> = (0..pages).map(|_| kinds[r.below(3)]).collect();
        let last = 1 + r.below(8);
        let mut f = fixture(seed, dims, 8, &mix, pages, last, Some((&*kq, &*vq)));
        // Ragged pages anywhere (hot ones only: a cold block is full).
        for (i, p) in f.pages.iter_mut().enumerate() {
            if !matches!(p.0, Kind::Cold) && r.below(3) == 0 && i + 1 < pages {
                let t = 1 + r.below(8);
                p.2 = t;
                let row = dims.kv_heads * dims.head_dim;
                match p.0 {
                    Kind::F32 => {
                        f.f32s[p.1].0.truncate(t * row);
                        f.f32s[p.1].1.truncate(t * row);
                    }
                    _ => {
                        f.f16s[p.1].0.truncate(t * row);
                        f.f16s[p.1].1.truncate(t * row);
                    }
                }
                f.seen[i].0.truncate(t * row);
                f.seen[i].1.truncate(t * row);
            }
        }
        let q = r.vec(dims.heads * dims.head_dim, 2.0);
        let (want, want_mass) = f.dense(&q);
        for isa in isas() {
            for threads in [1, 2] {
                let k = kernel(dims, fmt, isa, threads, 8);
                let (out, mass) = run(&k, &f, &q);
                close(&format!("seed {seed} {isa:?}"), &out, &want, 2e-5);
                close(
                    &format!("seed {seed} {isa:?} mass"),
                    &mass,
                    &want_mass,
                    2e-5,
                );
            }
        }
    }
}

/// An instruction set the CPU lacks is refused when it is chosen, and
/// `detect` picks one the CPU has.
#[test]
fn an_instruction_set_the_cpu_lacks_is_an_error() {
    assert!(Isa::detect().supported());
    let dims = Dims {
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
    };
    for isa in Isa::ALL {
        let got = PagedDecode::new(dims).unwrap().with_isa(isa);
        if isa.supported() {
            assert_eq!(got.unwrap().isa(), isa);
        } else {
            let e = got.unwrap_err();
            assert!(matches!(e, KernelError::Unsupported(_)), "{e}");
            assert!(e.to_string().contains(isa.name()), "{e}");
        }
    }
    // One of the vector sets is foreign to every CPU.
    assert!(!(Isa::Avx2.supported() && Isa::Neon.supported()));
}
