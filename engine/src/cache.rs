//! KV storage: the paged cache over `kvforge-pool` blocks, and a contiguous
//! cache kept only as a test oracle.
//!
//! The paged cache owns one K and one V tensor per layer, shaped
//! `[max_blocks * block_size, kv_heads, head_dim]`: slot `b * block_size + o`
//! holds offset `o` of block index `b`. A [`Sequence`] is a block table; a
//! forward step writes its new K/V at the slots of its positions
//! (`index_copy_`) and reads every position back through the table
//! (`index_select`).

use kvforge_pool::{BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, StorageFormat};
use tch::{Device, Kind, Tensor};

use crate::model::LlamaConfig;
use crate::{EngineError, Result};

/// Where one forward step reads and writes K/V. Implemented by the paged
/// cache (through [`PagedSeq`]) and by [`ContiguousCache`] (the oracle).
pub trait KvStore {
    /// Positions already stored (the new tokens start here).
    fn len(&self) -> usize;
    /// Whether nothing is stored yet.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Makes room for `n` more positions; errors leave the store unchanged.
    fn prepare(&mut self, n: usize) -> Result<()>;
    /// Stores `k`, `v` (`[n, kv_heads, head_dim]`) for the prepared positions
    /// of `layer`; returns keys and values of all positions `[len + n, ..]`.
    fn update(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
    /// Marks the `n` prepared positions as stored.
    fn commit(&mut self, n: usize);
}

/// A sequence's block table in a [`PagedKvCache`].
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Blocks in position order.
    pub blocks: Vec<BlockId>,
    /// Positions stored.
    pub len: usize,
}

/// Paged KV storage for one model over a `kvforge-pool` [`BlockPool`].
pub struct PagedKvCache {
    pool: BlockPool,
    block_size: usize,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl PagedKvCache {
    /// Storage for `max_tokens` tokens (rounded up to whole blocks) on
    /// `device` in `kind`. Memory is reserved up front; the pool hands out
    /// block ids.
    pub fn new(
        cfg: &LlamaConfig,
        block_size: usize,
        max_tokens: usize,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        if block_size == 0 || max_tokens == 0 {
            return Err(EngineError::Request(
                "block size and KV capacity must be positive".into(),
            ));
        }
        let format = match kind {
            Kind::Float => StorageFormat::F32,
            Kind::BFloat16 => StorageFormat::BF16,
            _ => StorageFormat::F16,
        };
        let layout = KvLayout::new(
            cfg.n_layers as u32,
            cfg.n_kv_heads as u32,
            cfg.head_dim as u32,
            u32::try_from(block_size)
                .map_err(|_| EngineError::Request("block size too large".into()))?,
            format,
        )?;
        let blocks = max_tokens.div_ceil(block_size);
        let pool = BlockPool::new(layout, PoolConfig::fixed(blocks))?;
        let slots = (blocks * block_size) as i64;
        let shape = [slots, cfg.n_kv_heads as i64, cfg.head_dim as i64];
        let zeros = || Tensor::f_zeros(shape, (kind, device));
        let k = (0..cfg.n_layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let v = (0..cfg.n_layers)
            .map(|_| zeros())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(PagedKvCache {
            pool,
            block_size,
            k,
            v,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The block pool (ids, counts, bytes).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// KV bytes held by sequences now.
    pub fn bytes_in_use(&self) -> u64 {
        self.pool.stats().in_use_bytes
    }

    /// Releases a sequence's blocks (tail first) and empties it.
    pub fn free(&self, seq: &mut Sequence) -> Result<()> {
        self.pool.release_sequence(&seq.blocks)?;
        seq.blocks.clear();
        seq.len = 0;
        Ok(())
    }

    /// A [`KvStore`] view of `seq` for one forward step.
    pub fn view<'a>(&'a self, seq: &'a mut Sequence) -> PagedSeq<'a> {
        PagedSeq {
            cache: self,
            seq,
            new_slots: None,
            all_slots: None,
        }
    }

    fn slot(&self, seq: &Sequence, pos: usize) -> i64 {
        let b = seq.blocks[pos / self.block_size];
        (b.index() as usize * self.block_size + pos % self.block_size) as i64
    }
}

/// One sequence of a [`PagedKvCache`] seen as a [`KvStore`].
pub struct PagedSeq<'a> {
    cache: &'a PagedKvCache,
    seq: &'a mut Sequence,
    new_slots: Option<Tensor>,
    all_slots: Option<Tensor>,
}

impl KvStore for PagedSeq<'_> {
    fn len(&self) -> usize {
        self.seq.len
    }

    fn prepare(&mut self, n: usize) -> Result<()> {
        let c = self.cache;
        let total = self.seq.len + n;
        let need = total
            .div_ceil(c.block_size)
            .saturating_sub(self.seq.blocks.len());
        if need > 0 {
            let got = c.pool.allocate(need).ok_or_else(|| {
                let s = c.pool.stats();
                EngineError::CacheFull(format!(
                    "{need} more blocks of {} tokens needed, {} of {} free",
                    c.block_size,
                    s.free(),
                    s.capacity
                ))
            })?;
            self.seq.blocks.extend(got.blocks);
        }
        let device = c.k[0].device();
        let new: Vec<i64> = (self.seq.len..total).map(|p| c.slot(self.seq, p)).collect();
        let all: Vec<i64> = (0..total).map(|p| c.slot(self.seq, p)).collect();
        self.new_slots = Some(Tensor::f_from_slice(&new)?.f_to_device(device)?);
        self.all_slots = Some(Tensor::f_from_slice(&all)?.f_to_device(device)?);
        Ok(())
    }

    fn update(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (Some(new), Some(all)) = (&self.new_slots, &self.all_slots) else {
            return Err(EngineError::Request(
                "KvStore::update before prepare".into(),
            ));
        };
        let mut ks = self.cache.k[layer].shallow_clone();
        let mut vs = self.cache.v[layer].shallow_clone();
        let _ = ks.f_index_copy_(0, new, &k.f_to_kind(ks.kind())?)?;
        let _ = vs.f_index_copy_(0, new, &v.f_to_kind(vs.kind())?)?;
        Ok((ks.f_index_select(0, all)?, vs.f_index_select(0, all)?))
    }

    fn commit(&mut self, n: usize) {
        self.seq.len += n;
        self.new_slots = None;
        self.all_slots = None;
    }
}

/// Contiguous per-layer K/V, grown by concatenation. A test oracle only.
#[derive(Default)]
pub struct ContiguousCache {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    len: usize,
}

impl ContiguousCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        ContiguousCache {
            k: (0..layers).map(|_| None).collect(),
            v: (0..layers).map(|_| None).collect(),
            len: 0,
        }
    }
}

impl KvStore for ContiguousCache {
    fn len(&self) -> usize {
        self.len
    }
    fn prepare(&mut self, _n: usize) -> Result<()> {
        Ok(())
    }
    fn update(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
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
        Ok((k_all, v_all))
    }
    fn commit(&mut self, n: usize) {
        self.len += n;
    }
}
