//! The lifecycle of a sequence's segments: labels, the pending queue
//! (delayed reclamation), revival, compression requests.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::Range;

use crate::labels::Label;
use crate::{LabelSource, LifecycleError, LifecyclePolicy, Result, Segment, SeqKey};

/// How a [`Lifecycle`] acts on its policy's labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LifecycleParams {
    /// K: rounds a dropped segment waits in the pending queue (still
    /// attended, its blocks still held) before its KV is freed. 0 frees it
    /// at the turn end that drops it (no queue).
    pub delay: u32,
    /// A pending segment is revived (kept for good) when a later turn's
    /// referring part ([`TurnEnd::refer`]: the user's message) holds a run
    /// of this many consecutive tokens of it; 0 never revives.
    pub min_match: usize,
    /// Segments labelled `compress` with at least this many tokens are
    /// handed out for summarising; `None`, or a shorter segment: kept.
    pub compress_min: Option<u64>,
}

impl Default for LifecycleParams {
    /// The seed's: K = 2, runs of 6 tokens, compression of 512 tokens and
    /// more.
    fn default() -> Self {
        LifecycleParams {
            delay: 2,
            min_match: 6,
            compress_min: Some(512),
        }
    }
}

/// A turn that ended, as [`Lifecycle::end_turn`] needs it.
#[derive(Clone, Debug)]
pub struct TurnEnd<'a> {
    /// The sequence's positions now; the turn holds those after the
    /// previous turn's end.
    pub end: u64,
    /// Positions inside the turn where a new segment starts (others are
    /// ignored); none: the turn is one segment.
    pub cuts: &'a [u64],
    /// The sequence's token ids by position (for revival); shorter or
    /// empty: only what is there is looked at.
    pub tokens: &'a [u32],
    /// Token ids that never count towards a run (the chat template's
    /// special tokens, present in every turn).
    pub stop: &'a [u32],
    /// The positions of the turn whose tokens can refer to a pending
    /// segment (the user's message; `None`: the whole turn). A model that
    /// repeats itself should not keep its own old replies alive.
    pub refer: Option<Range<u64>>,
    /// The model's labels for the turn's segments, in order (`None`:
    /// missing or unusable).
    pub model: Option<&'a [Label]>,
}

/// What one turn end decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Segments the turn added.
    pub segments: u32,
    /// Whether the rule stood in for the model's missing labels.
    pub fallback: bool,
    /// Segments put in the pending queue.
    pub queued: u32,
    /// Pending segments a later turn referred to: kept.
    pub revived: u32,
    /// Segments whose KV is freed now.
    pub reclaimed: u32,
    /// Their positions, ascending, disjoint, merged where adjacent.
    pub reclaim: Vec<Range<u64>>,
    /// Segments to summarise; report back with [`Lifecycle::compressed`].
    pub compress: Vec<Segment>,
}

struct Pending {
    seg: Segment,
    due: u32,
    runs: HashSet<u64>,
}

#[derive(Default)]
struct SeqState {
    turns: u32,
    end: u64,
    next_id: u32,
    live: Vec<Segment>,
    pending: Vec<Pending>,
    /// Kept for good: revived, or a summary that could not replace it.
    held: Vec<Segment>,
    /// Handed out for summarising, not answered yet.
    awaiting: Vec<Segment>,
    /// Every position freed so far (reclaimed or replaced by a summary),
    /// ascending, disjoint, adjacent ranges merged.
    freed: Vec<Range<u64>>,
}

/// Adds `r` to `union` (ascending, disjoint, adjacent ranges merged).
fn insert_range(union: &mut Vec<Range<u64>>, r: Range<u64>) {
    if r.is_empty() {
        return;
    }
    let i = union.partition_point(|u| u.end < r.start);
    let mut merged = r;
    let mut j = i;
    while j < union.len() && union[j].start <= merged.end {
        merged.start = merged.start.min(union[j].start);
        merged.end = merged.end.max(union[j].end);
        j += 1;
    }
    union.splice(i..j, [merged]);
}

