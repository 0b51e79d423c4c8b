//! [`FusedBackend`]: decode steps through `kvforge-kernels`' paged
//! attention, reading the block table in place.
//!
//! A decode step (one query token) on the CPU, with hot tensors in f32 or
//! f16, runs the fused kernel: hot pages are read where they sit in the
//! layer's K/V tensors, cold blocks are dequantized one at a time inside
//! the kernel, dropped entries are never visited, aliases read their
//! canonical block, and the attention mass per entry (or per entry and KV
//! head) comes from the same
//! pass, and so does KeyDiff's key novelty (per-entry sums of unit keys
//! against the mean key).
//!
//! A decode step on a GPU whose live keys are all hot (f32, f16 or bf16)
//! runs the CUDA twin (`kvforge_kernels::cuda`, compiled by NVRTC the
//! first time, launched on libtorch's stream over the tensors it owns);
//! the attention mass (per entry, KV head or row) comes from a softmax
//! over the logits the kernel writes. A GPU without NVRTC or a driver the
//! kernels can use falls back to the reference, with one warning.
//!
//! Everything else — prefill chunks (several queries, a causal mask),
//! cold blocks on a GPU, other dtypes, key novelty over Hadamard-rotated
//! cold keys or on a GPU, and CPU signals per token (token-level
//! eviction) — goes to [`ReferenceBackend`].

use std::sync::OnceLock;

use kvforge_kernels::cuda::{self, CudaDecode, DeviceStep, HotKind};
use kvforge_kernels::{Dims, Isa, Page, PagedDecode, Span};
use tch::{Device, Kind, Tensor};

use crate::attention::{
    Attended, AttentionBackend, KvTensors, Observe, PageRef, ReferenceBackend, StepView,
    interleave_heads,
};
use crate::error::{EngineError, Result};

/// The fused CPU decode kernel, with the reference for the rest.
#[derive(Clone, Copy, Debug)]
pub struct FusedBackend {
    isa: Isa,
    threads: usize,
    min_split: usize,
}

impl Default for FusedBackend {
    /// The fastest instruction set of this CPU, as many threads as
    /// libtorch's intra-op pool (`--threads`), contexts split from
    /// [`DEFAULT_MIN_SPLIT`](kvforge_kernels::DEFAULT_MIN_SPLIT) keys per
    /// thread.
    fn default() -> Self {
        FusedBackend {
            isa: Isa::detect(),
            threads: usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1),
            min_split: kvforge_kernels::DEFAULT_MIN_SPLIT,
        }
    }
}

impl FusedBackend {
    /// Runs with `isa` (an error if this CPU lacks it).
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = isa.check().map_err(kernel)?;
        Ok(self)
    }

    /// Splits contexts of at least `threads × min_split` keys over up to
    /// `threads` threads.
    pub fn with_threads(mut self, threads: usize, min_split: usize) -> Self {
        self.threads = threads.max(1);
        self.min_split = min_split.max(1);
        self
    }

    /// Whether this step runs fused (else the reference runs it).
    fn fits(q: &Tensor, kv: &KvTensors<'_>, layer: usize, observe: Observe) -> bool {
        let Some(k) = kv.k.get(layer) else {
            return false;
        };
        let rotated = kv.cold.is_some_and(|c| c.spec().rotate);
        q.size().first() == Some(&1)
            && !(observe.key_novelty && rotated)
            && !(observe.per_token && (observe.mass || observe.key_novelty))
            && q.device() == Device::Cpu
            && k.device() == Device::Cpu
            && matches!(k.kind(), Kind::Float | Kind::Half)
            && k.is_contiguous()
            && kv.v[layer].is_contiguous()
            && kv.v[layer].kind() == k.kind()
    }
}

