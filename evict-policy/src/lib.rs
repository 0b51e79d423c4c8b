//! Which KV entries to forget when a sequence outgrows its memory.
//!
//! An [`EvictionPolicy`] looks at a sequence's [`BlockTable`] (and, if it
//! asks for them, the attention mass each entry received) and names
//! entries to drop. It only decides: the cache coordinator turns the
//! entries into [`Slot::Dropped`](kvforge_pool::Slot::Dropped), releases
//! their blocks and keeps the positions of the tokens after them, so the
//! keys that stay keep the RoPE positions they were computed at.
//!
//! Pure Rust: no tensors; the attention mass arrives as `f32`s.
//!
//! # Implementations
//!
//! * [`SinkWindow`] — StreamingLLM (Xiao et al., 2023): keep the first
//!   `sink` tokens (attention sinks) and the newest `window`; drop every
//!   whole entry in between. Needs no scores.
//!
//! * [`Scored`] — page-level eviction by a score over the attention mass
//!   each entry received ([`Score::AttentionEma`]: H2O's heavy hitters,
//!   Zhang et al., 2023; [`Score::Lfu`]: how often an entry drew more than
//!   its share; [`Score::Hybrid`]: seed 004's priority
//!   `α(1−recency) + β(1−attention) + γ(1−frequency)`; [`Score::KeyDiff`]:
//!   keys nearest the mean key; [`Score::SnapKv`]: the attention of an
//!   observation window of the latest queries), triggered by a
//!   per-sequence token budget or a high/low watermark over the byte
//!   budget ([`Trigger`]); the sink and the recent window are never
//!   dropped.
//!
//! Head-wise eviction ([`Scored::per_head`], KeyDiff or SnapKV): each lane — one
//! layer's one KV head — keeps its own pages; the coordinator packs the
//! pages the lanes keep into fewer blocks. Token-level eviction
//! ([`Scored::per_token`]): single rows are marked invalid and the
//! coordinator compacts the live rows of holed blocks into fewer blocks.
//!
//! Each passes [`testing::check_policy`]; a per-lane policy also
//! [`testing::check_lane_policy`], a token-level one
//! [`testing::check_token_policy`].

#![deny(missing_docs)]

mod scored;
pub mod testing;

pub use scored::{Score, Scored, Trigger};

use kvforge_pool::{BlockTable, Slot};

/// Identifies one sequence to a policy that keeps per-sequence state.
pub type SeqKey = u64;

/// A bad policy configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvictError {
    /// A parameter that cannot work.
    #[error("eviction policy: {0}")]
    Config(String),
}

/// `Result` with [`EvictError`].
pub type Result<T, E = EvictError> = std::result::Result<T, E>;

/// What the coordinator tells a policy before a step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    /// Fraction of the byte budget in use, all tiers, in `[0, 1]`.
    pub used: f64,
    /// Tokens the coming step adds.
    pub new_tokens: usize,
    /// The byte budget of all tiers (0 when unknown).
    pub budget_bytes: u64,
    /// Bytes one hot block holds.
    pub hot_block_bytes: u64,
    /// Bytes one cold block holds (0 without a cold tier).
    pub cold_block_bytes: u64,
}

impl Pressure {
    /// `used` of the budget in use and `new_tokens` coming; block sizes
    /// and budget unknown (0).
    pub fn new(used: f64, new_tokens: usize) -> Self {
        Pressure {
            used,
            new_tokens,
            ..Pressure::default()
        }
    }
}

/// Names entries of a block table to drop.
///
/// Contract (checked by [`testing::check_policy`]): the indexes appended to
/// `out` ascend, exist, name live entries (not dropped), never the open
/// last entry nor the entry holding the newest position; and once they
/// are dropped, asking again with the same table does not name them again.
pub trait EvictionPolicy: Send {
    /// A short name for reports (`sink-window`, `h2o` …).
    fn name(&self) -> String;

    /// For a policy that evicts by watermark: the fractions of the byte
    /// budget at which it starts (`high`) and to which it brings the bytes
    /// back (`low`), for a monitor to draw. `None` (the default): it
    /// evicts by another rule.
    fn watermark(&self) -> Option<(f64, f64)> {
        None
    }

    /// Whether [`observe`](Self::observe) wants the attention mass of each
    /// entry (the attention backend computes it only when asked).
    fn wants_attention(&self) -> bool {
        false
    }

    /// The attention mass entry `i` of `table` received in the last step
    /// (summed over heads and queries), `mass.len() == table.entries().len()`,
    /// 0 for dropped entries.
    fn observe(&mut self, seq: SeqKey, table: &BlockTable, mass: &[f32]) {
        let _ = (seq, table, mass);
    }

    /// With [`wants_attention`](Self::wants_attention): how many of a
    /// step's last queries the attention mass should come from (SnapKV's
    /// observation window; a step with fewer queries gives all of them);
    /// 0 for every query of the step.
    fn observation_window(&self) -> usize {
        0
    }

    /// Whether [`observe_keys`](Self::observe_keys) wants how far each
    /// entry's keys stand from the mean key (the engine computes it only
    /// when asked).
    fn wants_keys(&self) -> bool {
        false
    }

