//! Decode steps on a GPU: the CUDA twin of the paged kernel
//! (`kvforge_kernels::cuda`), loaded once per device, fed one mixed table
//! of hot slots and the cold tier's device copy.

use std::sync::OnceLock;

use kvforge_kernels::Dims;
use kvforge_kernels::cuda::{self, CudaDecode, DeviceStep, HotKind};
use tch::{Device, Kind, Tensor};

use crate::attention::{Attended, KvTensors, Observe, PageRef, StepView, interleave_heads};
use crate::error::{EngineError, Result};

use super::*;

/// The CUDA kernels of each GPU, opened on first use; the
/// reason when they cannot be (reported once, then the reference runs).
static CUDA: [OnceLock<std::result::Result<CudaDecode, String>>; 16] =
    [const { OnceLock::new() }; 16];

pub(super) fn cuda_init(ordinal: usize) -> std::result::Result<&'static CudaDecode, String> {
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

pub(super) fn cuda_kernels(ordinal: usize) -> Option<&'static CudaDecode> {
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
pub(super) fn attend_cuda(
    layer: usize,
    q: &Tensor,
    view: &StepView,
    kv: &KvTensors<'_>,
    observe: Observe,
) -> Result<Option<Attended>> {
    let Some(Launch {
        k,
        v,
        hot,
        dims,
        table,
        kern,
    }) = launchable(layer, q, view, kv, observe)
    else {
        return Ok(None);
    };
    let qs = q.size();
    // Held until the launch is queued: the mirror does not grow under it.
    let mirror = kv.cold.and_then(|t| t.mirror());
    // The kernel reads the pools at these slots: check them on the host,
    // where the table was resolved, before anything is launched.
    let pool = k.size()[0] as usize;
    let cold_slots = mirror.as_ref().map_or(0, |m| m.capacity());
    let any_cold = check_pages(view, pool, cold_slots)?;
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
    unsafe { kern.run(&step) }.map_err(EngineError::from)?;
    drop(mirror);
    let mass = scores
        .map(|s| mass_from_scores(&s, view, observe, dims, keys))
        .transpose()?;
    let out = out.f_view([1, qs[1], qs[2]])?.f_to_kind(q.kind())?;
    Ok(Some(Attended {
        out,
        mass,
        key_novelty: None,
    }))
}

/// Checks on the host, where the table was resolved, that every page the
/// kernel will read lies inside its pool (`pool` hot slots, `cold_slots`
/// blocks of the cold tier's device copy). Returns whether any page is
/// cold.
fn check_pages(view: &StepView, pool: usize, cold_slots: usize) -> Result<bool> {
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
    Ok(any_cold)
}

/// The attention mass from the kernel's scaled logits (`[heads, keys]`):
/// per entry, per entry and KV head, or per row, as `observe` asks.
fn mass_from_scores(
    scores: &Tensor,
    view: &StepView,
    observe: Observe,
    dims: Dims,
    keys: usize,
) -> Result<Vec<f32>> {
    let w = scores.f_softmax(-1, Kind::Float)?; // [heads, keys]
    Ok(if observe.per_head {
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

/// What a CUDA launch of one decode step needs, once it is known to run.
struct Launch<'a> {
    k: &'a Tensor,
    v: &'a Tensor,
    hot: HotKind,
    dims: Dims,
    table: &'a Tensor,
    kern: &'static CudaDecode,
}

/// Whether the CUDA kernel runs this step (one query on the GPU, a head
/// dim and a group it was compiled for, no key novelty asked, contiguous
/// pools of one dtype, the device table resolved), and what it needs.
fn launchable<'a>(
    layer: usize,
    q: &Tensor,
    view: &'a StepView,
    kv: &'a KvTensors<'_>,
    observe: Observe,
) -> Option<Launch<'a>> {
    let (k, v) = (kv.k.get(layer)?, kv.v.get(layer)?);
    let Device::Cuda(ordinal) = k.device() else {
        return None;
    };
    let hot = match k.kind() {
        Kind::Float => HotKind::F32,
        Kind::Half => HotKind::F16,
        Kind::BFloat16 => HotKind::Bf16,
        _ => return None,
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
    let table = view.device_table().filter(|_| supported)?;
    let kern = cuda_kernels(ordinal)?;
    // A variant that does not compile (once tried, remembered) sends its
    // steps to the reference, with one warning.
    if let Err(e) = kern.prepare(hot, dims) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!("cuda:{ordinal}: {e}; these decode steps run through the reference");
        });
        return None;
    }
    Some(Launch {
        k,
        v,
        hot,
        dims,
        table,
        kern,
    })
}