/// `len` rows of `row` elements from row `slot` of a contiguous CPU
/// tensor of `T`, bounds-checked.
fn rows<T>(t: &Tensor, slot: usize, len: usize, row: usize) -> Result<&[T]> {
    let slots = t.size().first().copied().unwrap_or(0) as usize;
    if slot.checked_add(len).is_none_or(|end| end > slots) {
        return Err(EngineError::Request(format!(
            "the block table points at slots {slot}..{} of a pool of {slots}",
            slot.saturating_add(len)
        )));
    }
    // SAFETY: `t` is a contiguous CPU tensor whose elements are `T` (the
    // caller matched its kind) with `slots × row` elements; the range is
    // inside it (checked above). Those slots belong to blocks this
    // sequence holds: the step's own were written before attention, and a
    // block with other holders is never written, so nothing writes them
    // while the slice lives.
    Ok(unsafe {
        std::slice::from_raw_parts(
            t.data_ptr().cast::<T>().cast_const().add(slot * row),
            len * row,
        )
    })
}

impl AttentionBackend for FusedBackend {
    fn name(&self) -> &'static str {
        "fused"
    }

    fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        view: &StepView,
        kv: &KvTensors<'_>,
        observe: Observe,
    ) -> Result<Attended> {
        if let Some(done) = attend_cuda(layer, q, view, kv, observe)? {
            return Ok(done);
        }
        if !Self::fits(q, kv, layer, observe) {
            return ReferenceBackend.attend(layer, q, view, kv, observe);
        }
        let (k, v) = (&kv.k[layer], &kv.v[layer]);
        let (ks, qs) = (k.size(), q.size());
        let dims = Dims {
            heads: qs[1] as usize,
            kv_heads: ks[1] as usize,
            head_dim: ks[2] as usize,
        };
        if qs[2] != ks[2] {
            return Err(EngineError::Request(format!(
                "query head dim {} differs from the cache's {}",
                qs[2], ks[2]
            )));
        }
        let mut kern = PagedDecode::new(dims)
            .map_err(kernel)?
            .with_isa(self.isa)
            .map_err(kernel)?
            .with_threads(self.threads, self.min_split)
            .with_per_head(observe.per_head);
        if let Some(c) = kv.cold {
            kern = kern.with_cold(c.kernel_format()).map_err(kernel)?;
        }
        let row = dims.kv_heads * dims.head_dim;
        let half = k.kind() == Kind::Half;
        let mut spans = Vec::with_capacity(view.pages.len());
        for (page, entry) in &view.pages {
            let (page, tokens) = match page {
                PageRef::Hot { slot, len } if half => (
                    Page::F16 {
                        k: rows(k, *slot, *len, row)?,
                        v: rows(v, *slot, *len, row)?,
                    },
                    *len,
                ),
                PageRef::Hot { slot, len } => (
                    Page::F32 {
                        k: rows(k, *slot, *len, row)?,
                        v: rows(v, *slot, *len, row)?,
                    },
                    *len,
                ),
                PageRef::Cold { block, len, .. } => {
                    let (qk, qv) = block.layer(layer).ok_or_else(|| {
                        EngineError::Request(format!("a cold block holds no layer {layer}"))
                    })?;
                    (Page::Quant { k: qk, v: qv }, *len)
                }
            };
            spans.push(Span {
                page,
                tokens,
                entry: *entry,
            });
        }
        let qv = Vec::<f32>::try_from(q.f_to_kind(Kind::Float)?.f_flatten(0, -1)?)?;
        let mut out = vec![0f32; qv.len()];
        let per = if observe.per_head { dims.kv_heads } else { 1 };
        let mut mass = observe.mass.then(|| vec![0f32; view.entries() * per]);
        let mut key_novelty = observe
            .key_novelty
            .then(|| vec![0f32; view.entries() * per]);
        kern.run_observed(
            &qv,
            &spans,
            &mut out,
            mass.as_deref_mut(),
            key_novelty.as_deref_mut(),
        )
        .map_err(kernel)?;
        let out = Tensor::f_from_slice(&out)?
            .f_view([1, qs[1], qs[2]])?
            .f_to_kind(q.kind())?;
        Ok(Attended {
            out,
            mass,
            key_novelty,
        })
    }
}

/// A kernel's refusal as the engine's error: what the kernel cannot do
/// here is `Unsupported`, a malformed table or page a `Request` error.
fn kernel(e: kvforge_kernels::KernelError) -> EngineError {
    match e {
        kvforge_kernels::KernelError::Unsupported(s) => EngineError::Unsupported(s),
        other => EngineError::Request(other.to_string()),
    }
}

