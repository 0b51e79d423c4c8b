//! `kvforge._native`: the Python package's native module.
//!
//! It wraps the pure-Rust quantized tier (`kvforge-quant`) for Python:
//! [`Quantizer`] turns one `tokens × heads × head_dim` slab of `float32`
//! into a [`Block`] of packed codes and f16 group parameters and back,
//! with the crate's formats and numerics (INT8 symmetric, INT4 / INT2
//! affine, per-token or KIVI per-channel groups, Hadamard rotation); a
//! [`ColdStore`] is one layer's cold tier: the blocks a [`TierPlan`]
//! (sink, hot window, block size) sends there, K and V, appended in order
//! and dequantized in one call. Arrays cross by the buffer protocol
//! (numpy arrays, or a CPU tensor's `.numpy()` view), copied once each
//! way; every bad input is a `ValueError` with the crate's one-line
//! message, and a failed call changes nothing.

mod ablate;
mod cold;
mod conformance;
mod engine;
mod errors;
mod policy;
mod reply;
mod resolve;
mod tier;

use crate::errors::size;
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Rotated};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Any error as Python's `ValueError`, its message one line.
fn err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Parses `channel` / `token` (the group axis).
fn axis(name: &str) -> PyResult<Axis> {
    match name {
        "token" => Ok(Axis::PerToken),
        "channel" => Ok(Axis::PerChannel),
        _ => Err(err(format!(
            "kvforge: unknown group axis {name:?}; use \"token\" or \"channel\""
        ))),
    }
}

/// The crate's quantizer for a format, group size, axis and rotation.
fn build(format: &str, group: usize, axis: Axis, rotate: bool) -> PyResult<Box<dyn Qz>> {
    let bits = QuantConfig::parse_bits(format).map_err(err)?;
    let q = GroupQuantizer::new(QuantConfig::new(bits, group, axis).map_err(err)?);
    Ok(if rotate {
        Box::new(Rotated::new(q))
    } else {
        Box::new(q)
    })
}

/// The quantizer trait object the classes hold.
trait Qz: kvforge_quant::Quantizer {}
impl<T: kvforge_quant::Quantizer> Qz for T {}

/// The `float32` elements of a C-contiguous buffer of `n` of them.
fn read(py: Python<'_>, x: &Bound<'_, PyAny>, shape: [usize; 3], what: &str) -> PyResult<Vec<f32>> {
    let buf = PyBuffer::<f32>::get(x)
        .map_err(|e| err(format!("kvforge: {what} must be a float32 array ({e})")))?;
    check(&buf, shape, what)?;
    buf.to_vec(py)
}

/// Checks that `buf` is C-contiguous with the elements of `shape`: flat,
/// or of exactly that shape (so that a transposed slab is not grouped
/// along the wrong axis).
fn check(buf: &PyBuffer<f32>, shape: [usize; 3], what: &str) -> PyResult<()> {
    if !buf.is_c_contiguous() {
        return Err(err(format!("kvforge: {what} must be C-contiguous")));
    }
    let n: usize = shape.iter().product();
    if buf.item_count() != n {
        return Err(err(format!(
            "kvforge: {what} holds {} elements, the shape needs {n}",
            buf.item_count()
        )));
    }
    if buf.dimensions() > 1 && buf.shape() != shape {
        return Err(err(format!(
            "kvforge: {what} has shape {:?}, expected {shape:?} (tokens, heads, head_dim)",
            buf.shape()
        )));
    }
    Ok(())
}

/// A writable, C-contiguous float32 buffer of a checked size, written in
/// place (no copy through a Rust vector).
struct Out {
    buf: PyBuffer<f32>,
    n: usize,
}

impl Out {
    /// `out`, checked to be a writable, C-contiguous float32 buffer of
    /// `shape` (PyO3 checks its alignment).
    fn new(out: &Bound<'_, PyAny>, shape: [usize; 3], what: &str) -> PyResult<Out> {
        let buf = PyBuffer::<f32>::get(out)
            .map_err(|e| err(format!("kvforge: {what} must be a float32 array ({e})")))?;
        if buf.readonly() {
            return Err(err(format!("kvforge: {what} is read-only")));
        }
        check(&buf, shape, what)?;
        Ok(Out {
            buf,
            n: shape.iter().product(),
        })
    }

    /// The address range the buffer spans.
    fn span(&self) -> std::ops::Range<usize> {
        let start = self.buf.buf_ptr() as usize;
        start..start + self.n * std::mem::size_of::<f32>()
    }