/// A [`LifecyclePolicy`] with delayed reclamation, over many sequences.
pub struct Lifecycle {
    policy: Box<dyn LifecyclePolicy>,
    params: LifecycleParams,
    seqs: HashMap<SeqKey, SeqState>,
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("policy", &self.policy.name())
            .field("params", &self.params)
            .field("sequences", &self.seqs.len())
            .finish()
    }
}

fn run_hashes(tokens: &[u32], n: usize, stop: &[u32]) -> impl Iterator<Item = u64> {
    let windows = if n == 0 {
        [].windows(1)
    } else {
        tokens.windows(n)
    };
    windows
        .filter(move |w| !w.iter().any(|t| stop.contains(t)))
        .map(|w| {
            let mut h = DefaultHasher::new();
            w.hash(&mut h);
            h.finish()
        })
}

impl Lifecycle {
    /// `policy` acting under `params`. A zero compression threshold is
    /// refused.
    pub fn new(policy: Box<dyn LifecyclePolicy>, params: LifecycleParams) -> Result<Self> {
        if params.compress_min == Some(0) {
            return Err(LifecycleError::Config(
                "the compression threshold must be at least 1 token".into(),
            ));
        }
        Ok(Lifecycle {
            policy,
            params,
            seqs: HashMap::new(),
        })
    }

    /// The policy's name and the delay, for reports.
    pub fn name(&self) -> String {
        format!("{}-k{}", self.policy.name(), self.params.delay)
    }

    /// Where the policy's labels come from.
    pub fn source(&self) -> LabelSource {
        self.policy.source()
    }

    /// How it acts.
    pub fn params(&self) -> &LifecycleParams {
        &self.params
    }

    /// Segments pending reclamation in `seq`.
    pub fn pending(&self, seq: SeqKey) -> Vec<Segment> {
        self.seqs
            .get(&seq)
            .map(|s| s.pending.iter().map(|p| p.seg.clone()).collect())
            .unwrap_or_default()
    }

    /// The live segments of `seq` (neither pending nor reclaimed), oldest
    /// first, held ones included.
    pub fn live(&self, seq: SeqKey) -> Vec<Segment> {
        let Some(s) = self.seqs.get(&seq) else {
            return Vec::new();
        };
        let mut v: Vec<Segment> = s.live.iter().chain(&s.held).cloned().collect();
        v.sort_by_key(|g| g.range.start);
        v
    }

    /// The segments the turn ending at `end` would add, cut at `cuts`:
    /// what the model is asked to label.
    pub fn turn_segments(&self, seq: SeqKey, end: u64, cuts: &[u64]) -> Vec<Segment> {
        let (start, id, turn) = self
            .seqs
            .get(&seq)
            .map_or((0, 0, 0), |s| (s.end, s.next_id, s.turns));
        let mut out = Vec::new();
        let mut from = start;
        let mut inner: Vec<u64> = cuts
            .iter()
            .copied()
            .filter(|&c| c > start && c < end)
            .collect();
        inner.sort_unstable();
        inner.dedup();
        inner.push(end);
        for c in inner {
            if c > from {
                out.push(Segment {
                    id: id + out.len() as u32,
                    range: from..c,
                    turn,
                });
                from = c;
            }
        }
        out
    }

    /// A turn of `seq` ended: its segments join, the policy labels the live
    /// ones, dropped ones enter the queue (or are freed at once when K is
    /// 0), pending ones a turn refers to are revived, and those whose K
    /// rounds are over are freed.
    pub fn end_turn(&mut self, seq: SeqKey, t: TurnEnd<'_>) -> Outcome {
        let added = self.turn_segments(seq, t.end, t.cuts);
        let mut out = Outcome {
            segments: added.len() as u32,
            ..Outcome::default()
        };
        let params = &self.params;
        let s = self.seqs.entry(seq).or_default();
        let turn = s.turns;
        let new_from = s.end;
        s.turns += 1;
        s.end = s.end.max(t.end);
        s.next_id += added.len() as u32;
        s.live.extend(added);

        // Revival: the turn's tokens hold a run of a pending segment.
        if params.min_match > 0 && !s.pending.is_empty() {
            let r = t.refer.clone().unwrap_or(new_from..t.end);
            let lo = (r.start.max(new_from) as usize).min(t.tokens.len());
            let hi = (r.end.min(t.end) as usize).min(t.tokens.len()).max(lo);
            let seen: HashSet<u64> =
                run_hashes(&t.tokens[lo..hi], params.min_match, t.stop).collect();
            let (revived, still): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut s.pending)
                .into_iter()
                .partition(|p| !p.runs.is_disjoint(&seen));
            out.revived = revived.len() as u32;
            s.held.extend(revived.into_iter().map(|p| p.seg));
            s.pending = still;
        }

