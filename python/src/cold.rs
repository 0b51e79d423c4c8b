//! [`ColdStore`]: one layer's cold tier from Python, K and V quantized
//! block by block as a tier plan sends them, dequantized in one call.

use kvforge_quant::{Axis, QuantizedBlock, TierPlan};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::errors::size;
use crate::{Out, Qz, axis, build, err, read, shape};

/// One layer's cold tier: the whole blocks a tier plan (sink and hot
/// window in full precision, whole blocks of `block` tokens) sends there,
/// keys and values, in position order. One thread at a time: a call that
/// overlaps another thread's on the same store raises `RuntimeError:
/// Already borrowed` and changes nothing (give each thread its own store,
/// or hold a lock).
#[pyclass(module = "kvforge._native")]
pub(crate) struct ColdStore {
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
        window: i64,
        sink: i64,
        block: i64,
        group: i64,
        keys: &str,
        rotate: bool,
    ) -> PyResult<Self> {
        let (window, sink, block, group) = (
            size("window", window)?,
            size("sink", sink)?,
            size("block", block)?,
            size("group", group)?,
        );
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
    fn cold_blocks(&self, positions: i64) -> PyResult<usize> {
        Ok(self.plan.cold_blocks(size("positions", positions)?))
    }

    /// Quantizes one block of keys and one of values (C-contiguous
    /// float32, `block × heads × head_dim`, token-major) and appends
    /// them; on any error neither is appended.
    fn append(
        &mut self,
        py: Python<'_>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        heads: i64,
        head_dim: i64,
    ) -> PyResult<()> {
        let (heads, head_dim) = (size("heads", heads)?, size("head_dim", head_dim)?);
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
    fn truncate(&mut self, blocks: i64) -> PyResult<()> {
        let blocks = size("blocks", blocks)?;
        self.k.truncate(blocks);
        self.v.truncate(blocks);
        if self.k.is_empty() {
            self.dims = None;
        }
        Ok(())
    }

    /// Drops every block.
    fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
        self.dims = None;
    }
}
