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

mod pack;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

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
