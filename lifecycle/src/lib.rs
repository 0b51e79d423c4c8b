//! Which segments of a conversation's context to keep, compress or drop,
//! and when their KV is given back.
//!
//! A turn's positions are cut into semantic [`segment`]s (sentences and
//! paragraphs). At the end of each turn a [`LifecyclePolicy`] labels the
//! live segments `keep`, `compress` or `drop`; a [`Lifecycle`] puts dropped
//! segments in a pending queue for K rounds, revives one that a later turn
//! refers to again, and names the position ranges whose KV is freed now and
//! the segments to summarise. It only decides: the cache coordinator drops
//! the block-table entries lying wholly inside those ranges (their positions
//! stay, attention skips them) and releases their blocks.
//!
//! Pure Rust, no tensors, no tokenizer.
//!
//! # Policies
//!
//! * [`RuleFallback`] — the seed's rule: the last `protect` rounds (and the
//!   first, the system prompt) keep; older segments are dropped, or
//!   compressed when they are at least `compress_min` tokens long.
//! * [`ModelLabels`] — the labels the model gives each turn's segments in
//!   a `[LIFECYCLE]` block, decoded freely ([`LabelSource::Free`]) or under
//!   the label grammar ([`LabelSource::Constrained`], so the block always
//!   parses); the rule decides wherever the model's block is missing or
//!   unusable.
//! * [`RecentTurns`] — whole turns: the first and the newest `keep` stay.
//!
//! Every policy must pass [`testing::check_policy`].

#![deny(missing_docs)]

pub mod labels;
mod lifecycle;
pub mod segment;
pub mod testing;

pub use labels::{Label, LabelGrammar, Parsed, Viability, parse_labels};
pub use lifecycle::{Lifecycle, LifecycleParams, Outcome, TurnEnd};
pub use segment::split_sentences;

use std::collections::HashMap;
use std::ops::Range;

/// Identifies one sequence to a policy that keeps per-sequence state.
pub type SeqKey = u64;

/// A bad policy configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// A parameter that cannot work.
    #[error("lifecycle policy: {0}")]
    Config(String),
    /// A call the lifecycle's state rules out (an answer for a segment
    /// that was never handed out for summarising).
    #[error("lifecycle: {0}")]
    Order(String),
}

/// `Result` with [`LifecycleError`].
pub type Result<T, E = LifecycleError> = std::result::Result<T, E>;

/// Consecutive positions of a sequence: one sentence or paragraph of a
/// turn (or the whole turn, when the caller does not cut it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Unique in its sequence, ascending with the positions.
    pub id: u32,
    /// The positions.
    pub range: Range<u64>,
    /// The turn that produced it, counting from 0.
    pub turn: u32,
}

impl Segment {
    /// Its length in tokens.
    pub fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

/// Where a policy's labels come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelSource {
    /// A rule; the model is not asked.
    Rule,
    /// The `[LIFECYCLE]` block the model writes, decoded freely (the
    /// seed's way: it may be missing or malformed).
    Free,
    /// A separate labelling pass decoded under [`LabelGrammar`].
    Constrained,
}

/// Labels the live segments of a sequence when a turn ends.
///
/// Contract (checked by [`testing::check_policy`]): exactly one label per
/// segment given, and every segment of the turn that just ended is
/// [`Label::Keep`]. A `Keep` is not final: the segment is asked about again
/// at the next turn's end.
pub trait LifecyclePolicy: Send {
    /// A short name for reports.
    fn name(&self) -> String;

    /// Where its labels come from (what the engine must produce).
    fn source(&self) -> LabelSource {
        LabelSource::Rule
    }

