//! The conformance suite every [`PrefixMatcher`] must pass.
//!
//! ```
//! use kvforge_prefix::{testing, HashChainIndex, RadixIndex};
//! testing::check_matcher(|bs| HashChainIndex::with_seed(bs, 1).unwrap());
//! testing::check_matcher(|bs| RadixIndex::new(bs).unwrap());
//! ```
//!
//! `make(block_size)` must return an empty index. The suite panics on the
//! first violated property, so call it from a `#[test]`.

mod handles;
mod insert;
mod matching;

use crate::{BlockRef, PrefixMatch, PrefixMatcher};
use kvforge_pool::BlockId;

/// Runs every conformance check against indexes built by `make`.
pub fn check_matcher<M: PrefixMatcher>(make: impl Fn(usize) -> M) {
    matching::empty_index_matches_nothing(make(4));
    matching::full_blocks_match_and_partial_tails_do_not(make(4));
    matching::lookup_stops_at_the_first_miss(make(4));
    matching::namespaces_and_adapters_never_share(make(4));
    handles::forgotten_blocks_end_the_match(make(4));
    handles::reinsertion_after_forget_is_reachable_again(make(4));
    matching::sealed_blocks_hit_on_the_next_turn(make(4));
    insert::duplicates_keep_the_first_block(make(4));
    handles::a_reused_slot_replaces_its_old_content(make(4));
    insert::bad_insertions_are_errors_and_change_nothing(make(4));
    insert::block_size_one_works(make(1));
    handles::a_handle_is_indexed_at_most_once(make(4));
    handles::a_stale_handle_never_replaces_a_newer_one(make(4));
    handles::forget_removes_the_subtree_and_counts_agree(make(4));
    insert::empty_namespaces_leave_nothing_behind(make(4));
    matching::the_longest_path_wins_when_sealed_and_full_blocks_compete(make(8));
    matching::equal_paths_prefer_full_blocks(make(4));
    handles::relocated_blocks_keep_their_place_and_subtree(make(4));
    insert::extend_continues_below_a_block_for_the_cost_of_the_new_tokens(make(4));
    insert::extend_refuses_an_unknown_stale_or_misplaced_parent(make(4));
    matching::a_peek_matches_and_counts_nothing(make(4));
}

/// A handle for tests: slot `i`, epoch `e`.
pub fn block(i: u32) -> BlockId {
    BlockId::new(i, 1)
}

/// Block `i` holding a full block of 4 tokens.
fn full(i: u32) -> BlockRef {
    BlockRef::new(block(i), 4)
}

/// Full blocks `first..first + n` of size `bs`.
pub fn full_blocks(first: u32, n: usize, bs: usize) -> Vec<BlockRef> {
    (0..n as u32)
        .map(|i| BlockRef::new(block(first + i), bs as u32))
        .collect()
}

fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

fn ids(m: &PrefixMatch) -> Vec<BlockId> {
    m.blocks.iter().map(|b| b.block).collect()
}
