//! [`BlockTable`]: one sequence's positions mapped to typed entries.
//!
//! Every mechanism of kvforge reads and changes a sequence through this one
//! type: the prefix index fills its start, the tier policy turns hot entries
//! cold, a deduplicator turns cold ones into aliases, eviction and lifecycle
//! policies drop entries. An entry covers `tokens` consecutive positions
//! starting at `first`; positions never move, so a dropped entry keeps the
//! positions of the tokens after it (attention skips it, RoPE positions of
//! later keys stay those they were computed at).
//!
//! The fields are private: the methods keep the invariants below, and policy
//! code only ever sees `&BlockTable`.
//!
//! # Invariants
//!
//! * Entries tile `0..positions()` in order: entry `i` starts where entry
//!   `i - 1` ends; each covers `1..=block_size` tokens.
//! * Only the last entry can be open (receive more tokens), and only while
//!   it is hot and not full.
//! * A dropped entry never becomes anything else.
//! * A packed entry (head-wise eviction, [`BlockTable::repack`]) is full;
//!   each lane (one layer's one KV head) of its block holds a page of
//!   some position range inside the entries the pack replaced, not
//!   necessarily its own: its tokens are attended to, never matched
//!   against token ids. Token-level eviction packs rows the same way
//!   ([`BlockTable::repack_rows`]), all lanes alike.
//! * Holes ([`Entry::holes`], rows token-level eviction marked invalid)
//!   exist only in full hot entries of at most [`MAX_HOLED_BLOCK`] tokens,
//!   never cover every row, and keep the entry hot until it is dropped.

use crate::BlockId;
use crate::error::{PoolError, Result};

/// Where an entry's K/V lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// A block of the hot pool, in the KV dtype.
    Hot(BlockId),
    /// A quantized block of a cold pool.
    Cold(BlockId),
    /// Content close enough to a canonical cold block to be read from it
    /// (LSH sharing); holds a reference on `canonical`.
    Alias {
        /// The cold block read in this entry's place.
        canonical: BlockId,
    },
    /// Evicted or dropped by a lifecycle policy: no storage, skipped by
    /// attention; the positions stay.
    Dropped,
}

impl Slot {
    /// The block this entry holds a reference on, if any.
    pub const fn block(self) -> Option<BlockId> {
        match self {
            Slot::Hot(b) | Slot::Cold(b) | Slot::Alias { canonical: b } => Some(b),
            Slot::Dropped => None,
        }
    }

    /// Whether attention reads this entry.
    pub const fn is_live(self) -> bool {
        !matches!(self, Slot::Dropped)
    }
}

/// One entry of a [`BlockTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    slot: Slot,
    first: u64,
    tokens: u32,
    packed: bool,
    /// Rows (token offsets) marked invalid by token-level eviction, bit
    /// `r` for row `r`.
    holes: u64,
}

impl Entry {
    /// Where the K/V lives.
    pub const fn slot(&self) -> Slot {
        self.slot
    }
    /// Position of the entry's first token.
    pub const fn first(&self) -> u64 {
        self.first
    }
    /// Tokens covered.
    pub const fn tokens(&self) -> u32 {
        self.tokens
    }
    /// One past the entry's last position.
    pub const fn end(&self) -> u64 {
        self.first + self.tokens as u64
    }
    /// Whether its block was packed by head-wise eviction: each lane holds
    /// a page of another position of the packed range, so its content is
    /// not that of the token ids at its positions.
    pub const fn is_packed(&self) -> bool {
        self.packed
    }
    /// Rows (token offsets in the block) that token-level eviction marked
    /// invalid, bit `r` for row `r`: attention skips them.
    pub const fn holes(&self) -> u64 {
        self.holes
    }
    /// Tokens attention reads: 0 when dropped, else `tokens` less the
    /// holes.
    pub const fn live(&self) -> u32 {
        match self.slot {
            Slot::Dropped => 0,
            _ => self.tokens - self.holes.count_ones(),
        }
    }
}