    /// Entry `i` of `table`'s keys stood `novelty[i]` from the mean key in
    /// the last step: `1 − cos(key, mean key)` averaged over the entry's
    /// keys, heads and layers (KeyDiff's signal), `novelty.len() ==
    /// table.entries().len()`, 0 for dropped entries.
    fn observe_keys(&mut self, seq: SeqKey, table: &BlockTable, novelty: &[f32]) {
        let _ = (seq, table, novelty);
    }

    /// Whether the policy chooses pages per lane — one layer's one KV head
    /// — rather than whole entries (head-wise eviction: each lane keeps
    /// the pages that matter to it, as kvpress's presses keep tokens per
    /// head). Then [`observe_keys`](Self::observe_keys) (and
    /// [`observe`](Self::observe)) receive `entries × lanes` values, entry
    /// after entry, lane `layer × kv_heads + head` within one; and the
    /// coordinator asks [`lane_victims`](Self::lane_victims) instead of
    /// [`victims`](Self::victims).
    fn per_lane(&self) -> bool {
        false
    }

    /// For a [`per_lane`](Self::per_lane) policy: appends, lane after lane,
    /// the same number `d` of entries that each lane stops reading,
    /// ascending within a lane (`out.len() == lanes × d`). Each named entry
    /// is a full, closed, hot block outside what the policy protects. The
    /// coordinator then packs each lane's surviving pages of the named
    /// entries into `d` fewer blocks (copying them) and drops the rest, so
    /// `d` blocks of memory come back.
    fn lane_victims(
        &mut self,
        seq: SeqKey,
        table: &BlockTable,
        pressure: Pressure,
        lanes: usize,
        out: &mut Vec<usize>,
    ) {
        let _ = (seq, table, pressure, lanes, out);
    }

    /// Whether the policy names single tokens — rows of blocks — rather
    /// than whole entries (token-level eviction). Then
    /// [`observe`](Self::observe) and [`observe_keys`](Self::observe_keys)
    /// receive `entries × block_size` values, row `r` of entry `i` at `i ×
    /// block_size + r` (0 for rows attention did not read), and the
    /// coordinator asks [`token_victims`](Self::token_victims) instead of
    /// [`victims`](Self::victims).
    fn token_level(&self) -> bool {
        false
    }

    /// For a [`token_level`](Self::token_level) policy: appends `(entry, row)`
    /// pairs, ascending, of rows to mark invalid before the next step:
    /// each a live row (not already a hole) of a full, closed hot block of
    /// at most [`MAX_HOLED_BLOCK`](kvforge_pool::MAX_HOLED_BLOCK) tokens,
    /// outside what the policy protects. The coordinator marks them (an
    /// entry left with no live row is dropped) and compacts the live rows
    /// of holed blocks into fewer blocks whenever that frees one.
    fn token_victims(
        &mut self,
        seq: SeqKey,
        table: &BlockTable,
        pressure: Pressure,
        out: &mut Vec<(usize, u32)>,
    ) {
        let _ = (seq, table, pressure, out);
    }

    /// Appends the entries of `table` to drop before the next step.
    fn victims(
        &mut self,
        seq: SeqKey,
        table: &BlockTable,
        pressure: Pressure,
        out: &mut Vec<usize>,
    );

    /// The sequence ended: forget its state.
    fn forget(&mut self, seq: SeqKey) {
        let _ = seq;
    }

    /// Why the policy could not answer since this was last asked, taken
    /// (`None` when it could). A policy whose code runs outside Rust — one
    /// written in Python, whose method raised or answered the wrong type —
    /// answers nothing and says why here; the coordinator asks after every
    /// victims call and fails the step of the sequence the call was about
    /// with these words, changing nothing. When that sequence is idle
    /// (asked for room by another's step), nothing is cut from it, the
    /// other step goes on, and the idle sequence's own next step fails.
    fn take_error(&mut self) -> Option<String> {
        None
    }
}

/// StreamingLLM: the first `sink` and the newest `window` positions stay;
/// every whole entry entirely between them is dropped, whatever the memory
/// pressure (the cache then holds at most `sink + window` tokens plus two
/// partial blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkWindow {
    sink: u64,
    window: u64,
}

impl SinkWindow {
    /// Keeps `sink` leading and `window` trailing tokens; the window must
    /// hold at least one token (the newest).
    pub fn new(sink: usize, window: usize) -> Result<Self> {
        if window == 0 {
            return Err(EvictError::Config(
                "the recent window must keep at least one token".into(),
            ));
        }
        Ok(SinkWindow {
            sink: sink as u64,
            window: window as u64,
        })
    }

    /// Tokens kept at the start.
    pub fn sink(&self) -> usize {
        self.sink as usize
    }

    /// Tokens kept at the end.
    pub fn window(&self) -> usize {
        self.window as usize
    }
}

impl EvictionPolicy for SinkWindow {
    fn name(&self) -> String {
        format!("sink{}-window{}", self.sink, self.window)
    }

    fn victims(&mut self, _seq: SeqKey, table: &BlockTable, _p: Pressure, out: &mut Vec<usize>) {
        let recent = table.positions().saturating_sub(self.window);
        for (i, e) in table.entries().iter().enumerate() {
            if e.first() >= recent {
                break;
            }
            if e.slot() != Slot::Dropped && e.first() >= self.sink && e.end() <= recent {
                out.push(i);
            }
        }
    }
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
