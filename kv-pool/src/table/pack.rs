//! The entries token-level and head-wise eviction change in place: holes
//! punched in full hot blocks, and blocks repacked with kept rows or pages.

use super::{BlockTable, Entry, MAX_HOLED_BLOCK, Slot, invalid, rows_mask};
use crate::BlockId;
use crate::error::Result;

impl BlockTable {
    /// Marks rows `rows` (bit `r` for row `r`) of entry `i` invalid
    /// (token-level eviction): attention skips them, the block stays until
    /// the coordinator compacts the live rows of such entries into fewer
    /// blocks. Entry `i` must be a full, closed, hot block of at most
    /// [`MAX_HOLED_BLOCK`] tokens; the rows must exist, not already be
    /// holes, and leave at least one live row (drop the entry instead).
    pub fn punch(&mut self, i: usize, rows: u64) -> Result<()> {
        let all = rows_mask(self.block_size);
        let e = self.holeable(i)?;
        if rows == 0 || rows & !all != 0 || rows & e.holes != 0 || (rows | e.holes) == all {
            return Err(invalid(format!(
                "rows {rows:#x} of entry {i} (holes {:#x}) are not live rows that leave one live",
                e.holes
            )));
        }
        e.holes |= rows;
        Ok(())
    }

    /// [`punch`](Self::punch), except that rows naming every live row of
    /// entry `i` drop it (token-level eviction took its last tokens):
    /// returns the old slot then, whose reference the caller now owns.
    pub fn punch_or_drop(&mut self, i: usize, rows: u64) -> Result<Option<Slot>> {
        let all = rows_mask(self.block_size);
        let holes = self.holeable(i)?.holes;
        if rows & !all == 0 && rows & holes == 0 && rows | holes == all {
            return self.set_slot(i, Slot::Dropped).map(Some);
        }
        self.punch(i, rows).map(|()| None)
    }

    /// Entry `i`, if it may hold holes: a full, closed hot block of at
    /// most [`MAX_HOLED_BLOCK`] tokens.
    fn holeable(&mut self, i: usize) -> Result<&mut Entry> {
        let last = self.entries.len().checked_sub(1);
        let open = self.open && Some(i) == last;
        let bs = self.block_size;
        let Some(e) = self.entries.get_mut(i) else {
            return Err(invalid(format!("entry {i} does not exist")));
        };
        if !matches!(e.slot, Slot::Hot(_)) || e.tokens != bs || open || bs > MAX_HOLED_BLOCK {
            return Err(invalid(format!(
                "entry {i} ({:?}, {} tokens of {bs}) is not a full, closed hot block of at most {MAX_HOLED_BLOCK} tokens",
                e.slot, e.tokens
            )));
        }
        Ok(e)
    }

    /// Gives the full, closed hot entry `i` another hot block into which
    /// the caller compacted live rows of this and other entries, `holes`
    /// marking the rows of it that hold nothing to read (the tail of the
    /// last compacted block); the entry is marked packed. Returns the old
    /// slot, whose reference the caller now owns.
    pub fn repack_rows(&mut self, i: usize, block: BlockId, holes: u64) -> Result<Slot> {
        let all = rows_mask(self.block_size);
        if self.block_size > MAX_HOLED_BLOCK || holes & !all != 0 || holes == all {
            return Err(invalid(format!(
                "holes {holes:#x} do not fit a block of {} tokens with one live row",
                self.block_size
            )));
        }
        let old = self.repack(i, block)?;
        if let Some(e) = self.entries.get_mut(i) {
            e.holes = holes;
        }
        Ok(old)
    }

    /// Gives the full, closed, hot entry `i` another hot block whose lanes
    /// the caller filled with pages of this and other entries (head-wise
    /// eviction packs the pages each lane keeps into fewer blocks); the
    /// entry is marked packed. Returns the old slot, whose reference the
    /// caller now owns.
    pub fn repack(&mut self, i: usize, block: BlockId) -> Result<Slot> {
        let last = self.entries.len().checked_sub(1);
        let open = self.open && Some(i) == last;
        let bs = self.block_size;
        match self.entries.get_mut(i) {
            Some(e) if matches!(e.slot, Slot::Hot(_)) && e.tokens == bs && !open => {
                e.packed = true;
                Ok(std::mem::replace(&mut e.slot, Slot::Hot(block)))
            }
            Some(e) => Err(invalid(format!(
                "entry {i} ({:?}, {} tokens) is not a full, closed hot block and cannot be packed",
                e.slot, e.tokens
            ))),
            None => Err(invalid(format!("entry {i} does not exist"))),
        }
    }
}
