//! [`StepView`]: what one step of one layer attends over — the table's
//! live spans of hot and cold pages, as the backends read them.

use std::sync::Arc;

use kvforge_coordinator::{BlockTable, Entry, Slot, TieredPool};
use tch::{Device, Kind, Tensor};

use crate::error::{EngineError, Result};
use crate::tier::{ColdBlock, ColdTier};

use super::*;

/// What one step of one sequence attends over.
pub struct StepView {
    pub(super) runs: Vec<Run>,
    /// The live entries in order, with their table index.
    pub(crate) pages: Vec<(PageRef, usize)>,
    /// Live keys.
    pub(super) keys: i64,
    /// Position of the first query; queries are `start..start + n`.
    pub(super) start: i64,
    pub(super) n: i64,
    /// `[n, keys]` bool, true where a query may see a key; `None` when
    /// every key is visible to every query, or the keys are exactly the
    /// positions `0..start + n` from an empty start (plain causal).
    pub(super) mask: Option<Tensor>,
    pub(super) causal: bool,
    /// Per table entry, the live keys it holds (0 when dropped): to sum the
    /// attention mass per entry.
    pub(super) entry_keys: Vec<i64>,
    /// Per live key, its row of the table: `entry × block_size + row` (a
    /// token-level policy's signal is per row).
    pub(super) key_rows: Vec<u32>,
    pub(super) block_size: usize,
    /// On a GPU, with cold entries in the view: [`kernel_table`] on the
    /// device (an all-hot view's table is its one run of hot slots).
    pub(super) mixed_table: Option<Tensor>,
}

impl StepView {
    /// Resolves `table` (the planned table of the step, holding the `n`
    /// new tokens at its end) against the hot tensors' block size and the
    /// cold tier's storage.
    pub(crate) fn new(
        table: &BlockTable,
        n: usize,
        block_size: usize,
        cold: Option<&ColdTier>,
        device: Device,
    ) -> Result<Self> {
        let positions = table.positions() as i64;
        let (start, n) = (positions - n as i64, n as i64);
        let mut s = Spans::new(table, block_size, device);
        for e in table.entries() {
            s.entry(e, cold)?;
        }
        s.flush_hot()?;
        s.flush_cold();
        let keys: i64 = s.entry_keys.iter().sum();
        let causal = s.dense && start == 0 && n > 1;
        let mask = if n > 1 && !causal {
            let k = if s.dense {
                Tensor::f_arange(keys, (Kind::Int64, device))?
            } else {
                Tensor::f_from_slice(&s.key_pos)?.f_to_device(device)?
            };
            let q = Tensor::f_arange_start(start, start + n, (Kind::Int64, device))?;
            Some(k.f_unsqueeze(0)?.f_le_tensor(&q.f_unsqueeze(1)?)?)
        } else {
            None
        };
        let mixed_table = if device.is_cuda() && n == 1 && cold.is_some_and(ColdTier::mirrored) {
            let cold_pages = s
                .pages
                .iter()
                .any(|(p, _)| matches!(p, PageRef::Cold { .. }));
            cold_pages
                .then(|| {
                    Tensor::f_from_slice(&kernel_table(&s.pages, block_size))?.f_to_device(device)
                })
                .transpose()?
        } else {
            None
        };
        Ok(StepView {
            runs: s.runs,
            pages: s.pages,
            keys,
            start,
            n,
            mask,
            causal,
            entry_keys: s.entry_keys,
            key_rows: s.key_rows,
            block_size,
            mixed_table,
        })
    }

    /// The CUDA kernel's key table on the device ([`kernel_table`]): the
    /// one run of hot slots of an all-hot view, or the mixed table built
    /// for a view with cold entries on a GPU with a mirrored cold tier.
    pub(crate) fn device_table(&self) -> Option<&Tensor> {
        match self.runs.as_slice() {
            [Run::Hot { slots, .. }] => Some(slots),
            _ => self.mixed_table.as_ref(),
        }
    }

