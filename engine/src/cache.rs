//! KV storage: the paged cache over `kvforge-pool` blocks, and a contiguous
//! cache kept only as a test oracle.
//!
//! The paged cache owns one K and one V tensor per layer, shaped
//! `[max_blocks * block_size, kv_heads, head_dim]`: slot `b * block_size + o`
//! holds offset `o` of block index `b`. A [`Sequence`] is a block table; a
//! forward step writes its new K/V at the slots of its positions
//! (`index_copy_`) and reads every position back through the table
//! (`index_select`).

use std::sync::atomic::{AtomicU64, Ordering};

use kvforge_pool::{BlockAllocator, BlockId, BlockPool, KvLayout, PoolConfig, StorageFormat};
use kvforge_quant::BlockShape;
use tch::{Device, Kind, Tensor};

use crate::model::LlamaConfig;
use crate::tier::{ColdBlock, ColdTier, KvQuant};
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
    /// Makes room for `n` more positions (and, with a cold tier, first moves
    /// blocks that left the hot window); errors leave the stored positions
    /// unchanged — at most some older blocks have gone cold.
    fn prepare(&mut self, n: usize) -> Result<()>;
    /// Stores `k`, `v` (`[n, kv_heads, head_dim]`) for the prepared positions
    /// of `layer`; returns keys and values of all positions `[len + n, ..]`.
    fn update(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
    /// Marks the `n` prepared positions as stored.
    fn commit(&mut self, n: usize);
}

/// A sequence's block table in a [`PagedKvCache`].
///
/// Blocks may hold fewer than `block_size` tokens: a block reused from the
/// prefix cache that was sealed at a turn boundary, or the sequence's own
/// last block. Only that last block, when `open`, receives new tokens; blocks
/// shared with other sequences are never written.
///
/// With a cold tier, positions run `[sink blocks | cold | hot]`: the first
/// `KvQuant::sink` tokens stay in hot blocks, then `cold.len()` quantized
/// blocks, then the rest of the hot `blocks`.
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Hot blocks in position order (sink blocks, then those after the
    /// cold ones).
    pub blocks: Vec<BlockId>,
    /// Tokens held by each hot block.
    pub lens: Vec<u32>,
    /// Positions stored (cold and hot).
    pub len: usize,
    /// Whether the last block is this sequence's own and not full.
    pub open: bool,
    /// Quantized blocks that left the hot window, oldest first (full
    /// blocks only).
    pub cold: Vec<ColdBlock>,
}

impl Sequence {
    /// A sequence that starts with `blocks` (already holding KV, e.g. a
    /// prefix-cache hit) of the given lengths; new tokens go to new blocks.
    pub fn from_blocks(blocks: impl IntoIterator<Item = (BlockId, u32)>) -> Self {
        let (blocks, lens): (Vec<BlockId>, Vec<u32>) = blocks.into_iter().unzip();
        let len = lens.iter().map(|&l| l as usize).sum();
        Sequence {
            blocks,
            lens,
            len,
            open: false,
            cold: Vec::new(),
        }
    }

    /// Bytes held by the sequence's cold tier.
    pub fn cold_bytes(&self) -> u64 {
        self.cold.iter().map(ColdBlock::bytes).sum()
    }

    /// Stops writing into the last block: the next token starts a new one
    /// (a turn boundary, so the partial block can be cached and reused).
    pub fn seal(&mut self) {
        self.open = false;
    }

    /// The slot of every position, in order.
    fn slots(&self, block_size: usize) -> Vec<i64> {
        let mut v = Vec::with_capacity(self.len);
        for (b, &l) in self.blocks.iter().zip(&self.lens) {
            let base = b.index() as usize * block_size;
            v.extend((base..base + l as usize).map(|s| s as i64));
        }
        v
    }
}

