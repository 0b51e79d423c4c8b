//! Random decode steps for checking the CUDA kernel against the Rust one:
//! a hot pool stored as the kernel reads it, a cold pool quantized by
//! `kvforge-quant`, a table of entries in random order, and the reference
//! answer from [`PagedDecode`]. Used by the CPU emulator test and by
//! `gpu_check` on a GPU, so both check the same thing.

use half::{bf16, f16};
use kvforge_quant::{BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Quantizer};

use super::{ColdPoolHost, HotKind};
use crate::isa::Isa;
use crate::{ColdFormat, Dims, Page, PagedDecode, Result, Span};

/// What to draw.
#[derive(Clone, Copy, Debug)]
pub struct StepSpec {
    /// How hot rows are stored.
    pub kind: HotKind,
    /// Head counts and size.
    pub dims: Dims,
    /// Keys in the table.
    pub keys: usize,
    /// Rows per block (hot and cold).
    pub block_tokens: usize,
    /// Key and value formats of the cold pool; `None`: every entry hot.
    pub cold: Option<(QuantConfig, QuantConfig)>,
    /// Share of entries that are cold (cold blocks drawn with repeats:
    /// aliases).
    pub cold_share: f32,
    /// Entries of 1..=block_tokens keys; else full blocks (the last one
    /// ragged).
    pub ragged: bool,
    /// The draw.
    pub seed: u64,
}

impl StepSpec {
    /// `keys` keys of `kind` hot rows at `(heads, kv_heads, head_dim)`:
    /// blocks of 32, ragged entries, every entry hot (set `cold` for a
    /// mixed table: then half the entries are cold), a seed from the shape.
    pub fn new(
        kind: HotKind,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        keys: usize,
    ) -> Self {
        StepSpec {
            kind,
            dims: Dims {
                heads,
                kv_heads,
                head_dim,
            },
            keys,
            block_tokens: 32,
            cold: None,
            cold_share: 0.5,
            ragged: true,
            seed: keys as u64 * 7 + heads as u64,
        }
    }
}

/// One drawn step, on the host.
pub struct HostStep {
    /// What was drawn.
    pub spec: StepSpec,
    /// Hot keys as stored (`[slots][kv_heads][head_dim]`, little-endian).
    pub k_pool: Vec<u8>,
    /// Hot values as stored.
    pub v_pool: Vec<u8>,
    k_read: Vec<f32>,
    v_read: Vec<f32>,
    cold: Vec<(QuantizedBlock, QuantizedBlock)>,
    /// The cold keys, laid out for the kernel.
    pub k_cold: ColdPoolHost,
    /// The cold values.
    pub v_cold: ColdPoolHost,
    /// Per key: hot slot, or `-1 - row` of the cold pool.
    pub table: Vec<i64>,
    /// Per entry: (cold, block, keys).
    entries: Vec<(bool, usize, usize)>,
    /// The query, `[heads][head_dim]`.
    pub q: Vec<f32>,
}

/// splitmix64 in [-1, 1).
fn uniform(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Below `n` (> 0).
fn below(state: &mut u64, n: usize) -> usize {
    ((uniform(state) + 1.0) * 0.5 * n as f32) as usize % n
}

/// `x` stored as `kind` (little-endian) and read back widened to f32.
fn store(kind: HotKind, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    match kind {
        HotKind::F32 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), x.to_vec()),
        HotKind::F16 => {
            let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            let bytes = h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            (bytes, h.iter().map(|v| v.to_f32()).collect())
        }
        HotKind::Bf16 => {
            let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let bytes = h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            (bytes, h.iter().map(|v| v.to_f32()).collect())
        }
    }
}