    /// The block size the table's rows count in.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Folds one value per live key (in position order) into one per row
    /// of the table (`entries × block_size`, row `r` of entry `i` at `i ×
    /// block_size + r`; 0 for rows not read): a token-level policy's input.
    pub fn per_row(&self, per_key: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.entry_keys.len() * self.block_size];
        for (&at, &x) in self.key_rows.iter().zip(per_key) {
            out[at as usize] += x;
        }
        out
    }

    /// Live keys attended over.
    pub fn keys(&self) -> usize {
        self.keys as usize
    }

    /// Position of the first query.
    pub fn start(&self) -> usize {
        self.start as usize
    }

    /// Entries of the step's table, dropped ones included.
    pub fn entries(&self) -> usize {
        self.entry_keys.len()
    }

    /// Queries of the step (`start()..start() + queries()`).
    pub fn queries(&self) -> usize {
        self.n as usize
    }

    /// Which keys each query may see: `[queries, keys]` bool, true where
    /// visible; `None` when every key is visible to every query, or when
    /// the view is plainly causal ([`is_causal`](Self::is_causal)).
    pub fn mask(&self) -> Option<&Tensor> {
        self.mask.as_ref()
    }

    /// Whether key `j` is visible to query `i` exactly when `j <= i` (the
    /// keys are the positions `0..` of a prompt run from the start).
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// Folds one value per live key (in position order) into one per table
    /// entry: their sum, or with `mean` their mean (0 for an entry without
    /// live keys).
    pub fn per_entry(&self, per_key: &[f32], mean: bool) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.entry_keys.len());
        let mut at = 0usize;
        for &len in &self.entry_keys {
            let len = len as usize;
            let sum: f32 = per_key[at..at + len].iter().sum();
            out.push(match (mean, len) {
                (false, _) => sum,
                (true, 0) => 0.0,
                (true, _) => sum / len as f32,
            });
            at += len;
        }
        out
    }

    /// One layer's K (or V, with `values`) of every live key, in position
    /// order: `[keys, kv_heads, head_dim]` in `kind` (cold blocks are
    /// dequantized straight into it, not rounded to the storage dtype;
    /// aliases read from their canonical block; holes and dropped entries
    /// left out).
    pub fn gather(
        &self,
        kv: &KvTensors<'_>,
        layer: usize,
        values: bool,
        kind: Kind,
    ) -> Result<Tensor> {
        let tensors = if values { kv.v } else { kv.k };
        let src = tensors
            .get(layer)
            .ok_or_else(|| EngineError::Request(format!("layer {layer} of {}", tensors.len())))?;
        if let [Run::Hot { slots, .. }] = self.runs.as_slice() {
            return Ok(src.f_index_select(0, slots)?.f_to_kind(kind)?);
        }
        let size = src.size();
        let out = Tensor::f_empty([self.keys, size[1], size[2]], (kind, src.device()))?;
        let mut at = 0;
        for run in &self.runs {
            match run {
                Run::Hot { slots, len } => {
                    let mut dst = out.f_narrow(0, at, *len)?;
                    if src.kind() == kind {
                        let _ = src.f_index_select_out(&dst, 0, slots)?;
                    } else {
                        dst.f_copy_(&src.f_index_select(0, slots)?)?;
                    }
                    at += len;
                }
                Run::Cold { blocks, len } => {
                    let tier = kv.cold.ok_or_else(|| {
                        EngineError::Torch("cold entries without a cold tier".into())
                    })?;
                    let mut dst = out.f_narrow(0, at, *len)?;
                    tier.dequantize_into(blocks, layer, values, &mut dst)?;
                    at += len;
                }
            }
        }
        Ok(out)
    }
}

/// A table resolved entry by entry into runs (hot slots, cold blocks),
/// pages per live entry, and per live key its row and (unless every
/// position is live) its position.
struct Spans {
    runs: Vec<Run>,
    hot: Vec<i64>,
    cold_run: Vec<Arc<ColdBlock>>,
    key_pos: Vec<i64>,
    entry_keys: Vec<i64>,
    pages: Vec<(PageRef, usize)>,
    key_rows: Vec<u32>,
    /// Every entry live and without holes: keys are positions `0..`.
    dense: bool,
    block_size: usize,
    device: Device,
}