    /// Turn `segments.last().turn` of `seq` ended. `segments` are the
    /// sequence's live segments, oldest first. `model` holds the labels the
    /// model gave the segments of that turn, in order (`None`: its block was
    /// missing or unusable, or the policy does not ask the model). Writes
    /// one label per segment into `out` (empty on entry). Returns whether
    /// the rule fallback stood in for missing model labels.
    fn label(
        &mut self,
        seq: SeqKey,
        segments: &[Segment],
        model: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool;

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

    fn label(
        &mut self,
        _: SeqKey,
        segments: &[Segment],
        _: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let last = segments.last().map_or(0, |s| s.turn);
        let oldest_kept = (last + 1).saturating_sub(self.keep);
        out.extend(segments.iter().map(|s| {
            if s.turn > 0 && s.turn < oldest_kept {
                Label::Drop
            } else {
                Label::Keep
            }
        }));
        false
    }
}

/// The seed's rule: the newest `protect` rounds keep, and so does the first
/// (system prompt, first exchange); an older segment is compressed when it
/// has at least `compress_min` tokens, dropped otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleFallback {
    protect: u32,
    compress_min: u64,
}

impl RuleFallback {
    /// `protect` ≥ 1 rounds kept (the seed: 2); segments of `compress_min`
    /// ≥ 1 tokens or more are compressed (the seed: 512).
    pub fn new(protect: u32, compress_min: u64) -> Result<Self> {
        if protect == 0 {
            return Err(LifecycleError::Config(
                "protect at least the round that just ended (protect >= 1)".into(),
            ));
        }
        if compress_min == 0 {
            return Err(LifecycleError::Config(
                "the compression threshold must be at least 1 token".into(),
            ));
        }
        Ok(RuleFallback {
            protect,
            compress_min,
        })
    }

    /// Whether `s` is still inside the protected rounds (or the first).
    fn protected(&self, s: &Segment, last: u32) -> bool {
        s.turn == 0 || s.turn + self.protect > last
    }

    fn rule(&self, s: &Segment, last: u32) -> Label {
        if self.protected(s, last) {
            Label::Keep
        } else if s.len() >= self.compress_min {
            Label::Compress
        } else {
            Label::Drop
        }
    }
}

impl LifecyclePolicy for RuleFallback {
    fn name(&self) -> String {
        format!("rule-protect{}", self.protect)
    }

    fn label(
        &mut self,
        _: SeqKey,
        segments: &[Segment],
        _: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let last = segments.last().map_or(0, |s| s.turn);
        out.extend(segments.iter().map(|s| self.rule(s, last)));
        false
    }
}

/// The model's labels, acted on once a segment leaves the protected
/// rounds; [`RuleFallback`] decides a segment whose turn's labels were
/// missing or unusable.
#[derive(Debug)]
pub struct ModelLabels {
    source: LabelSource,
    rule: RuleFallback,
    given: HashMap<SeqKey, HashMap<u32, Label>>,
}

impl ModelLabels {
    /// Labels from `source` (`Free` or `Constrained`), with `rule` as
    /// the fallback and its protected rounds.
    pub fn new(source: LabelSource, rule: RuleFallback) -> Result<Self> {
        if source == LabelSource::Rule {
            return Err(LifecycleError::Config(
                "model labels come from the model's block, decoded freely or constrained".into(),
            ));
        }
        Ok(ModelLabels {
            source,
            rule,
            given: HashMap::new(),
        })
    }
}

impl LifecyclePolicy for ModelLabels {
    fn name(&self) -> String {
        match self.source {
            LabelSource::Constrained => "labels-constrained".into(),
            _ => "labels-free".into(),
        }
    }

    fn source(&self) -> LabelSource {
        self.source
    }

    fn label(
        &mut self,
        seq: SeqKey,
        segments: &[Segment],
        model: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let last = segments.last().map_or(0, |s| s.turn);
        let newest: Vec<u32> = segments
            .iter()
            .filter(|s| s.turn == last)
            .map(|s| s.id)
            .collect();
        let given = self.given.entry(seq).or_default();
        let usable = model.filter(|m| m.len() == newest.len());
        if let Some(m) = usable {
            given.extend(newest.iter().copied().zip(m.iter().copied()));
        }
        given.retain(|id, _| segments.iter().any(|s| s.id == *id));
        out.extend(segments.iter().map(|s| {
            if self.rule.protected(s, last) {
                Label::Keep
            } else {
                given
                    .get(&s.id)
                    .copied()
                    .unwrap_or_else(|| self.rule.rule(s, last))
            }
        }));
        usable.is_none() && !newest.is_empty()
    }

    fn forget(&mut self, seq: SeqKey) {
        self.given.remove(&seq);
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
