//! Page-level eviction by score: attention EMA (H2O), LFU, the hybrid,
//! key novelty (KeyDiff), an observation window's attention (SnapKV).

use std::collections::BTreeMap;

use kvforge_pool::{BlockTable, Entry, Slot};

use crate::{EvictError, EvictionPolicy, Pressure, Result, SeqKey};

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

impl EvictionPolicy for Scored {
    fn name(&self) -> String {
        let score = match self.score {
            Score::AttentionEma { decay } => format!("h2o{decay}"),
            Score::Lfu => "lfu".into(),
            Score::Hybrid { alpha, beta, gamma } => format!("hybrid{alpha}/{beta}/{gamma}"),
            Score::KeyDiff => "keydiff".into(),
            Score::SnapKv { window } => format!("snapkv{window}"),
        };
        let score = match self.grain {
            Grain::Page => score,
            Grain::Head => format!("{score}-per-head"),
            Grain::Token => format!("{score}-per-token"),
        };
        let trigger = match self.trigger {
            Trigger::Tokens(n) => format!("budget{n}"),
            Trigger::Watermark { high, low } => format!("watermark{low}-{high}"),
        };
        format!("{score}-{trigger}-sink{}-window{}", self.sink, self.window)
    }

    fn wants_attention(&self) -> bool {
        self.score != Score::KeyDiff
    }

    fn wants_keys(&self) -> bool {
        self.score == Score::KeyDiff
    }

    fn observation_window(&self) -> usize {
        match self.score {
            Score::SnapKv { window } => window,
            _ => 0,
        }
    }

    fn observe_keys(&mut self, seq: SeqKey, table: &BlockTable, novelty: &[f32]) {
        if self.record_lanes(seq, table, novelty) {
            return;
        }
        let stats = self.stats.entry(seq).or_default();
        for (e, &n) in table.entries().iter().zip(novelty) {
            if e.slot().is_live() {
                stats.entry(e.first()).or_default().novelty = if n.is_finite() { n } else { 0.0 };
            } else {
                stats.remove(&e.first());
            }
        }
    }

    fn observe(&mut self, seq: SeqKey, table: &BlockTable, mass: &[f32]) {
        if self.record_lanes(seq, table, mass) {
            return;
        }
        let decay = self.decay();
        let entries = table.entries();
        let live = entries.iter().filter(|e| e.slot().is_live()).count().max(1);
        let total: f32 = mass.iter().filter(|m| m.is_finite() && **m > 0.0).sum();
        let stats = self.stats.entry(seq).or_default();
        for (e, &m) in entries.iter().zip(mass) {
            if !e.slot().is_live() {
                stats.remove(&e.first());
                continue;
            }
            let share = if total > 0.0 && m.is_finite() && m > 0.0 {
                m / total
            } else {
                0.0
            };
            let s = stats.entry(e.first()).or_default();
            s.recent = if m.is_finite() { m } else { 0.0 };
            s.ema = decay * s.ema + (1.0 - decay) * share;
            if share > 1.0 / live as f32 {
                s.hits = s.hits.saturating_add(1);
            }
        }
    }