/// The most tokens a block can have for token-level eviction (one bit per
/// row in [`Entry::holes`]).
pub const MAX_HOLED_BLOCK: u32 = 64;

/// Bits for rows `0..n` (`n <= 64`).
const fn rows_mask(n: u32) -> u64 {
    if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }
}

/// A sequence's block table: typed entries over its positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTable {
    entries: Vec<Entry>,
    block_size: u32,
    open: bool,
}

impl BlockTable {
    /// An empty table for blocks of `block_size` tokens.
    pub fn new(block_size: u32) -> Result<Self> {
        if block_size == 0 {
            return Err(PoolError::ZeroDimension {
                field: "block_size",
            });
        }
        Ok(BlockTable {
            entries: Vec::new(),
            block_size,
            open: false,
        })
    }

    /// Tokens per full block.
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The entries in position order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Positions covered (the next token's position), dropped ones included.
    pub fn positions(&self) -> u64 {
        self.entries.last().map_or(0, Entry::end)
    }

    /// Positions attention reads (not dropped, not holes).
    pub fn live_tokens(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.live())).sum()
    }

    /// Whether the last entry receives the next tokens.
    pub const fn is_open(&self) -> bool {
        self.open
    }

    /// Free room in the open last entry (0 when sealed).
    pub fn room(&self) -> u32 {
        match (self.open, self.entries.last()) {
            (true, Some(e)) => self.block_size - e.tokens,
            _ => 0,
        }
    }

    /// Every block the table holds a reference on, in position order (a
    /// block listed twice holds two references).
    pub fn held(&self) -> impl DoubleEndedIterator<Item = BlockId> + '_ {
        self.entries.iter().filter_map(|e| e.slot.block())
    }

    /// Appends an entry of `tokens` tokens after the last one. `open` lets
    /// it receive more tokens later (a hot, not full block only). The table
    /// takes over the caller's reference on the slot's block.
    pub fn push(&mut self, slot: Slot, tokens: u32, open: bool) -> Result<()> {
        if tokens == 0 || tokens > self.block_size {
            return Err(invalid(format!(
                "an entry holds 1..={} tokens, not {tokens}",
                self.block_size
            )));
        }
        if open && (!matches!(slot, Slot::Hot(_)) || tokens == self.block_size) {
            return Err(invalid(
                "only a hot block with room can stay open".to_string(),
            ));
        }
        let first = self.positions();
        self.entries.push(Entry {
            slot,
            first,
            tokens,
            packed: false,
            holes: 0,
        });
        self.open = open;
        Ok(())
    }

    /// Adds `n` tokens to the open last entry; it closes when full.
    pub fn fill(&mut self, n: u32) -> Result<()> {
        if n == 0 || n > self.room() {
            return Err(invalid(format!(
                "{n} tokens do not fit the {} left in the open entry",
                self.room()
            )));
        }
        if let Some(e) = self.entries.last_mut() {
            e.tokens += n;
            self.open = e.tokens < self.block_size;
        }
        Ok(())
    }

    /// Stops writing into the last entry: the next token starts a new one.
    pub fn seal(&mut self) {
        self.open = false;
    }

    /// Replaces entry `i`'s storage, returning the old slot (whose reference
    /// the caller now owns; the table takes over the new one). A dropped
    /// entry stays dropped; the open entry can only be dropped with the
    /// table sealed first, and a slot can only change to one of the same
    /// kind of content (hot → cold/alias, cold → alias/cold, any → dropped).
    pub fn set_slot(&mut self, i: usize, slot: Slot) -> Result<Slot> {
        let last = self.entries.len().checked_sub(1);
        let open = self.open && Some(i) == last;
        let Some(e) = self.entries.get_mut(i) else {
            return Err(invalid(format!("entry {i} does not exist")));
        };
        let ok = match (e.slot, slot) {
            (Slot::Dropped, _) => false,
            (_, Slot::Dropped) => !open,
            (Slot::Hot(_), Slot::Cold(_) | Slot::Alias { .. }) => {
                !open && e.tokens == self.block_size && e.holes == 0
            }
            (Slot::Cold(_) | Slot::Alias { .. }, Slot::Cold(_) | Slot::Alias { .. }) => true,
            _ => false,
        };
        if !ok {
            return Err(invalid(format!(
                "entry {i} cannot change from {:?} to {slot:?}",
                e.slot
            )));
        }
        if slot == Slot::Dropped {
            e.packed = false;
            e.holes = 0;
        }
        Ok(std::mem::replace(&mut e.slot, slot))
    }

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

    /// Gives the sealed, partial last entry a block of its own that takes
    /// more tokens (copy-on-partial-reuse: the caller copied the entry's
    /// tokens from the shared block into `block`). Returns the old slot,
    /// whose reference the caller now owns.
    pub fn reopen_tail(&mut self, block: BlockId) -> Result<Slot> {
        let bs = self.block_size;
        match self.entries.last_mut() {
            Some(e) if !self.open && matches!(e.slot, Slot::Hot(_)) && e.tokens < bs => {
                self.open = true;
                Ok(std::mem::replace(&mut e.slot, Slot::Hot(block)))
            }
            _ => Err(invalid(
                "only a sealed, partial, hot last entry can be reopened".into(),
            )),
        }
    }

    /// Merges runs of adjacent dropped entries into one entry per block
    /// boundary run (positions unchanged), so a long-evicting sequence's
    /// table does not grow with what it forgot. Returns the entries removed.
    pub fn compact(&mut self) -> usize {
        let before = self.entries.len();
        let mut out: Vec<Entry> = Vec::with_capacity(before);
        for e in self.entries.drain(..) {
            match out.last_mut() {
                Some(p)
                    if p.slot == Slot::Dropped
                        && e.slot == Slot::Dropped
                        && u64::from(p.tokens) + u64::from(e.tokens) <= u64::from(u32::MAX) =>
                {
                    p.tokens += e.tokens;
                }
                _ => out.push(e),
            }
        }
        self.entries = out;
        before - self.entries.len()
    }

    /// Empties the table, returning the blocks it held in position order
    /// (release them tail first, as `release_sequence` does).
    pub fn clear(&mut self) -> Vec<BlockId> {
        let held: Vec<BlockId> = self.held().collect();
        self.entries.clear();
        self.open = false;
        held
    }

    /// Checks every invariant (for tests and debug assertions).
    pub fn check(&self) -> Result<()> {
        let mut pos = 0;
        for (i, e) in self.entries.iter().enumerate() {
            let merged_drop = e.slot == Slot::Dropped;
            if e.first != pos || e.tokens == 0 || (e.tokens > self.block_size && !merged_drop) {
                return Err(invalid(format!("entry {i} breaks the tiling: {e:?}")));
            }
            let holed_ok = e.holes == 0
                || (matches!(e.slot, Slot::Hot(_))
                    && e.tokens == self.block_size
                    && self.block_size <= MAX_HOLED_BLOCK
                    && e.holes & !rows_mask(e.tokens) == 0
                    && e.holes != rows_mask(e.tokens));
            if !holed_ok {
                return Err(invalid(format!("entry {i} has impossible holes: {e:?}")));
            }
            if e.packed && (merged_drop || e.tokens != self.block_size) {
                return Err(invalid(format!(
                    "packed entry {i} is not a full block: {e:?}"
                )));
            }
            pos = e.end();
        }
        if self.open {
            match self.entries.last() {
                Some(e) if matches!(e.slot, Slot::Hot(_)) && e.tokens < self.block_size => {}
                _ => return Err(invalid("open table without an open hot entry".into())),
            }
        }
        Ok(())
    }
}

