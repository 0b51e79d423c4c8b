//! [`EvictionPolicy`] for [`Scored`]: what it observes and which pages,
//! lanes or rows it gives up under pressure.

use std::collections::BTreeMap;

use kvforge_pool::{BlockTable, Slot};

use super::{Grain, Need, Score, Scored, Stat, Trigger};
use crate::{EvictionPolicy, Pressure, SeqKey};

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

    fn watermark(&self) -> Option<(f64, f64)> {
        match self.trigger {
            Trigger::Watermark { high, low } => Some((high, low)),
            Trigger::Tokens(_) => None,
        }
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
