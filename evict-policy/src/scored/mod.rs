//! Page-level eviction by score: attention EMA (H2O), LFU, the hybrid,
//! key novelty (KeyDiff), an observation window's attention (SnapKV).

mod policy;

use std::collections::BTreeMap;

use kvforge_pool::{BlockTable, Entry, Slot};

use crate::{EvictError, Pressure, Result, SeqKey};

/// How an entry's usefulness is scored from the attention it receives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Score {
    /// H2O: an exponential moving average of the entry's share of each
    /// step's attention mass (`ema = decay·ema + (1−decay)·share`); the
    /// lowest goes first.
    AttentionEma {
        /// Weight of the past, in `[0, 1)`.
        decay: f32,
    },
    /// LFU: the number of steps in which the entry drew more than an even
    /// share of the attention; the fewest go first (the older on a tie).
    Lfu,
    /// Seed 004: priority `α(1−recency) + β(1−attention) + γ(1−frequency)`,
    /// each term normalized to `[0, 1]` over the candidates (recency by
    /// position, attention by the EMA with decay 0.9, frequency as LFU);
    /// the highest goes first.
    Hybrid {
        /// Weight of age.
        alpha: f32,
        /// Weight of low attention.
        beta: f32,
        /// Weight of rare use.
        gamma: f32,
    },
    /// KeyDiff (Park et al., as in NVIDIA kvpress): the entries whose keys
    /// stand closest to the mean key go first — keys share a dominant
    /// direction that adds the same logit everywhere, and the keys that
    /// stand out from it are those attention can single out. Needs no
    /// attention weights; the engine reports each entry's
    /// `1 − cos(key, mean key)` (the latest step's).
    KeyDiff,
    /// SnapKV (Li et al., 2024): the attention the last `window` queries
    /// of the latest step paid each entry (every query of a shorter step);
    /// the lowest goes first. Not accumulated: the step that ends a prompt
    /// scores the whole prompt by its observation window — the question,
    /// when the prompt ends with one — as SnapKV selects at prefill; later
    /// decode steps observe one query each.
    SnapKv {
        /// Queries in the observation window (at least 1).
        window: usize,
    },
}

/// When [`Scored`] evicts, and how much.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Trigger {
    /// Keep at most this many live tokens per sequence (the sink and the
    /// window included): a fixed KV budget, as in the compression-ratio
    /// experiments.
    Tokens(usize),
    /// When the bytes in use reach `high` of the budget, evict until the
    /// blocks dropped bring them to `low` (fractions in `(0, 1]`).
    Watermark {
        /// Fraction of the budget that starts eviction.
        high: f64,
        /// Fraction eviction brings it back to.
        low: f64,
    },
}

/// What a policy remembers of one entry, keyed by its first position.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Stat {
    ema: f32,
    hits: u32,
    novelty: f32,
    /// The latest step's attention (SnapKV's observation window).
    recent: f32,
}

/// Score-based page eviction: the sink and the newest `window` tokens stay;
/// when the [`Trigger`] fires, whole entries in between go, lowest score
/// first, until the need is met.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    score: Score,
    trigger: Trigger,
    sink: u64,
    window: u64,
    stats: BTreeMap<SeqKey, BTreeMap<u64, Stat>>,
    /// What the policy chooses: whole entries, lane pages, single rows.
    grain: Grain,
    /// Head-wise or token-level: the latest signal of every lane or row,
    /// per entry.
    detail: BTreeMap<SeqKey, LaneStats>,
}

/// What a [`Scored`] policy names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grain {
    /// Whole entries.
    Page,
    /// Pages per lane (one layer's one KV head).
    Head,
    /// Single rows (tokens) of blocks.
    Token,
}

/// Per entry (by its first position), the latest signal of each lane or
/// row (key novelty, or the observation window's attention).
type LaneStats = BTreeMap<u64, Box<[f32]>>;

/// The decay of the EMA inside [`Score::Hybrid`].
const HYBRID_DECAY: f32 = 0.9;

