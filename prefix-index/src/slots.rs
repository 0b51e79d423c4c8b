//! What both indexes do through their slot map (block slot → the handle
//! indexed there and where its entry lives): moving an entry to another
//! block, dropping stale epochs, checking an `extend`.

use std::collections::HashMap;

use crate::check::validate_insert;
use crate::error::{PrefixError, Result};
use crate::hash::KeyHash;
use crate::{BlockRef, PrefixMatcher};
use kvforge_pool::BlockId;

/// Block slot index -> (handle, place of the entry that holds it).
pub(crate) type SlotMap<P> = HashMap<u32, (BlockId, P), KeyHash>;

/// An index with a [`SlotMap`].
pub(crate) trait Slotted: PrefixMatcher {
    /// Where an entry lives (a key, a node).
    type Place: Copy;
    /// The slot map.
    fn slot_map(&mut self) -> &mut SlotMap<Self::Place>;
    /// The entry at `place` hands out `new` instead of `old`.
    fn repoint(&mut self, place: Self::Place, old: BlockId, new: BlockId);
}

/// [`PrefixMatcher::relocate`] for any [`Slotted`] index.
pub(crate) fn relocate<I: Slotted>(ix: &mut I, old: BlockId, new: BlockId) -> bool {
    let indexed =
        |ix: &mut I| matches!(ix.slot_map().get(&old.index()), Some(&(id, _)) if id == old);
    if old == new || !indexed(ix) {
        return false;
    }
    match ix.slot_map().get(&new.index()).copied() {
        Some((id, _)) if id.epoch() >= new.epoch() => return false,
        Some((id, _)) => {
            ix.forget(id);
        }
        None => {}
    }
    if !indexed(ix) {
        // Forgetting the stale `new` took `old` with it (it hung below).
        return false;
    }
    let Some((_, place)) = ix.slot_map().remove(&old.index()) else {
        return false;
    };
    ix.repoint(place, old, new);
    ix.slot_map().insert(new.index(), (new, place));
    true
}

/// Forgets the entries of slots that `blocks` hold at a newer epoch: the
/// pool handed them out again, their old content is gone.
pub(crate) fn forget_stale<I: Slotted>(ix: &mut I, blocks: &[BlockRef]) {
    for b in blocks {
        if let Some(&(old, _)) = ix.slot_map().get(&b.block.index()) {
            if old.epoch() < b.block.epoch() {
                ix.forget(old);
            }
        }
    }
}

/// The start of [`PrefixMatcher::extend`]: the checks of `insert` (and
/// `parent` not among `blocks`), stale epochs forgotten, then where
/// `parent`'s entry lives — `None` when it is not indexed (any more).
pub(crate) fn extend_from<I: Slotted>(
    ix: &mut I,
    parent: BlockId,
    tokens: &[u32],
    blocks: &[BlockRef],
) -> Result<Option<I::Place>> {
    validate_insert(tokens, blocks, ix.block_size())?;
    if let Some(b) = blocks.iter().find(|b| b.block.index() == parent.index()) {
        return Err(PrefixError::DuplicateBlock { block: b.block });
    }
    forget_stale(ix, blocks);
    Ok(match ix.slot_map().get(&parent.index()) {
        Some(&(id, place)) if id == parent => Some(place),
        _ => None,
    })
}