    fn victims(&mut self, seq: SeqKey, table: &BlockTable, p: Pressure, out: &mut Vec<usize>) {
        let need = self.need(table, p);
        if matches!(need, Need::Tokens(0) | Need::Bytes(0)) {
            return;
        }
        let recent = table.positions().saturating_sub(self.window);
        let last = table.entries().len().wrapping_sub(1);
        let by_bytes = matches!(need, Need::Bytes(_));
        let bytes = |slot: Slot| match slot {
            Slot::Hot(_) => p.hot_block_bytes,
            Slot::Cold(_) => p.cold_block_bytes,
            Slot::Alias { .. } | Slot::Dropped => 0,
        };
        let empty = BTreeMap::new();
        let stats = self.stats.get(&seq).unwrap_or(&empty);
        // Candidates: live, outside the sink and the window, not the open
        // entry; under a watermark only those whose release frees bytes.
        let cands: Vec<(usize, Stat, u64)> = table
            .entries()
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                e.slot().is_live()
                    && e.first() >= self.sink
                    && e.end() <= recent
                    && !(table.is_open() && *i == last)
                    && !(by_bytes && bytes(e.slot()) == 0)
            })
            .map(|(i, e)| {
                (
                    i,
                    stats.get(&e.first()).copied().unwrap_or_default(),
                    e.first(),
                )
            })
            .collect();
        if cands.is_empty() {
            return;
        }
        // Higher priority = evicted sooner.
        let max_ema = cands.iter().map(|c| c.1.ema).fold(0.0f32, f32::max);
        let max_hits = cands.iter().map(|c| c.1.hits).max().unwrap_or(0);
        let (lo, hi) = (cands[0].2, cands[cands.len() - 1].2);
        let norm = |x: f32, max: f32| if max > 0.0 { x / max } else { 0.0 };
        let priority = |c: &(usize, Stat, u64)| -> f32 {
            match self.score {
                Score::AttentionEma { .. } => -c.1.ema,
                Score::Lfu => -(c.1.hits as f32),
                Score::KeyDiff => -c.1.novelty,
                Score::SnapKv { .. } => -c.1.recent,
                Score::Hybrid { alpha, beta, gamma } => {
                    let recency = if hi > lo {
                        (c.2 - lo) as f32 / (hi - lo) as f32
                    } else {
                        1.0
                    };
                    alpha * (1.0 - recency)
                        + beta * (1.0 - norm(c.1.ema, max_ema))
                        + gamma * (1.0 - norm(c.1.hits as f32, max_hits as f32))
                }
            }
        };
        let mut order: Vec<(f32, usize, Slot, u64)> = cands
            .iter()
            .map(|c| {
                let e = table.entries()[c.0];
                (priority(c), c.0, e.slot(), u64::from(e.tokens()))
            })
            .collect();
        // Highest priority first; the older entry on a tie.
        order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let start = out.len();
        let mut left = match need {
            Need::Tokens(n) | Need::Bytes(n) => n,
        };
        for (_, i, slot, tokens) in order {
            if left == 0 {
                break;
            }
            let freed = if by_bytes { bytes(slot) } else { tokens };
            left = left.saturating_sub(freed);
            out.push(i);
        }
        out[start..].sort_unstable();
    }

    fn per_lane(&self) -> bool {
        self.grain == Grain::Head
    }

    fn token_level(&self) -> bool {
        self.grain == Grain::Token
    }

    fn token_victims(
        &mut self,
        seq: SeqKey,
        table: &BlockTable,
        p: Pressure,
        out: &mut Vec<(usize, u32)>,
    ) {
        let bs = table.block_size();
        let rows = match self.need(table, p) {
            Need::Tokens(n) => n,
            Need::Bytes(b) if p.hot_block_bytes > 0 => {
                b.div_ceil(p.hot_block_bytes) * u64::from(bs)
            }
            Need::Bytes(_) => 0,
        };
        if rows == 0 || bs > kvforge_pool::MAX_HOLED_BLOCK {
            return;
        }
        let empty = BTreeMap::new();
        let stats = self.detail.get(&seq).unwrap_or(&empty);
        // Candidates: the live rows of full, closed hot blocks between the
        // sink and the window.
        let mut order: Vec<(f32, usize, u32)> = Vec::new();
        for (i, e) in self.packable(table) {
            let signal = stats.get(&e.first());
            for r in 0..bs {
                if e.holes() >> r & 1 == 0 {
                    let v = signal.and_then(|v| v.get(r as usize)).copied();
                    order.push((v.unwrap_or(0.0), i, r));
                }
            }
        }
        // The lowest signal first; the older on a tie.
        order.sort_by(|a, b| a.0.total_cmp(&b.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        let start = out.len();
        let take = usize::try_from(rows).unwrap_or(usize::MAX).min(order.len());
        out.extend(order[..take].iter().map(|o| (o.1, o.2)));
        out[start..].sort_unstable();
    }

    fn lane_victims(
        &mut self,
        seq: SeqKey,
        table: &BlockTable,
        p: Pressure,
        lanes: usize,
        out: &mut Vec<usize>,
    ) {
        let bs = u64::from(table.block_size());
        let blocks = match self.need(table, p) {
            Need::Tokens(n) => n.div_ceil(bs),
            Need::Bytes(b) if p.hot_block_bytes > 0 => b.div_ceil(p.hot_block_bytes),
            Need::Bytes(_) => 0,
        };
        if blocks == 0 || lanes == 0 {
            return;
        }
        // Candidates: full, closed hot blocks between the sink and the
        // window (packing copies hot pages).
        let cands: Vec<(usize, u64)> = self.packable(table).map(|(i, e)| (i, e.first())).collect();
        let d = (blocks as usize).min(cands.len());
        if d == 0 {
            return;
        }
        let empty = BTreeMap::new();
        let stats = self.detail.get(&seq).unwrap_or(&empty);
        let mut order: Vec<(f32, usize)> = Vec::with_capacity(cands.len());
        for lane in 0..lanes {
            order.clear();
            order.extend(cands.iter().map(|&(i, first)| {
                let novelty = stats.get(&first).and_then(|v| v.get(lane)).copied();
                (novelty.unwrap_or(0.0), i)
            }));
            // The lowest signal first (keys closest to the lane's mean,
            // or the least attention); the older on a tie.
            order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let start = out.len();
            out.extend(order[..d].iter().map(|o| o.1));
            out[start..].sort_unstable();
        }
    }

    fn forget(&mut self, seq: SeqKey) {
        self.stats.remove(&seq);
        self.detail.remove(&seq);
    }
}