impl Scored {
    /// Keeps `sink` leading and `window` trailing tokens. Errors: a window
    /// of nothing, a decay outside `[0, 1)`, hybrid weights negative, not
    /// finite or all zero, a watermark outside `(0, 1]` or with `low >=
    /// high`, a token budget that does not exceed the protected
    /// `sink + window`.
    pub fn new(score: Score, trigger: Trigger, sink: usize, window: usize) -> Result<Self> {
        let bad = |m: String| Err(EvictError::Config(m));
        if window == 0 {
            return bad("the recent window must keep at least one token".into());
        }
        match score {
            Score::AttentionEma { decay } if !(0.0..1.0).contains(&decay) => {
                return bad(format!("decay {decay} must be in [0, 1)"));
            }
            Score::SnapKv { window: 0 } => {
                return bad("the observation window must hold at least one query".into());
            }
            Score::Hybrid { alpha, beta, gamma } => {
                let w = [alpha, beta, gamma];
                if w.iter().any(|x| !x.is_finite() || *x < 0.0) || w.iter().all(|x| *x == 0.0) {
                    return bad(format!(
                        "hybrid weights α={alpha} β={beta} γ={gamma} must be finite, >= 0 and not all 0"
                    ));
                }
            }
            _ => {}
        }
        match trigger {
            Trigger::Tokens(n) if n <= sink + window => {
                return bad(format!(
                    "a budget of {n} tokens leaves nothing to choose beyond the sink ({sink}) and the window ({window})"
                ));
            }
            Trigger::Watermark { high, low } if !(low > 0.0 && low < high && high <= 1.0) => {
                return bad(format!(
                    "watermarks low {low} and high {high} must satisfy 0 < low < high <= 1"
                ));
            }
            _ => {}
        }
        Ok(Scored {
            score,
            trigger,
            sink: sink as u64,
            window: window as u64,
            stats: BTreeMap::new(),
            grain: Grain::Page,
            detail: BTreeMap::new(),
        })
    }

    /// Head-wise eviction: every lane (one layer's one KV head) keeps its
    /// own pages, ranked by its own signal — key novelty (kvpress's KeyDiff
    /// keeps tokens per head the same way) or the observation window's
    /// attention (SnapKV selects per head); the coordinator packs what the
    /// lanes keep into fewer blocks. KeyDiff and SnapKV only: the other
    /// scores accumulate over steps, and packing moves pages between
    /// entries.
    pub fn per_head(self) -> Result<Self> {
        self.with_grain(Grain::Head, "per-head")
    }

    /// Token-level eviction: single rows (tokens) of blocks are marked
    /// invalid, the lowest signal first (key novelty or the observation
    /// window's attention per token); the coordinator compacts the live
    /// rows of holed blocks into fewer blocks. KeyDiff and SnapKV only, as
    /// for [`per_head`](Self::per_head).
    pub fn per_token(self) -> Result<Self> {
        self.with_grain(Grain::Token, "token-level")
    }

    fn with_grain(mut self, grain: Grain, what: &str) -> Result<Self> {
        if !matches!(self.score, Score::KeyDiff | Score::SnapKv { .. }) {
            return Err(EvictError::Config(format!(
                "{what} eviction ranks by key novelty (KeyDiff) or an observation window (SnapKV), not by {:?}",
                self.score
            )));
        }
        self.grain = grain;
        Ok(self)
    }

    /// Per lane or row: keeps `values` (`entries × lanes` or `entries ×
    /// block_size`, entry after entry) as the latest signal of each live
    /// entry, replacing the last. Returns whether the policy keeps such
    /// detail.
    fn record_lanes(&mut self, seq: SeqKey, table: &BlockTable, values: &[f32]) -> bool {
        if self.grain == Grain::Page {
            return false;
        }
        let entries = table.entries();
        let n = values.len() / entries.len().max(1);
        let stats = self.detail.entry(seq).or_default();
        stats.clear();
        if n == 0 || n * entries.len() != values.len() {
            return true;
        }
        for (e, v) in entries.iter().zip(values.chunks_exact(n)) {
            if e.slot().is_live() {
                let v = v.iter().map(|x| if x.is_finite() { *x } else { 0.0 });
                stats.insert(e.first(), v.collect());
            }
        }
        true
    }

    /// The entries head-wise packing and token-level compaction may take:
    /// full, closed hot blocks between the sink and the recent window.
    fn packable<'a>(&self, table: &'a BlockTable) -> impl Iterator<Item = (usize, &'a Entry)> {
        let recent = table.positions().saturating_sub(self.window);
        let last = table.entries().len().wrapping_sub(1);
        let (sink, bs, open) = (self.sink, table.block_size(), table.is_open());
        table.entries().iter().enumerate().filter(move |&(i, e)| {
            matches!(e.slot(), Slot::Hot(_))
                && e.tokens() == bs
                && e.first() >= sink
                && e.end() <= recent
                && !(open && i == last)
        })
    }

    fn decay(&self) -> f32 {
        match self.score {
            Score::AttentionEma { decay } => decay,
            _ => HYBRID_DECAY,
        }
    }

    /// How much to free: tokens (token budget) or bytes (watermark).
    fn need(&self, table: &BlockTable, p: Pressure) -> Need {
        match self.trigger {
            Trigger::Tokens(cap) => {
                let live = table.live_tokens() as usize + p.new_tokens;
                Need::Tokens(live.saturating_sub(cap) as u64)
            }
            Trigger::Watermark { high, low } => {
                if p.used < high || p.budget_bytes == 0 {
                    Need::Bytes(0)
                } else {
                    Need::Bytes(((p.used - low) * p.budget_bytes as f64).ceil() as u64)
                }
            }
        }
    }
}

enum Need {
    Tokens(u64),
    Bytes(u64),
}