impl Spans {
    fn new(table: &BlockTable, block_size: usize, device: Device) -> Self {
        Spans {
            runs: Vec::new(),
            hot: Vec::new(),
            cold_run: Vec::new(),
            key_pos: Vec::new(),
            entry_keys: Vec::with_capacity(table.entries().len()),
            pages: Vec::with_capacity(table.entries().len()),
            key_rows: Vec::new(),
            dense: table
                .entries()
                .iter()
                .all(|e| e.slot().is_live() && e.holes() == 0),
            block_size,
            device,
        }
    }

    /// Ends the current run of hot slots.
    fn flush_hot(&mut self) -> Result<()> {
        if !self.hot.is_empty() {
            let len = self.hot.len() as i64;
            let slots = Tensor::f_from_slice(&self.hot)?.f_to_device(self.device)?;
            self.runs.push(Run::Hot { slots, len });
            self.hot.clear();
        }
        Ok(())
    }

    /// Ends the current run of cold blocks.
    fn flush_cold(&mut self) {
        if !self.cold_run.is_empty() {
            let len = self.cold_run.len() as i64 * self.block_size as i64;
            self.runs.push(Run::Cold {
                blocks: std::mem::take(&mut self.cold_run),
                len,
            });
        }
    }

    /// One table entry.
    fn entry(&mut self, e: &Entry, cold: Option<&ColdTier>) -> Result<()> {
        let bs = self.block_size as i64;
        let first = e.first() as i64;
        let len = i64::from(e.tokens());
        let row0 = (self.entry_keys.len() * self.block_size) as u32;
        match e.slot() {
            Slot::Hot(b) if e.holes() != 0 => {
                // Token-level eviction: only the live rows, one page per
                // run of them.
                self.flush_cold();
                let base = i64::from(TieredPool::slot_of(b)) * bs;
                let live = |r: &i64| e.holes() >> r & 1 == 0;
                let rows: Vec<i64> = (0..len).filter(live).collect();
                for run in rows.chunk_by(|a, b| a + 1 == *b) {
                    let (slot, len) = ((base + run[0]) as usize, run.len());
                    self.pages
                        .push((PageRef::Hot { slot, len }, self.entry_keys.len()));
                }
                self.hot.extend(rows.iter().map(|r| base + r));
                self.key_rows.extend(rows.iter().map(|&r| row0 + r as u32));
                self.key_pos.extend(rows.iter().map(|r| first + r));
                self.entry_keys.push(rows.len() as i64);
                return Ok(());
            }
            Slot::Hot(b) => {
                self.flush_cold();
                let base = i64::from(TieredPool::slot_of(b)) * bs;
                self.hot.extend(base..base + len);
                let (slot, len) = (base as usize, len as usize);
                self.pages
                    .push((PageRef::Hot { slot, len }, self.entry_keys.len()));
            }
            Slot::Cold(b) | Slot::Alias { canonical: b } => {
                self.flush_hot()?;
                let slot = TieredPool::slot_of(b) as usize;
                let block = cold.and_then(|c| c.get(slot)).ok_or_else(|| {
                    EngineError::Torch(format!("cold block {b} has no stored content"))
                })?;
                let page = PageRef::Cold {
                    block: Arc::clone(&block),
                    slot,
                    len: len as usize,
                };
                self.pages.push((page, self.entry_keys.len()));
                self.cold_run.push(block);
            }
            Slot::Dropped => {
                self.entry_keys.push(0);
                return Ok(());
            }
        }
        self.entry_keys.push(len);
        self.key_rows.extend(row0..row0 + len as u32);
        if !self.dense {
            self.key_pos.extend(first..first + len);
        }
        Ok(())
    }
}
