//! Which segments of a conversation's context to keep, compress or drop.
//!
//! At the end of each turn a [`LifecyclePolicy`] sees the segments of a
//! sequence (position ranges tagged with the turn that produced them) and
//! names position ranges to drop. It only decides: the cache coordinator
//! drops the block-table entries lying wholly inside those ranges (their
//! positions stay, attention skips them) and releases their blocks.
//!
//! Pure Rust, no tensors, no tokenizer.
//!
//! # Implementations
//!
//! * [`RecentTurns`] — the seed's rule fallback in its simplest honest form:
//!   the first turn (system prompt and first exchange) and the last `keep`
//!   turns stay, older turns are dropped.
//!
//! [`labels`] parses the `[LIFECYCLE]` block a model appends to its reply
//! ([`parse_labels`]). Policies that act on those labels, delayed
//! reclamation and compression come with the lifecycle issue; every policy
//! must pass [`testing::check_policy`].

#![deny(missing_docs)]

pub mod labels;
pub mod testing;

pub use labels::{Label, Parsed, parse_labels};

use std::ops::Range;

/// Identifies one sequence to a policy that keeps per-sequence state.
pub type SeqKey = u64;

/// A bad policy configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// A parameter that cannot work.
    #[error("lifecycle policy: {0}")]
    Config(String),
}

/// `Result` with [`LifecycleError`].
pub type Result<T, E = LifecycleError> = std::result::Result<T, E>;

/// Consecutive positions of a sequence produced by one turn (its prompt
/// and its reply).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The positions.
    pub range: Range<u64>,
    /// The turn, counting from 0.
    pub turn: u32,
}

/// Names position ranges of a sequence to drop when a turn ends.
///
/// Contract (checked by [`testing::check_policy`]): the ranges appended to
/// `out` are non-empty, ascending, disjoint, inside the segments given, and
/// never touch the segments of the turn that just ended.
pub trait LifecyclePolicy: Send {
    /// A short name for reports.
    fn name(&self) -> String;

    /// Turn `segments.last().turn` of `seq` ended. `segments` tile the
    /// sequence's positions, oldest first.
    fn end_turn(&mut self, seq: SeqKey, segments: &[Segment], out: &mut Vec<Range<u64>>);

    /// The sequence ended: forget its state.
    fn forget(&mut self, seq: SeqKey) {
        let _ = seq;
    }
}

/// Keeps the first turn and the newest `keep` turns; drops the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecentTurns {
    keep: u32,
}

impl RecentTurns {
    /// Keeps the last `keep` turns (at least 1, the one that just ended).
    pub fn new(keep: u32) -> Result<Self> {
        if keep == 0 {
            return Err(LifecycleError::Config(
                "keep at least the turn that just ended".into(),
            ));
        }
        Ok(RecentTurns { keep })
    }
}

impl LifecyclePolicy for RecentTurns {
    fn name(&self) -> String {
        format!("recent-turns{}", self.keep)
    }

    fn end_turn(&mut self, _seq: SeqKey, segments: &[Segment], out: &mut Vec<Range<u64>>) {
        let Some(last) = segments.last().map(|s| s.turn) else {
            return;
        };
        let oldest_kept = (last + 1).saturating_sub(self.keep);
        for s in segments {
            if s.turn > 0 && s.turn < oldest_kept && !s.range.is_empty() {
                match out.last_mut() {
                    Some(r) if r.end == s.range.start => r.end = s.range.end,
                    _ => out.push(s.range.clone()),
                }
            }
        }
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
