//! [`Weight`]: a matrix of the model as a dense tensor, or as the GGUF
//! file's blocks, which the kernels' quantized matmul reads in place
//! (CPU, f32 activations): the default for a GGUF model on the CPU, about
//! a fifth of the bytes of its f32 matrices.

use std::cell::RefCell;
use std::sync::Arc;

use kvforge_kernels::{Activations, Isa, Pool, QMatrix};
use tch::{Device, Kind, Tensor};

use super::fused::{output, values};
use crate::error::{EngineError, Result};

/// One weight matrix `[out, in]`.
pub(crate) enum Weight {
    /// A tensor, in any dtype, on the model's device.
    Dense(Tensor),
    /// GGUF blocks (rows of `in` weights), on the CPU.
    Blocks(Arc<QMatrix>),
}

thread_local! {
    /// The activations of the last matmul on this thread, as int16.
    static ACTS: RefCell<Activations> = RefCell::new(Activations::default());
}

impl Weight {
    /// A second handle on the same matrix (no copy).
    pub(crate) fn share(&self) -> Weight {
        match self {
            Weight::Dense(t) => Weight::Dense(t.shallow_clone()),
            Weight::Blocks(q) => Weight::Blocks(Arc::clone(q)),
        }
    }

    /// Whether `self` and `other` are the same matrix (a tied head).
    pub(crate) fn same(&self, other: &Weight) -> bool {
        match (self, other) {
            (Weight::Dense(a), Weight::Dense(b)) => a.data_ptr() == b.data_ptr(),
            (Weight::Blocks(a), Weight::Blocks(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// The matrix as a tensor of `kind` on `device` (blocks dequantized;
    /// a dense one already of `kind` is the same tensor, not a copy).
    pub(crate) fn dense(&self, kind: Kind, device: Device) -> Result<Tensor> {
        match self {
            Weight::Dense(t) if t.kind() == kind => Ok(t.shallow_clone()),
            Weight::Dense(t) => Ok(t.f_to_kind(kind)?),
            Weight::Blocks(q) => {
                let shape = [q.rows() as i64, q.cols() as i64];
                Ok(Tensor::f_from_slice(&q.dequantize())?
                    .f_reshape(shape)?
                    .f_to_device(device)?
                    .f_to_kind(kind)?)
            }
        }
    }

    /// What the fingerprint of the model reads: how the matrix is stored
    /// (dtype or block format, shape) and its bytes.
    pub(crate) fn fingerprint(&self, h: &mut xxhash_rust::xxh3::Xxh3) -> Result<()> {
        match self {
            Weight::Dense(t) => {
                let t = t.f_to_device(Device::Cpu)?.f_contiguous()?;
                let n = t.numel();
                let mut buf = vec![0u8; n * t.kind().elt_size_in_bytes()];
                t.f_copy_data_u8(&mut buf, n)?;
                h.update(format!("{:?}{:?}", t.kind(), t.size()).as_bytes());
                h.update(&buf);
            }
            Weight::Blocks(q) => {
                h.update(format!("{}{:?}", q.format().name(), [q.rows(), q.cols()]).as_bytes());
                h.update(q.data());
            }
        }
        Ok(())
    }

    /// Rows `ids` of the matrix (an embedding lookup), in `kind`.
    pub(crate) fn rows(&self, ids: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
        match self {
            Weight::Dense(t) => {
                let ids = Tensor::f_from_slice(ids)?.f_to_device(device)?;
                Ok(t.f_index_select(0, &ids)?.f_to_kind(kind)?)
            }
            Weight::Blocks(q) => {
                let k = q.cols();
                let mut out = vec![0f32; ids.len() * k];
                for (&id, o) in ids.iter().zip(out.chunks_exact_mut(k)) {
                    let r = usize::try_from(id)
                        .map_err(|_| EngineError::Request(format!("token id {id}")))?;
                    q.dequantize_row(r, o)?;
                }
                Ok(Tensor::f_from_slice(&out)?
                    .f_reshape([ids.len() as i64, k as i64])?
                    .f_to_kind(kind)?)
            }
        }
    }
}

/// Activation rows above which a matmul over blocks dequantizes panels of
/// the weights into f32 for libtorch's sgemm instead of quantizing the
/// activations (prefill: the sgemm's blocking beats the int8 dots there).
const DENSE_ROWS: usize = 32;

/// Weight rows dequantized at a time for the sgemm (a panel of 576-wide
/// rows is 9 MB of f32).
const PANEL_ROWS: usize = 4096;

/// `x @ wᵀ` for each of `ws` (GGUF blocks), `x` `[rows, in]` on the CPU:
/// the activations are quantized once for all of them (or, above
/// [`DENSE_ROWS`] rows, each matrix is dequantized panel by panel for an
/// f32 matmul).
pub(crate) fn matmul_blocks(x: &Tensor, ws: &[&QMatrix]) -> Result<Vec<Tensor>> {
    let x = x.f_to_kind(Kind::Float)?.f_contiguous()?;
    let (m, k) = x.size2()?;
    let (m, k) = (m as usize, k as usize);
    if x.device() != Device::Cpu {
        return Err(EngineError::Unsupported(
            "GGUF block weights run on the CPU only".into(),
        ));
    }
    if m > DENSE_ROWS {
        return ws.iter().map(|w| dense_panels(&x, w)).collect();
    }
    // SAFETY: `x` is a contiguous f32 CPU tensor (just made so).
    let xs = unsafe { values(&x) };
    ACTS.with(|acts| {
        let mut a = acts.borrow_mut();
        a.quantize(xs, m, k)?;
        ws.iter()
            .map(|w| {
                output(&[m as i64, w.rows() as i64], |os| {
                    Ok(w.matmul(&a, os, Isa::detect(), Pool::global())?)
                })
            })
            .collect()
    })
}

/// `x @ wᵀ` through f32 panels of `w` and libtorch's matmul.
fn dense_panels(x: &Tensor, w: &QMatrix) -> Result<Tensor> {
    let k = w.cols();
    let mut outs = Vec::with_capacity(w.rows().div_ceil(PANEL_ROWS));
    let mut panel = Vec::new();
    for from in (0..w.rows()).step_by(PANEL_ROWS) {
        let n = PANEL_ROWS.min(w.rows() - from);
        panel.resize(n * k, 0f32);
        w.dequantize_rows(from, &mut panel, Pool::global())?;
        let t = Tensor::f_from_slice(&panel)?.f_reshape([n as i64, k as i64])?;
        outs.push(x.f_linear::<Tensor>(&t, None)?);
    }
    Ok(match outs.len() {
        1 => outs.swap_remove(0),
        _ => Tensor::f_cat(&outs, 1)?,
    })
}