        let mut labels = Vec::with_capacity(s.live.len());
        out.fallback = self.policy.label(seq, &s.live, t.model, &mut labels);
        let mut keep = Vec::with_capacity(s.live.len());
        let mut freed = Vec::new();
        for (seg, label) in std::mem::take(&mut s.live)
            .into_iter()
            .zip(labels.into_iter().chain(std::iter::repeat(Label::Keep)))
        {
            match label {
                // The contract keeps the newest turn; a policy that breaks
                // it is not obeyed.
                _ if seg.turn == turn => keep.push(seg),
                Label::Keep => keep.push(seg),
                Label::Compress => match params.compress_min {
                    Some(m) if seg.len() >= m => {
                        s.awaiting.push(seg.clone());
                        out.compress.push(seg);
                    }
                    _ => keep.push(seg),
                },
                Label::Drop if params.delay == 0 => freed.push(seg),
                Label::Drop => {
                    let lo = (seg.range.start as usize).min(t.tokens.len());
                    let hi = (seg.range.end as usize).min(t.tokens.len());
                    let runs = run_hashes(&t.tokens[lo..hi], params.min_match, t.stop).collect();
                    out.queued += 1;
                    s.pending.push(Pending {
                        seg,
                        due: turn + params.delay,
                        runs,
                    });
                }
            }
        }
        s.live = keep;
        let (due, wait): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut s.pending)
            .into_iter()
            .partition(|p| p.due <= turn);
        s.pending = wait;
        freed.extend(due.into_iter().map(|p| p.seg));
        freed.sort_by_key(|g| g.range.start);
        out.reclaimed = freed.len() as u32;
        for g in &freed {
            insert_range(&mut s.freed, g.range.clone());
        }
        for g in freed {
            match out.reclaim.last_mut() {
                Some(r) if r.end == g.range.start => r.end = g.range.end,
                _ => out.reclaim.push(g.range),
            }
        }
        out
    }

    /// The engine summarised `seg` (handed out by `end_turn`) and its KV is
    /// gone (`replaced`), or could not (the summary was not shorter, or the
    /// pass failed): then the segment is kept for good. A segment that was
    /// not handed out, or was answered already, is refused (nothing
    /// changes).
    pub fn compressed(&mut self, seq: SeqKey, seg: Segment, replaced: bool) -> Result<()> {
        let s = self.seqs.get_mut(&seq);
        let Some((s, i)) = s.and_then(|s| {
            let i = s.awaiting.iter().position(|g| *g == seg)?;
            Some((s, i))
        }) else {
            return Err(LifecycleError::Order(format!(
                "segment {} ({:?}) of sequence {seq} was not handed out for summarising",
                seg.id, seg.range
            )));
        };
        s.awaiting.swap_remove(i);
        if replaced {
            insert_range(&mut s.freed, seg.range);
        } else {
            s.held.push(seg);
        }
        Ok(())
    }

    /// Every position of `seq` freed so far, as ascending, disjoint ranges
    /// with adjacent ones merged: a block whose positions lie in segments
    /// freed at different turns is covered by one range.
    pub fn freed(&self, seq: SeqKey) -> Vec<Range<u64>> {
        self.seqs
            .get(&seq)
            .map(|s| s.freed.clone())
            .unwrap_or_default()
    }

    /// The sequence ended.
    pub fn forget(&mut self, seq: SeqKey) {
        self.seqs.remove(&seq);
        self.policy.forget(seq);
    }
}
