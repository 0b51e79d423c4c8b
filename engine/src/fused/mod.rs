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

use kvforge_kernels::{Dims, Isa, Page, PagedDecode, Span};
use tch::{Device, Kind, Tensor};

use crate::attention::{
    Attended, AttentionBackend, KvTensors, Observe, PageRef, ReferenceBackend, StepView,
};
use crate::error::{EngineError, Result};

mod gpu;

use gpu::attend_cuda;
#[cfg(test)]
mod tests;

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
        self.isa = isa.check().map_err(EngineError::from)?;
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
            .map_err(EngineError::from)?
            .with_isa(self.isa)
            .map_err(EngineError::from)?
            .with_threads(self.threads, self.min_split)
            .with_per_head(observe.per_head);
        if let Some(c) = kv.cold {
            kern = kern
                .with_cold(c.kernel_format())
                .map_err(EngineError::from)?;
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
        .map_err(EngineError::from)?;
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
