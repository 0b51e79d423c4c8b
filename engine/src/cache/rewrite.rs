//! In-place rewrites of hot blocks a step plans: head-wise packing moves
//! each lane's pages, token-level compaction moves rows; both undo exactly
//! when the step is aborted.

use kvforge_coordinator::TieredPool;
use kvforge_pool::BlockId;
use tch::Tensor;

use crate::error::{EngineError, Result};

use super::*;

impl PagedKvCache {
    /// Head-wise eviction's copies: lane `layer × kv_heads + head` of each
    /// packed block takes the same lane's page of its source block — one
    /// gather and one scatter per layer and K/V over the rows seen as
    /// `[slots × kv_heads, head_dim]`.
    ///
    /// With `undo`, every page goes back where it came from (an in-place
    /// pack of a step that is aborted). A failure part-way undoes the
    /// layers an in-place pack had moved.
    pub(super) fn pack(&self, pack: &kvforge_coordinator::Pack, undo: bool) -> Result<()> {
        let (bs, h) = (self.block_size as i64, self.shape.heads as i64);
        let layers = self.k.len();
        if pack.lanes != layers * self.shape.heads || pack.src.len() != pack.dst.len() * pack.lanes
        {
            return Err(EngineError::Request(format!(
                "a pack of {} lanes for {} blocks does not fit {layers} layers of {h} KV heads",
                pack.lanes,
                pack.dst.len()
            )));
        }
        let device = self.k[0].device();
        let base = |b: BlockId| i64::from(TieredPool::slot_of(b)) * bs;
        let move_layer = |layer: usize, undo: bool| -> Result<()> {
            let (mut src, mut dst) = (Vec::new(), Vec::new());
            for (k, &to) in pack.dst.iter().enumerate() {
                for head in 0..h {
                    let from = pack.src[k * pack.lanes + layer * h as usize + head as usize];
                    for r in 0..bs {
                        src.push((base(from) + r) * h + head);
                        dst.push((base(to) + r) * h + head);
                    }
                }
            }
            if undo {
                std::mem::swap(&mut src, &mut dst);
            }
            let src = Tensor::f_from_slice(&src)?.f_to_device(device)?;
            let dst = Tensor::f_from_slice(&dst)?.f_to_device(device)?;
            // Every source page is read before any is written.
            let hd = self.shape.head_dim as i64;
            let rows = [
                self.k[layer].f_view([-1, hd])?,
                self.v[layer].f_view([-1, hd])?,
            ];
            let pages = [
                rows[0].f_index_select(0, &src)?,
                rows[1].f_index_select(0, &src)?,
            ];
            for (r, p) in rows.iter().zip(&pages) {
                let _ = r.shallow_clone().f_index_copy_(0, &dst, p)?;
            }
            Ok(())
        };
        for layer in 0..layers {
            if let Err(e) = move_layer(layer, undo) {
                if pack.in_place && !undo {
                    for done in 0..layer {
                        let _ = move_layer(done, true);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Carries out token-level eviction's compaction: row `r` of block
    /// `dst[k]` takes the row `src[k × block_size + r]` names, in every
    /// layer's K and V (all sources read before any destination is
    /// written). With `undo`, every row goes back where it came from (an
    /// in-place compaction of a step that is aborted); a failure part-way
    /// through an in-place one undoes the layers already done.
    pub(super) fn move_rows(&self, rows: &kvforge_coordinator::RowPack, undo: bool) -> Result<()> {
        let bs = self.block_size as i64;
        if rows.block_size as i64 != bs || rows.src.len() != rows.dst.len() * bs as usize {
            return Err(EngineError::Request(format!(
                "a compaction of {} rows into {} blocks of {} does not fit blocks of {bs}",
                rows.src.len(),
                rows.dst.len(),
                rows.block_size
            )));
        }
        let base = |b: BlockId| i64::from(TieredPool::slot_of(b)) * bs;
        let mut src: Vec<i64> = rows
            .src
            .iter()
            .map(|&(b, r)| base(b) + i64::from(r))
            .collect();
        let mut dst: Vec<i64> = rows
            .dst
            .iter()
            .flat_map(|&b| (0..bs).map(move |r| base(b) + r))
            .collect();
        if undo {
            std::mem::swap(&mut src, &mut dst);
        }
        let device = self.k[0].device();
        let src = Tensor::f_from_slice(&src)?.f_to_device(device)?;
        let dst = Tensor::f_from_slice(&dst)?.f_to_device(device)?;
        let move_one = |t: &Tensor, from: &Tensor, to: &Tensor| -> Result<()> {
            let moved = t.f_index_select(0, from)?;
            let _ = t.shallow_clone().f_index_copy_(0, to, &moved)?;
            Ok(())
        };
        let tensors: Vec<&Tensor> = self.k.iter().chain(&self.v).collect();
        for (done, t) in tensors.iter().enumerate() {
            if let Err(e) = move_one(t, &src, &dst) {
                if rows.in_place && !undo {
                    for back in &tensors[..done] {
                        let _ = move_one(back, &dst, &src);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }
}