/// Paged KV storage for one model over a `kvforge-pool` [`BlockPool`].
pub struct PagedKvCache {
    pool: BlockPool,
    reclaimed: std::sync::Mutex<Vec<BlockId>>,
    block_size: usize,
    shape: BlockShape,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    cold: Option<ColdTier>,
    cold_bytes: AtomicU64,
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
        if device == Device::Cpu {
            let need = layout.bytes_for_blocks(blocks as u64)?;
            if let Some(have) = available_memory() {
                if need > have {
                    return Err(EngineError::Request(format!(
                        "a KV cache of {max_tokens} tokens needs {} MiB, more than the {} MiB of memory available",
                        need >> 20,
                        have >> 20
                    )));
                }
            }
        }
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
            reclaimed: Default::default(),
            block_size,
            shape: BlockShape {
                tokens: block_size,
                heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
            },
            k,
            v,
            cold: None,
            cold_bytes: AtomicU64::new(0),
        })
    }

    /// Installs (or with `None` removes) the quantized cold tier. `spec` is
    /// checked against the block shape (group sizes, rotation, window).
    /// Errors, changing nothing, while any sequence holds blocks.
    pub fn set_cold_tier(&mut self, spec: Option<KvQuant>) -> Result<()> {
        let tier = spec.map(|s| ColdTier::new(s, self.shape)).transpose()?;
        if self.pool.stats().in_use > 0 || self.cold_bytes() > 0 {
            return Err(EngineError::Request(
                "the cold tier cannot change while sequences hold KV".into(),
            ));
        }
        self.cold = tier;
        Ok(())
    }

    /// The cold tier's configuration, if there is one.
    pub fn cold_tier(&self) -> Option<KvQuant> {
        self.cold.as_ref().map(ColdTier::spec)
    }

    /// Bytes held by the cold tiers of this cache's sequences.
    pub fn cold_bytes(&self) -> u64 {
        self.cold_bytes.load(Ordering::Relaxed)
    }

    /// Moves the oldest hot blocks of `seq` that have left the hot window
    /// into its cold tier and releases them. On error (a non-finite K/V
    /// value) the failing block stays hot and the sequence stays valid.
    fn demote(&self, seq: &mut Sequence) -> Result<()> {
        let Some(tier) = &self.cold else {
            return Ok(());
        };
        let bs = self.block_size;
        // Hot blocks before the cold ones: the attention sinks.
        let at = tier.sink_blocks();
        while seq.cold.len() < tier.cold_blocks(seq.len) {
            // Only full blocks go cold (a sealed partial block stays hot).
            let full = |i: usize| seq.lens.get(i).is_some_and(|&l| l as usize == bs);
            if !(0..=at).all(full) {
                break;
            }
            let b = seq.blocks[at];
            let block = tier.quantize(&self.k, &self.v, b.index() as usize * bs)?;
            self.pool.release(b)?;
            self.cold_bytes.fetch_add(block.bytes(), Ordering::Relaxed);
            seq.blocks.remove(at);
            seq.lens.remove(at);
            seq.cold.push(block);
        }
        Ok(())
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The block pool (ids, counts, bytes).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Hot-tier KV bytes held by sequences now (pool blocks in use).
    pub fn bytes_in_use(&self) -> u64 {
        self.pool.stats().in_use_bytes
    }

    /// Releases a sequence's blocks (tail first) and cold tier, and
    /// empties it.
    pub fn free(&self, seq: &mut Sequence) -> Result<()> {
        self.pool.release_sequence(&seq.blocks)?;
        self.cold_bytes
            .fetch_sub(seq.cold_bytes(), Ordering::Relaxed);
        *seq = Sequence::default();
        Ok(())
    }

    /// Old handles of cached blocks the pool reclaimed for this cache's
    /// allocations since the last call (for the prefix index to forget).
    pub fn take_reclaimed(&self) -> Vec<BlockId> {
        std::mem::take(&mut *self.reclaimed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A [`KvStore`] view of `seq` for one forward step.
    pub fn view<'a>(&'a self, seq: &'a mut Sequence) -> PagedSeq<'a> {
        PagedSeq {
            cache: self,
            seq,
            new_slots: None,
            all_slots: None,
            pending: None,
        }
    }
}

/// One sequence of a [`PagedKvCache`] seen as a [`KvStore`].
pub struct PagedSeq<'a> {
    cache: &'a PagedKvCache,
    seq: &'a mut Sequence,
    new_slots: Option<Tensor>,
    all_slots: Option<Tensor>,
    /// Prepared, not committed: tokens going into the open block, the new
    /// blocks, and how many tokens each new block receives.
    pending: Option<(usize, Vec<BlockId>, Vec<u32>)>,
}

impl KvStore for PagedSeq<'_> {
    fn len(&self) -> usize {
        self.seq.len
    }

    fn prepare(&mut self, n: usize) -> Result<()> {
        let c = self.cache;
        let bs = c.block_size;
        c.demote(self.seq)?;
        let seq = &*self.seq;
        let used = seq.lens.last().copied().unwrap_or(0) as usize;
        let room = if seq.open { bs - used } else { 0 };
        let need = n.saturating_sub(room).div_ceil(bs);
        let fresh = if need > 0 {
            let got = c.pool.allocate(need).ok_or_else(|| {
                let s = c.pool.stats();
                EngineError::CacheFull(format!(
                    "{need} more blocks of {bs} tokens needed, {} of {} free",
                    s.free(),
                    s.capacity
                ))
            })?;
            if !got.reclaimed.is_empty() {
                c.reclaimed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(got.reclaimed);
            }
            got.blocks
        } else {
            Vec::new()
        };
        // New positions: the rest of the open block, then the new blocks.
        let mut new = Vec::with_capacity(n);
        let in_open = n.min(room);
        if in_open > 0 {
            let b = seq.blocks[seq.blocks.len() - 1];
            let base = b.index() as usize * bs + used;
            new.extend((base..base + in_open).map(|s| s as i64));
        }
        let mut left = n - in_open;
        let mut extent = Vec::with_capacity(fresh.len());
        for b in &fresh {
            let take = left.min(bs);
            let base = b.index() as usize * bs;
            new.extend((base..base + take).map(|s| s as i64));
            extent.push(take as u32);
            left -= take;
        }
        let mut all = seq.slots(bs);
        all.extend_from_slice(&new);
        let device = c.k[0].device();
        self.new_slots = Some(Tensor::f_from_slice(&new)?.f_to_device(device)?);
        self.all_slots = Some(Tensor::f_from_slice(&all)?.f_to_device(device)?);
        self.pending = Some((in_open, fresh, extent));
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
        match &self.cache.cold {
            Some(tier) if !self.seq.cold.is_empty() => Ok((
                tier.assemble(&self.seq.cold, layer, false, &ks, all)?,
                tier.assemble(&self.seq.cold, layer, true, &vs, all)?,
            )),
            _ => Ok((ks.f_index_select(0, all)?, vs.f_index_select(0, all)?)),
        }
    }

    fn commit(&mut self, n: usize) {
        let seq = &mut *self.seq;
        if let Some((in_open, fresh, extent)) = self.pending.take() {
            if in_open > 0 {
                if let Some(last) = seq.lens.last_mut() {
                    *last += in_open as u32;
                }
            }
            seq.blocks.extend(fresh);
            seq.lens.extend(extent);
            let bs = self.cache.block_size;
            // Still open if it was and is not full, or a new block is partial.
            seq.open = seq.lens.last().is_some_and(|&l| (l as usize) < bs)
                && (in_open == n && seq.open || in_open < n);
        }
        seq.len += n;
        self.new_slots = None;
        self.all_slots = None;
    }
}

impl Drop for PagedSeq<'_> {
    /// A step prepared but not committed (the forward failed) gives its new
    /// blocks back: the sequence is as it was.
    fn drop(&mut self) {
        if let Some((_, fresh, _)) = self.pending.take() {
            let _ = self.cache.pool.release_sequence(&fresh);
        }
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

/// Memory the OS says is available (`MemAvailable` in `/proc/meminfo`), if
/// it says.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
