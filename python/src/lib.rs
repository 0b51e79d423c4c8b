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

mod conformance;
mod engine;
mod policy;
mod resolve;
mod tier;

use kvforge_quant::{
    Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Rotated, TierPlan,
};
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
    fn new(format: &str, group: usize, axis: &str, rotate: bool) -> PyResult<Self> {
        Ok(Quantizer {
            q: build(format, group, self::axis(axis)?, rotate)?,
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
        tokens: usize,
        heads: usize,
        head_dim: usize,
    ) -> PyResult<Block> {
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

/// One layer's cold tier: the whole blocks a tier plan (sink and hot
/// window in full precision, whole blocks of `block` tokens) sends there,
/// keys and values, in position order.
#[pyclass(module = "kvforge._native")]
struct ColdStore {
    keys: Box<dyn Qz>,
    values: Box<dyn Qz>,
    plan: TierPlan,
    block: usize,
    /// `(heads, head_dim)`, fixed by the first block.
    dims: Option<(usize, usize)>,
    k: Vec<QuantizedBlock>,
    v: Vec<QuantizedBlock>,
}

#[pymethods]
impl ColdStore {
    #[new]
    #[pyo3(signature = (format, window = 128, sink = 32, block = 32, group = 32, keys = "channel", rotate = false))]
    fn new(
        format: &str,
        window: usize,
        sink: usize,
        block: usize,
        group: usize,
        keys: &str,
        rotate: bool,
    ) -> PyResult<Self> {
        let plan = TierPlan::new(block, window)
            .and_then(|p| p.with_sink(sink))
            .map_err(err)?;
        Ok(ColdStore {
            keys: build(format, group, axis(keys)?, rotate)?,
            values: build(format, group, Axis::PerToken, rotate)?,
            plan,
            block,
            dims: None,
            k: Vec::new(),
            v: Vec::new(),
        })
    }

    /// Tokens per block.
    #[getter]
    fn block(&self) -> usize {
        self.block
    }

    /// Blocks held.
    #[getter]
    fn blocks(&self) -> usize {
        self.k.len()
    }

    /// Tokens held (`blocks × block`).
    #[getter]
    fn tokens(&self) -> usize {
        self.k.len() * self.block
    }

    /// Bytes held, keys and values: codes plus group parameters.
    #[getter]
    fn nbytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(QuantizedBlock::bytes)
            .sum()
    }

    /// The quantizers' names, keys then values.
    #[getter]
    fn names(&self) -> (String, String) {
        (self.keys.name(), self.values.name())
    }

    /// Blocks of a `positions`-token sequence that belong in the cold
    /// tier (after the sink, entirely older than the hot window).
    fn cold_blocks(&self, positions: usize) -> usize {
        self.plan.cold_blocks(positions)
    }

    /// Quantizes one block of keys and one of values (C-contiguous
    /// float32, `block × heads × head_dim`, token-major) and appends
    /// them; on any error neither is appended.
    fn append(
        &mut self,
        py: Python<'_>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        heads: usize,
        head_dim: usize,
    ) -> PyResult<()> {
        if let Some(d) = self.dims
            && d != (heads, head_dim)
        {
            return Err(err(format!(
                "kvforge: this store holds blocks of {} heads × {}, got {heads} × {head_dim}",
                d.0, d.1
            )));
        }
        let s = shape(self.block, heads, head_dim)?;
        let dims = [self.block, heads, head_dim];
        let (kx, vx) = (read(py, k, dims, "k")?, read(py, v, dims, "v")?);
        let (kq, vq) = py
            .detach(|| -> kvforge_quant::Result<_> {
                Ok((self.keys.quantize(s, &kx)?, self.values.quantize(s, &vx)?))
            })
            .map_err(err)?;
        self.dims = Some((heads, head_dim));
        self.k.push(kq);
        self.v.push(vq);
        Ok(())
    }

    /// Dequantizes every block into `k_out` and `v_out` (writable
    /// C-contiguous float32, `tokens × heads × head_dim` each).
    fn dequantize_into(
        &self,
        py: Python<'_>,
        k_out: &Bound<'_, PyAny>,
        v_out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let Some((heads, head_dim)) = self.dims else {
            // Nothing held: the outputs must be empty too.
            for (o, what) in [(k_out, "k_out"), (v_out, "v_out")] {
                let buf = PyBuffer::<f32>::get(o)
                    .map_err(|e| err(format!("kvforge: {what} must be a float32 array ({e})")))?;
                if buf.item_count() != 0 {
                    return Err(err(format!(
                        "kvforge: {what} holds {} elements, the store holds none",
                        buf.item_count()
                    )));
                }
            }
            return Ok(());
        };
        let n = self.block * heads * head_dim;
        let dims = [self.k.len() * self.block, heads, head_dim];
        let mut ko = Out::new(k_out, dims, "k_out")?;
        let mut vo = Out::new(v_out, dims, "v_out")?;
        let (a, b) = (ko.span(), vo.span());
        if a.start < b.end && b.start < a.end {
            return Err(err("kvforge: k_out and v_out overlap"));
        }
        for (blocks, q, out) in [
            (&self.k, &self.keys, &mut ko),
            (&self.v, &self.values, &mut vo),
        ] {
            let out = out.slice(py);
            for (b, o) in blocks.iter().zip(out.chunks_exact_mut(n.max(1))) {
                q.dequantize(b, o).map_err(err)?;
            }
        }
        Ok(())
    }

    /// Keeps the first `blocks` blocks (an undo for a caller whose step
    /// failed after some appends).
    fn truncate(&mut self, blocks: usize) {
        self.k.truncate(blocks);
        self.v.truncate(blocks);
        if self.k.is_empty() {
            self.dims = None;
        }
    }

    /// Drops every block.
    fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
        self.dims = None;
    }
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Quantizer>()?;
    m.add_class::<Block>()?;
    m.add_class::<ColdStore>()?;
    m.add_class::<engine::Engine>()?;
    m.add_function(wrap_pyfunction!(engine::ablate, m)?)?;
    m.add_function(wrap_pyfunction!(conformance::check_eviction_policy, m)?)?;
    m.add_function(wrap_pyfunction!(conformance::check_tier_policy, m)?)?;
    resolve::install_resolver();
    Ok(())
}
