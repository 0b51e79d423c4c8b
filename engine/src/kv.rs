//! Where a forward pass keeps its K/V: the [`KvStore`] seam the model
//! writes and attends through, the KV dimensions a store is sized by
//! ([`KvDims`]), and [`ContiguousCache`], the dense test oracle. The model
//! and every store depend on this module, never on each other.

use tch::{Kind, Tensor};

use crate::error::Result;

/// A model's KV dimensions: what a store needs to know of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvDims {
    /// Decoder layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// Where one forward step reads and writes K/V. Implemented by the paged
/// cache (through [`PagedSeq`](crate::cache::PagedSeq)) and by [`ContiguousCache`] (the oracle).
pub trait KvStore {
    /// The position of the next token (dropped positions included).
    fn len(&self) -> usize;
    /// Whether nothing is stored yet.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Makes room for `n` more positions (the cache's policies may demote
    /// or drop older entries first); on error nothing changed.
    fn prepare(&mut self, n: usize) -> Result<()>;
    /// Stores `k`, `v` (`[n, kv_heads, head_dim]`) of the prepared positions
    /// for `layer`, and attends `q` (`[n, heads, head_dim]`, rotated) over
    /// every position the sequence holds: returns `[n, heads, head_dim]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
    /// Marks the `n` prepared positions as stored.
    fn commit(&mut self, n: usize) -> Result<()>;
}

/// Contiguous per-layer K/V, grown by concatenation, dense causal
/// attention. A test oracle only.
#[derive(Default)]
pub struct ContiguousCache {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    len: usize,
    n: usize,
}

impl ContiguousCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        ContiguousCache {
            k: (0..layers).map(|_| None).collect(),
            v: (0..layers).map(|_| None).collect(),
            len: 0,
            n: 0,
        }
    }
}

impl KvStore for ContiguousCache {
    fn len(&self) -> usize {
        self.len
    }
    fn prepare(&mut self, n: usize) -> Result<()> {
        self.n = n;
        Ok(())
    }
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let cat = |old: &Option<Tensor>, new: &Tensor| -> Result<Tensor> {
            Ok(match old {
                Some(o) => Tensor::f_cat(&[o, new], 0)?,
                None => new.shallow_clone(),
            })
        };
        let k_all = cat(&self.k[layer], k)?;
        let v_all = cat(&self.v[layer], v)?;
        self.k[layer] = Some(k_all.shallow_clone());
        self.v[layer] = Some(v_all.shallow_clone());
        let (n, total) = (self.n as i64, (self.len + self.n) as i64);
        let dev = q.device();
        let mask = if n > 1 && total > n {
            let qp = Tensor::f_arange_start(total - n, total, (Kind::Int64, dev))?;
            let kp = Tensor::f_arange(total, (Kind::Int64, dev))?;
            Some(kp.f_unsqueeze(0)?.f_le_tensor(&qp.f_unsqueeze(1)?)?)
        } else {
            None
        };
        let prep = |t: &Tensor| -> Result<Tensor> {
            Ok(t.f_to_kind(q.kind())?.f_transpose(0, 1)?.f_unsqueeze(0)?)
        };
        let (h, hkv) = (q.size()[1], k.size()[1]);
        let out = Tensor::f_scaled_dot_product_attention(
            &prep(q)?,
            &prep(&k_all)?,
            &prep(&v_all)?,
            mask.as_ref(),
            0.0,
            n > 1 && total == n,
            None::<f64>,
            h != hkv,
        )?;
        Ok(out.f_squeeze_dim(0)?.f_transpose(0, 1)?)
    }
    fn commit(&mut self, n: usize) -> Result<()> {
        self.len += n;
        Ok(())
    }
}