    /// The buffer's elements, for writing while this call holds the GIL.
    ///
    /// Precondition (the caller's, as for numpy's `out=` arguments): no
    /// other thread writes this buffer during the call (numpy code that
    /// releases the GIL could); the module's callers pass arrays they own.
    fn slice<'a>(&'a mut self, _py: Python<'a>) -> &'a mut [f32] {
        if self.n == 0 {
            return &mut [];
        }
        // SAFETY: `Out::new` checked that the buffer is writable,
        // C-contiguous and holds exactly `n` f32s, and PyO3 checked its
        // alignment; `self.buf` keeps the exporting object alive and its
        // memory in place for `'a`; `&mut self` makes this the only slice
        // of it in this module, and callers with two buffers check that
        // their spans do not overlap; the precondition above rules out
        // writers outside it.
        unsafe { std::slice::from_raw_parts_mut(self.buf.buf_ptr().cast::<f32>(), self.n) }
    }
}

/// The slab shape, checked for overflow and emptiness.
fn shape(tokens: usize, heads: usize, head_dim: usize) -> PyResult<BlockShape> {
    let s = BlockShape {
        tokens,
        heads,
        head_dim,
    };
    match s.checked_len() {
        Some(n) if n > 0 => Ok(s),
        _ => Err(err(format!(
            "kvforge: shape ({tokens}, {heads}, {head_dim}) is empty or too large"
        ))),
    }
}

/// One quantized slab: packed codes and f16 group parameters.
#[pyclass(frozen, module = "kvforge._native")]
struct Block {
    inner: QuantizedBlock,
    /// The quantizer that made it (a rotated block read back unrotated
    /// would be garbage that no config check sees).
    made_by: String,
}

#[pymethods]
impl Block {
    /// Bytes the block occupies: codes plus group parameters.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }

    /// `(tokens, heads, head_dim)`.
    #[getter]
    fn shape(&self) -> (usize, usize, usize) {
        let s = self.inner.shape;
        (s.tokens, s.heads, s.head_dim)
    }

    fn __repr__(&self) -> String {
        let (t, h, d) = self.shape();
        format!("Block(shape=({t}, {h}, {d}), nbytes={})", self.nbytes())
    }
}

/// A quantizer: `Quantizer("int4", group=32, axis="token", rotate=False)`.
#[pyclass(frozen, module = "kvforge._native")]
struct Quantizer {
    q: Box<dyn Qz>,
}

#[pymethods]
impl Quantizer {
    #[new]
    #[pyo3(signature = (format, group = 32, axis = "token", rotate = false))]
    fn new(format: &str, group: i64, axis: &str, rotate: bool) -> PyResult<Self> {
        Ok(Quantizer {
            q: build(format, size("group", group)?, self::axis(axis)?, rotate)?,
        })
    }

    /// `int4-g32-token`, `hadamard+int8-…`.
    #[getter]
    fn name(&self) -> String {
        self.q.name()
    }

    /// Quantizes `x`, a C-contiguous float32 buffer of
    /// `tokens × heads × head_dim` elements, token-major.
    fn quantize(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        tokens: i64,
        heads: i64,
        head_dim: i64,
    ) -> PyResult<Block> {
        let (tokens, heads, head_dim) = (
            size("tokens", tokens)?,
            size("heads", heads)?,
            size("head_dim", head_dim)?,
        );
        let s = shape(tokens, heads, head_dim)?;
        let v = read(py, x, [tokens, heads, head_dim], "x")?;
        let inner = py.detach(|| self.q.quantize(s, &v)).map_err(err)?;
        Ok(Block {
            inner,
            made_by: self.q.name(),
        })
    }

    /// Dequantizes `block` into `out`, a writable C-contiguous float32
    /// buffer of the block's element count.
    fn dequantize_into(
        &self,
        py: Python<'_>,
        block: &Block,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        if block.made_by != self.q.name() {
            return Err(err(format!(
                "kvforge: this block was quantized by {}, not {}",
                block.made_by,
                self.q.name()
            )));
        }
        let s = block.inner.shape;
        let mut out = Out::new(out, [s.tokens, s.heads, s.head_dim], "out")?;
        self.q.dequantize(&block.inner, out.slice(py)).map_err(err)
    }
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Quantizer>()?;
    m.add_class::<Block>()?;
    m.add_class::<cold::ColdStore>()?;
    m.add_class::<engine::Engine>()?;
    m.add_function(wrap_pyfunction!(ablate::ablate, m)?)?;
    m.add_function(wrap_pyfunction!(conformance::check_eviction_policy, m)?)?;
    m.add_function(wrap_pyfunction!(conformance::check_tier_policy, m)?)?;
    Ok(())
}