/// The CUDA kernels of each GPU, opened on first use; the
/// reason when they cannot be (reported once, then the reference runs).
static CUDA: [OnceLock<std::result::Result<CudaDecode, String>>; 16] =
    [const { OnceLock::new() }; 16];

fn cuda_init(ordinal: usize) -> std::result::Result<&'static CudaDecode, String> {
    let cell = CUDA
        .get(ordinal)
        .ok_or_else(|| format!("cuda:{ordinal}: the CUDA kernels serve GPUs 0 to 15"))?;
    cell.get_or_init(|| {
        CudaDecode::new(ordinal).map_err(|e| {
            tracing::warn!("cuda:{ordinal}: {e}; decode attention runs through the reference");
            e.to_string()
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn cuda_kernels(ordinal: usize) -> Option<&'static CudaDecode> {
    cuda_init(ordinal).ok()
}

impl FusedBackend {
    /// Whether decode steps on GPU `ordinal` run the CUDA kernel: the
    /// architecture it was compiled for, or why not (then they run the
    /// reference). Opens the GPU for them on first call; each kernel
    /// variant compiles (NVRTC, about 0.2 s) at the first step that needs it.
    pub fn cuda_status(ordinal: usize) -> std::result::Result<String, String> {
        cuda_init(ordinal).map(|k| k.arch().to_string())
    }
}

/// A decode step on a GPU through the CUDA kernel, when it handles the
/// step (one query; hot keys in f32 / f16 / bf16; cold ones only from a
/// mirrored cold tier; a head dim and grouping it has a kernel for; no
/// key novelty asked); `None` sends the step to the reference.
fn attend_cuda(
    layer: usize,
    q: &Tensor,
    view: &StepView,
    kv: &KvTensors<'_>,
    observe: Observe,
) -> Result<Option<Attended>> {
    let (Some(k), Some(v)) = (kv.k.get(layer), kv.v.get(layer)) else {
        return Ok(None);
    };
    let Device::Cuda(ordinal) = k.device() else {
        return Ok(None);
    };
    let hot = match k.kind() {
        Kind::Float => HotKind::F32,
        Kind::Half => HotKind::F16,
        Kind::BFloat16 => HotKind::Bf16,
        _ => return Ok(None),
    };
    let (qs, ks) = (q.size(), k.size());
    let dims = Dims {
        heads: qs[1] as usize,
        kv_heads: ks[1] as usize,
        head_dim: ks[2] as usize,
    };
    let supported = qs[0] == 1
        && qs[2] == ks[2]
        && q.device() == k.device()
        && !observe.key_novelty
        && v.kind() == k.kind()
        && k.is_contiguous()
        && v.is_contiguous()
        && cuda::has_kernel(dims);
    let Some(table) = view.device_table().filter(|_| supported) else {
        return Ok(None);
    };
    let Some(kern) = cuda_kernels(ordinal) else {
        return Ok(None);
    };
    // A variant that does not compile (once tried, remembered) sends its
    // steps to the reference, with one warning.
    if let Err(e) = kern.prepare(hot, dims) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!("cuda:{ordinal}: {e}; these decode steps run through the reference");
        });
        return Ok(None);
    }
    // Held until the launch is queued: the mirror does not grow under it.
    let mirror = kv.cold.and_then(|t| t.mirror());
    // The kernel reads the pools at these slots: check them on the host,
    // where the table was resolved, before anything is launched.
    let pool = ks[0] as usize;
    let cold_slots = mirror.as_ref().map_or(0, |m| m.capacity());
    let mut any_cold = false;
    for (page, _) in &view.pages {
        let (slot, len, end) = match page {
            PageRef::Hot { slot, len } => (*slot, *len, pool),
            PageRef::Cold { slot, len, .. } => {
                any_cold = true;
                if *len > view.block_size() {
                    return Err(EngineError::Request(format!(
                        "a cold entry of {len} tokens in blocks of {}",
                        view.block_size()
                    )));
                }
                (*slot, 1, cold_slots)
            }
        };
        if slot.checked_add(len).is_none_or(|e| e > end) {
            return Err(EngineError::Request(format!(
                "the block table points at slots {slot}..{} of a pool of {end}",
                slot.saturating_add(len)
            )));
        }
    }
    let cold = match (any_cold, &mirror, kv.cold) {
        (false, _, _) => None,
        (true, Some(m), Some(tier)) => {
            let t = m.layer(layer).ok_or_else(|| {
                EngineError::Request(format!("the cold tier's device copy has no layer {layer}"))
            })?;
            let (kc, vc) = tier.configs();
            let quant = |i: usize, config| cuda::DeviceQuant {
                codes: t[i].data_ptr() as u64,
                scales: t[i + 1].data_ptr() as u64,
                mins: t[i + 2].data_ptr() as u64,
                config,
            };
            Some(cuda::DeviceCold {
                keys: quant(0, kc),
                values: quant(3, vc),
                block_tokens: view.block_size(),
            })
        }
        (true, _, _) => return Ok(None),
    };
    let dev = k.device();
    let keys = view.keys();
    let q32 = q.f_to_kind(Kind::Float)?.f_contiguous()?;
    let out = Tensor::f_empty([qs[1], qs[2]], (Kind::Float, dev))?;
    let floats = kern.scratch_floats(dims, keys);
    let scratch = Tensor::f_empty([floats as i64], (Kind::Float, dev))?;
    let scores = observe
        .mass
        .then(|| Tensor::f_empty([qs[1], keys as i64], (Kind::Float, dev)))
        .transpose()?;
    let ptr = |t: &Tensor| t.data_ptr() as u64;
    let step = DeviceStep {
        dims,
        hot,
        k_pool: ptr(k),
        v_pool: ptr(v),
        table: ptr(table),
        keys,
        cold,
        q: ptr(&q32),
        out: ptr(&out),
        scratch: ptr(&scratch),
        scratch_floats: floats,
        scores: scores.as_ref().map_or(0, ptr),
    };
    // SAFETY: every address is a live, contiguous tensor on this GPU of the
    // size `DeviceStep` documents (the pools `[slots][kv_heads][head_dim]`,
    // `table` one i64 per live key, the mirror's rows `[capacity, per
    // block]`, `out` and `q32` `[heads][head_dim]` f32, `scratch` as
    // sized, `scores` `[heads][keys]`); every hot slot is inside the pool
    // and every cold slot inside the mirror (checked above; `table` was
    // built from the same pages), and the mirror cannot be reallocated
    // while `mirror` is held. The launches go to libtorch's stream (the
    // legacy default one), so they run after the writes that produced
    // these tensors and before anything later reads `out` or `scores`;
    // tensors freed afterwards go back to libtorch's caching allocator,
    // whose reuse is ordered on that stream.
    unsafe { kern.run(&step) }.map_err(kernel)?;
    drop(mirror);
    let mass = match scores {
        None => None,
        Some(scores) => {
            let w = scores.f_softmax(-1, Kind::Float)?; // [heads, keys]
            Some(if observe.per_head {
                let g = (dims.heads / dims.kv_heads) as i64;
                let w = w
                    .f_view([dims.kv_heads as i64, g, keys as i64])?
                    .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Float)?
                    .f_contiguous()?
                    .f_to_device(Device::Cpu)?;
                interleave_heads(view, &Vec::<f32>::try_from(w.f_flatten(0, -1)?)?, false)
            } else {
                let w = w
                    .f_sum_dim_intlist([0i64].as_slice(), false, Kind::Float)?
                    .f_to_device(Device::Cpu)?;
                let w = Vec::<f32>::try_from(w)?;
                if observe.per_token {
                    view.per_row(&w)
                } else {
                    view.per_entry(&w, false)
                }
            })
        }
    };
    let out = out.f_view([1, qs[1], qs[2]])?.f_to_kind(q.kind())?;
    Ok(Some(Attended {
        out,
        mass,
        key_novelty: None,
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kvforge_kernels::cuda::ColdPoolHost;
    use kvforge_quant::{Axis, f16};

    use super::*;
    use crate::attention::kernel_table;
    use crate::cache::{PagedKvCache, Sequence};
    use crate::model::{Llama, LlamaConfig};
    use crate::tier::KvQuant;

    /// The table and cold-tier copy the CUDA kernel reads, decoded on the
    /// CPU with the kernel's own index arithmetic, give every key and
    /// value the reference gathers, in order (hot rows in place, cold rows
    /// from the copy, aliases and sinks included).
    #[test]
    fn the_kernel_table_and_the_cold_copy_hold_what_the_reference_gathers() {
        let cfg = LlamaConfig {
            head_dim: 64,
            n_heads: 4,
            n_kv_heads: 2,
            d_model: 64,
            ..LlamaConfig::tiny()
        };
        let model = Llama::random(cfg.clone(), 5, Device::Cpu, Kind::Float).unwrap();
        let bs = 16;
        for (bits, axis) in [
            (4, Axis::PerChannel),
            (2, Axis::PerToken),
            (8, Axis::PerChannel),
        ] {
            let mut cache = PagedKvCache::new(&cfg, bs, 512, Device::Cpu, Kind::Half).unwrap();
            let quant = KvQuant {
                window: 32,
                sink: 16,
                key_axis: axis,
                bits,
                ..KvQuant::parse("int4").unwrap()
            };
            cache.set_cold_tier(Some(quant)).unwrap();
            assert!(cache.mirror_cold_tier(Device::Cpu));
            let mut seq = Sequence::default();
            let ids: Vec<u32> = (0..203u32).map(|i| (i * 37 + 11) % 97).collect();
            for chunk in ids.chunks(50) {
                let _ = model
                    .forward(chunk, &mut cache.view(&mut seq), false)
                    .unwrap();
            }
            let table = cache.table(&seq).unwrap();
            let kv = cache.tensors();
            let tier = kv.cold.unwrap();
            let view = StepView::new(&table, 1, bs, Some(tier), Device::Cpu).unwrap();
            let rows = kernel_table(&view.pages, bs);
            assert_eq!(rows.len(), view.keys());
            let cold_rows = rows.iter().filter(|r| **r < 0).count();
            assert!(cold_rows >= 100, "{cold_rows} cold rows");
            let mirror = tier.mirror().unwrap();
            let (kc, vc) = tier.configs();
            let c = cfg.n_kv_heads * cfg.head_dim;
            for layer in 0..cfg.n_layers {
                let t = mirror.layer(layer).unwrap();
                let bytes = |t: &Tensor| Vec::<u8>::try_from(t.f_flatten(0, -1).unwrap()).unwrap();
                let halves = |t: &Tensor| -> Vec<f16> {
                    Vec::<i16>::try_from(t.f_flatten(0, -1).unwrap())
                        .unwrap()
                        .iter()
                        .map(|b| f16::from_bits(*b as u16))
                        .collect()
                };
                let pool = |i: usize| ColdPoolHost {
                    codes: bytes(&t[i]),
                    scales: halves(&t[i + 1]),
                    mins: halves(&t[i + 2]),
                };
                for (values, qc, p) in [(false, kc, pool(0)), (true, vc, pool(3))] {
                    let want = Vec::<f32>::try_from(
                        view.gather(&kv, layer, values, Kind::Float)
                            .unwrap()
                            .f_flatten(0, -1)
                            .unwrap(),
                    )
                    .unwrap();
                    let hot = if values { &kv.v[layer] } else { &kv.k[layer] };
                    let hot = Vec::<f32>::try_from(
                        hot.f_to_kind(Kind::Float)
                            .unwrap()
                            .f_flatten(0, -1)
                            .unwrap(),
                    )
                    .unwrap();
                    for (j, &r) in rows.iter().enumerate() {
                        for ch in 0..c {
                            let got = if r >= 0 {
                                hot[r as usize * c + ch]
                            } else {
                                let r = (-1 - r) as usize;
                                p.element(&qc, bs, c, r / bs, r % bs, ch)
                            };
                            assert_eq!(
                                got.to_bits(),
                                want[j * c + ch].to_bits(),
                                "int{bits} {axis:?} layer {layer} values {values} key {j} channel {ch}"
                            );
                        }
                    }
                }
            }
            drop(mirror);
            cache.free(&mut seq).unwrap();
        }
    }
}