fn invalid(reason: String) -> PoolError {
    PoolError::InvalidTable { reason }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn b(i: u32) -> BlockId {
        BlockId::new(i, 1)
    }

    #[test]
    fn positions_survive_drops_and_compaction() {
        let mut t = BlockTable::new(4).unwrap();
        for i in 0..4 {
            t.push(Slot::Hot(b(i)), 4, false).unwrap();
        }
        t.push(Slot::Hot(b(9)), 2, true).unwrap();
        assert_eq!(t.positions(), 18);
        assert_eq!(t.set_slot(1, Slot::Dropped).unwrap(), Slot::Hot(b(1)));
        assert_eq!(t.set_slot(2, Slot::Dropped).unwrap(), Slot::Hot(b(2)));
        assert_eq!(t.compact(), 1);
        t.check().unwrap();
        assert_eq!(t.positions(), 18);
        assert_eq!(t.live_tokens(), 10);
        assert_eq!(t.entries()[1].first(), 4);
        assert_eq!(t.entries()[1].tokens(), 8);
        assert_eq!(t.entries()[2].first(), 12);
        t.fill(2).unwrap();
        assert!(!t.is_open());
        assert_eq!(t.held().collect::<Vec<_>>(), vec![b(0), b(3), b(9)]);
    }

    #[test]
    fn a_sealed_partial_tail_reopens_in_a_block_of_its_own() {
        let mut t = BlockTable::new(4).unwrap();
        t.push(Slot::Hot(b(0)), 4, false).unwrap();
        assert!(t.reopen_tail(b(5)).is_err(), "full");
        t.push(Slot::Hot(b(1)), 3, false).unwrap();
        assert_eq!(t.reopen_tail(b(5)).unwrap(), Slot::Hot(b(1)));
        assert!(t.is_open());
        assert!(t.reopen_tail(b(6)).is_err(), "already open");
        t.fill(1).unwrap();
        assert_eq!(t.held().collect::<Vec<_>>(), vec![b(0), b(5)]);
        t.check().unwrap();
    }

    #[test]
    fn packing_keeps_positions_and_only_takes_full_closed_hot_entries() {
        let mut t = BlockTable::new(4).unwrap();
        t.push(Slot::Hot(b(0)), 4, false).unwrap();
        t.push(Slot::Cold(b(1)), 4, false).unwrap();
        t.push(Slot::Hot(b(2)), 4, false).unwrap();
        t.push(Slot::Hot(b(3)), 2, true).unwrap();
        let before = t.clone();
        assert!(t.repack(1, b(9)).is_err(), "cold");
        assert!(t.repack(3, b(9)).is_err(), "open, partial");
        assert!(t.repack(4, b(9)).is_err(), "absent");
        assert_eq!(t, before);
        assert_eq!(t.repack(0, b(8)).unwrap(), Slot::Hot(b(0)));
        assert_eq!(t.repack(2, b(9)).unwrap(), Slot::Hot(b(2)));
        assert!(t.entries()[0].is_packed() && !t.entries()[1].is_packed());
        assert_eq!(t.positions(), 14);
        t.check().unwrap();
        // A packed entry goes cold packed; dropped, it is no longer packed.
        t.set_slot(0, Slot::Cold(b(5))).unwrap();
        assert!(t.entries()[0].is_packed());
        t.set_slot(2, Slot::Dropped).unwrap();
        assert!(!t.entries()[2].is_packed());
        t.check().unwrap();
    }

    #[test]
    fn holes_are_rows_of_full_closed_hot_blocks_and_leave_one_live() {
        let mut t = BlockTable::new(4).unwrap();
        t.push(Slot::Hot(b(0)), 4, false).unwrap();
        t.push(Slot::Cold(b(1)), 4, false).unwrap();
        t.push(Slot::Hot(b(2)), 4, false).unwrap();
        t.push(Slot::Hot(b(3)), 2, true).unwrap();
        let before = t.clone();
        assert!(t.punch(1, 0b1).is_err(), "cold");
        assert!(t.punch(3, 0b1).is_err(), "open, partial");
        assert!(t.punch(0, 0).is_err(), "no rows");
        assert!(t.punch(0, 0b1_0000).is_err(), "row 4 of 4");
        assert!(t.punch(0, 0b1111).is_err(), "every row: drop it instead");
        assert!(t.punch(9, 0b1).is_err(), "absent");
        assert_eq!(t, before);
        t.punch(0, 0b0101).unwrap();
        assert!(t.punch(0, 0b0001).is_err(), "already a hole");
        assert!(t.punch(0, 0b1010).is_err(), "would leave nothing");
        // The same rows through punch_or_drop drop the entry instead; an
        // entry that may not hold holes is refused either way.
        let mut u = t.clone();
        assert!(u.punch_or_drop(1, 0b1111).is_err(), "cold");
        assert!(u.punch_or_drop(0, 0b1011).is_err(), "a hole named again");
        assert_eq!(u, t);
        assert_eq!(u.punch_or_drop(0, 0b1010).unwrap(), Some(Slot::Hot(b(0))));
        assert_eq!(u.entries()[0].slot(), Slot::Dropped);
        assert_eq!(u.punch_or_drop(2, 0b0001).unwrap(), None);
        assert_eq!(u.entries()[2].holes(), 0b0001);
        u.check().unwrap();
        assert_eq!((t.entries()[0].holes(), t.entries()[0].live()), (0b0101, 2));
        assert_eq!(t.live_tokens(), 2 + 4 + 4 + 2);
        assert_eq!(t.positions(), 14, "positions stay");
        t.check().unwrap();
        // A holed entry does not go cold; dropped, its holes go with it.
        assert!(t.set_slot(0, Slot::Cold(b(7))).is_err());
        assert_eq!(t.set_slot(0, Slot::Dropped).unwrap(), Slot::Hot(b(0)));
        assert_eq!((t.entries()[0].holes(), t.entries()[0].live()), (0, 0));
        // Compacted rows: a packed block whose tail holds nothing.
        assert!(t.repack_rows(2, b(8), 0b1111).is_err(), "nothing live");
        assert_eq!(t.repack_rows(2, b(8), 0b1100).unwrap(), Slot::Hot(b(2)));
        assert!(t.entries()[2].is_packed());
        assert_eq!(t.live_tokens(), 4 + 2 + 2);
        t.check().unwrap();
        // Blocks over 64 tokens have no hole bits.
        let mut big = BlockTable::new(128).unwrap();
        big.push(Slot::Hot(b(0)), 128, false).unwrap();
        assert!(big.punch(0, 1).is_err());
    }

    #[test]
    fn illegal_changes_are_refused_and_change_nothing() {
        let mut t = BlockTable::new(4).unwrap();
        t.push(Slot::Hot(b(0)), 4, false).unwrap();
        t.push(Slot::Hot(b(1)), 3, true).unwrap();
        let before = t.clone();
        assert!(t.push(Slot::Hot(b(2)), 0, false).is_err());
        assert!(t.push(Slot::Hot(b(2)), 5, false).is_err());
        assert!(t.push(Slot::Cold(b(2)), 2, true).is_err());
        assert!(t.fill(2).is_err());
        // The open entry and partial blocks cannot go cold; the open one
        // cannot be dropped.
        assert!(t.set_slot(1, Slot::Cold(b(5))).is_err());
        assert!(t.set_slot(1, Slot::Dropped).is_err());
        assert!(t.set_slot(7, Slot::Dropped).is_err());
        assert_eq!(t, before);
        t.set_slot(0, Slot::Dropped).unwrap();
        assert!(t.set_slot(0, Slot::Hot(b(0))).is_err());
        assert!(t.set_slot(0, Slot::Cold(b(0))).is_err());
        t.check().unwrap();
        assert!(BlockTable::new(0).is_err());
    }
}