impl HostStep {
    /// Draws a step as `spec` says.
    pub fn random(spec: StepSpec) -> Result<Self> {
        let (d, t) = (spec.dims, spec.block_tokens.max(1));
        let c = d.kv_heads * d.head_dim;
        let mut st = spec.seed;
        // Entry lengths first, then which are cold.
        let mut lens = Vec::new();
        let mut total = 0;
        while total < spec.keys {
            let len = if spec.ragged {
                1 + below(&mut st, t)
            } else {
                t
            };
            let len = len.min(spec.keys - total);
            lens.push(len);
            total += len;
        }
        let cold_of: Vec<bool> = lens
            .iter()
            .map(|_| spec.cold.is_some() && (uniform(&mut st) + 1.0) * 0.5 < spec.cold_share)
            .collect();
        let hot_blocks = cold_of.iter().filter(|c| !**c).count() + 2;
        let cold_blocks = (cold_of.iter().filter(|c| **c).count() / 2).max(1);
        let draw = |n: usize, st: &mut u64| -> Vec<f32> { (0..n).map(|_| uniform(st)).collect() };
        let (k_pool, k_read) = store(spec.kind, &draw(hot_blocks * t * c, &mut st));
        let (v_pool, v_read) = store(spec.kind, &draw(hot_blocks * t * c, &mut st));
        let shape = BlockShape {
            tokens: t,
            heads: d.kv_heads,
            head_dim: d.head_dim,
        };
        let mut cold = Vec::new();
        if let Some((kc, vc)) = spec.cold {
            for _ in 0..cold_blocks {
                let x: Vec<f32> = draw(shape.len(), &mut st).iter().map(|v| v * 2.0).collect();
                let y = draw(shape.len(), &mut st);
                cold.push((
                    GroupQuantizer::new(kc).quantize(shape, &x)?,
                    GroupQuantizer::new(vc).quantize(shape, &y)?,
                ));
            }
        }
        let k_cold = ColdPoolHost::from_blocks(&cold.iter().map(|b| &b.0).collect::<Vec<_>>())?;
        let v_cold = ColdPoolHost::from_blocks(&cold.iter().map(|b| &b.1).collect::<Vec<_>>())?;
        // Hot blocks in random order, each once; cold blocks with repeats.
        let mut free: Vec<usize> = (0..hot_blocks).collect();
        let mut table = Vec::with_capacity(total);
        let mut entries = Vec::with_capacity(lens.len());
        for (&len, &is_cold) in lens.iter().zip(&cold_of) {
            let b = if is_cold {
                let b = below(&mut st, cold_blocks);
                table.extend((0..len).map(|r| -1 - (b * t + r) as i64));
                b
            } else {
                let b = free.swap_remove(below(&mut st, free.len()));
                table.extend((0..len).map(|r| (b * t + r) as i64));
                b
            };
            entries.push((is_cold, b, len));
        }
        let q = draw(d.heads * d.head_dim, &mut st);
        Ok(HostStep {
            spec,
            k_pool,
            v_pool,
            k_read,
            v_read,
            cold,
            k_cold,
            v_cold,
            table,
            entries,
            q,
        })
    }

    /// Table entries (the mass buffer's length).
    pub fn entries(&self) -> usize {
        self.entries.len()
    }

    /// Bytes of KV the step reads: every hot row, and each cold entry's
    /// share of its block's codes and group parameters.
    pub fn kv_bytes(&self) -> usize {
        let s = self.spec;
        let c = s.dims.kv_heads * s.dims.head_dim;
        let elem = if s.kind == HotKind::F32 { 4 } else { 2 };
        let t = s.block_tokens.max(1);
        let cold_block = self.cold.first().map_or(0, |(k, v)| k.bytes() + v.bytes());
        self.entries
            .iter()
            .map(|&(is_cold, _, len)| {
                if is_cold {
                    cold_block * len / t
                } else {
                    2 * len * c * elem
                }
            })
            .sum()
    }

    /// The Rust kernel's output (`[heads][head_dim]`) and attention mass
    /// per entry.
    pub fn reference(&self, isa: Isa, threads: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let s = self.spec;
        let (c, t) = (s.dims.kv_heads * s.dims.head_dim, s.block_tokens.max(1));
        let spans: Vec<Span<'_>> = self
            .entries
            .iter()
            .enumerate()
            .map(|(e, &(is_cold, b, len))| Span {
                page: if is_cold {
                    Page::Quant {
                        k: &self.cold[b].0,
                        v: &self.cold[b].1,
                    }
                } else {
                    Page::F32 {
                        k: &self.k_read[b * t * c..(b * t + len) * c],
                        v: &self.v_read[b * t * c..(b * t + len) * c],
                    }
                },
                tokens: len,
                entry: e,
            })
            .collect();
        let mut kern = PagedDecode::new(s.dims)?
            .with_isa(isa)?
            .with_threads(threads, crate::DEFAULT_MIN_SPLIT);
        if let Some((kc, vc)) = s.cold {
            kern = kern.with_cold(ColdFormat::new(kc, vc, false))?;
        }
        let mut out = vec![0f32; self.q.len()];
        let mut mass = vec![0f32; self.entries.len()];
        kern.run(&self.q, &spans, &mut out, Some(&mut mass))?;
        Ok((out, mass))
    }

    /// The attention mass per entry from the kernel's scaled logits
    /// (`[heads][keys]`): a softmax per head, summed over heads and over
    /// each entry's keys.
    pub fn mass_from_scores(&self, scores: &[f32]) -> Vec<f32> {
        let keys = self.table.len().max(1);
        let owner: Vec<usize> = self
            .entries
            .iter()
            .enumerate()
            .flat_map(|(e, x)| std::iter::repeat_n(e, x.2))
            .collect();
        let mut mass = vec![0f32; self.entries.len()];
        for row in scores.chunks_exact(keys) {
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|s| f64::from((s - mx).exp())).sum();
            for (j, s) in row.iter().enumerate() {
                mass[owner[j]] += (f64::from((s - mx).exp()) / sum) as f32;
            }
        }
        mass
    }
}

/// The largest `|got − want| / max(1, |want|)`.
pub fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
        .fold(
            if got.len() == want.len() {
                0.0
            } else {
                f32::INFINITY
            },
            f32::max,
        )
}
