//! The engine's side of the context lifecycle at a session's turn end:
//! cut the turn into sentence segments, ask the model for their labels
//! (a labelling pass on a fork of the session, decoded freely or under the
//! label grammar), hand everything to the coordinator, and summarise the
//! segments it hands out for compression.
//!
//! The labelling pass reads the session's own KV through a fork (the same
//! blocks, a reference of its own on each; dropped segments stay dropped),
//! so only the labelling request is prefilled; the fork is freed afterwards
//! and its block never enters the session's context.
//!
//! A summary is written by the same model from the segment's text alone
//! (a fresh sequence), at most a third of the segment's tokens, and joins
//! the context as a system message at the start of the next turn: it gets
//! new positions after everything else, while the tokens that followed the
//! segment keep theirs (and the KV they computed while attending to it).
//! That approximates replacing the segment in place; a summary that is not
//! shorter than its segment is refused and the segment kept.

use std::time::Instant;

use kvforge_coordinator::{LabelSource, Segment, TurnInput};
use kvforge_lifecycle::{Label, LabelGrammar, parse_labels, split_sentences};
use kvforge_prefix::ExtraKeys;

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::Result;
use crate::generate::SamplingParams;
use crate::tokenizer::{Message, Tokenizer};

/// Tokens below which a sentence joins the one before it.
pub const MIN_SEGMENT_TOKENS: usize = 4;

/// The labelling request's instructions (the seed's explicit criteria).
pub const LABEL_CRITERIA: &str = "Label each segment of our conversation below for memory. \
keep: facts, numbers, names, instructions or anything that may be asked about later. \
drop: greetings, small talk, filler, acknowledgements. \
compress: long background that matters only in outline.\n";

/// What the lifecycle did at the end of one turn.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct LifecycleReport {
    /// Segments the turn added.
    pub segments: u32,
    /// Whether the model's label block parsed (`None`: the model was not
    /// asked).
    pub labels_valid: Option<bool>,
    /// The model's labels for the turn's segments, when they parsed.
    pub labels: Vec<Label>,
    /// Whether the rule decided for lack of usable model labels.
    pub fallback: bool,
    /// Segments put in the pending queue.
    pub queued: u32,
    /// Pending segments revived by a reference.
    pub revived: u32,
    /// Segments whose KV was freed.
    pub reclaimed: u32,
    /// Entries dropped (reclaimed and compressed segments).
    pub dropped_entries: usize,
    /// Segments replaced by a summary.
    pub compressed: u32,
    /// Segments whose summary was refused (kept).
    pub compress_refused: u32,
    /// Tokens of the summaries that join the next turn.
    pub summary_tokens: usize,
    /// Seconds of the labelling pass.
    pub label_secs: f64,
    /// Seconds of the summary passes.
    pub compress_secs: f64,
}

/// The turn of `seq` (positions `start..`, `tokens` by position; the
/// user's part `start..reply`) ended: labels, reclamation (only the user's
/// part can refer to a pending segment), compression. Summaries are
/// appended to `pending` (what the next turn prefills first).
pub(crate) fn end_turn(
    engine: &Engine,
    seq: &mut Sequence,
    tokens: &[u32],
    pending: &mut Vec<u32>,
    start: usize,
    reply: usize,
    source: LabelSource,
) -> Result<LifecycleReport> {
    let tok = &engine.tokenizer;
    let cuts = segment_cuts(tok, tokens, start);
    let segs = engine.cache.turn_segments(seq, &cuts)?;
    let mut report = LifecycleReport {
        segments: segs.len() as u32,
        ..LifecycleReport::default()
    };
    let model = if source == LabelSource::Rule || segs.is_empty() {
        None
    } else {
        let t0 = Instant::now();
        // A failed labelling pass is a missing block: the rule decides.
        let labels = label_pass(engine, seq, tokens, pending, &segs, source).unwrap_or(None);
        report.label_secs = t0.elapsed().as_secs_f64();
        report.labels_valid = Some(labels.is_some());
        report.labels = labels.clone().unwrap_or_default();
        labels
    };
    let stop: Vec<u32> = ["<|im_start|>", "<|im_end|>"]
        .iter()
        .filter_map(|t| tok.token_id(t))
        .chain([tok.eos])
        .collect();
    let input = TurnInput {
        cuts,
        tokens: tokens.to_vec(),
        stop,
        refer: Some(start as u64..reply as u64),
        model,
    };
    let done = engine.cache.end_turn_labelled(seq, &input)?;
    let o = done.outcome;
    report.fallback = o.fallback;
    report.queued = o.queued;
    report.revived = o.revived;
    report.reclaimed = o.reclaimed;
    report.dropped_entries = done.dropped_entries;
    let t0 = Instant::now();
    for seg in o.compress {
        let summary = if pending.last() == Some(&tok.eos) {
            summarise(engine, tokens, &seg).unwrap_or_default()
        } else {
            // The reply was cut off: no place for a system message yet.
            Vec::new()
        };
        let replaced = !summary.is_empty() && summary.len() < seg.len() as usize;
        if replaced {
            let text = tok.decode_text(&summary)?;
            pending.extend(tok.encode("\n<|im_start|>system\nSummary of earlier context: ")?);
            let before = pending.len();
            pending.extend(tok.encode_text(text.trim())?);
            report.summary_tokens += pending.len() - before;
            pending.extend(tok.encode("<|im_end|>")?);
            report.compressed += 1;
        } else {
            report.compress_refused += 1;
        }
        report.dropped_entries += engine.cache.compressed(seq, seg, replaced)?;
    }
    report.compress_secs = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Where the sentence segments of a turn (`tokens[start..]`) start, after
/// the first, as positions: the cuts a turn end takes.
pub fn segment_cuts(tok: &Tokenizer, tokens: &[u32], start: usize) -> Vec<u64> {
    let pieces = tok.pieces();
    let turn: Vec<&str> = tokens[start.min(tokens.len())..]
        .iter()
        .map(|&t| pieces.get(t as usize).map_or("", String::as_str))
        .collect();
    split_sentences(&turn, MIN_SEGMENT_TOKENS)
        .iter()
        .skip(1)
        .map(|r| (start + r.start) as u64)
        .collect()
}

/// Asks the model to label `segs` on a fork of the session; `None` when
/// its answer does not parse into a valid block.
fn label_pass(
    engine: &Engine,
    seq: &Sequence,
    tokens: &[u32],
    pending: &[u32],
    segs: &[Segment],
    source: LabelSource,
) -> Result<Option<Vec<Label>>> {
    let tok = &engine.tokenizer;
    let mut listing = String::from(LABEL_CRITERIA);
    for (i, g) in segs.iter().enumerate() {
        let r = g.range.start as usize..(g.range.end as usize).min(tokens.len());
        let text = tok.decode_text(&tokens[r])?;
        let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
        listing.push_str(&format!("seg_{i}: {text}\n"));
    }
    listing.push_str(
        "Answer with one block: [LIFECYCLE] seg_0: <label> seg_1: <label> ... [/LIFECYCLE]",
    );
    let mut prompt = pending.to_vec();
    if pending.last() != Some(&tok.eos) {
        prompt.extend(tok.encode("<|im_end|>")?);
    }
    prompt.extend(tok.encode("\n<|im_start|>user\n")?);
    prompt.extend(tok.encode_text(&listing)?);
    prompt.extend(tok.encode("<|im_end|>\n<|im_start|>assistant\n")?);
    // The fork reads the session's KV as it is (dropped segments gone).
    let mut fork = engine.cache.fork(seq)?;
    let n = segs.len();
    let budget = 16 + 12 * n;
    let text = match source {
        LabelSource::Constrained => engine
            .generate_constrained(&mut fork, &prompt, &LabelGrammar::new(n), budget)
            .map(|c| c.text),
        _ => {
            let params = SamplingParams {
                max_tokens: budget,
                ..SamplingParams::default()
            };
            engine
                .generate(&mut fork, &prompt, &params, &mut |_, _| true)
                .and_then(|g| tok.decode_text(&g.tokens))
        }
    };
    engine.cache.free(&mut fork)?;
    let parsed = parse_labels(&text?, n);
    Ok(parsed.valid().then_some(parsed.labels))
}

/// The model's summary of `seg` (its text alone), at most a third of its
/// tokens; empty if it wrote nothing.
fn summarise(engine: &Engine, tokens: &[u32], seg: &Segment) -> Result<Vec<u32>> {
    let tok = &engine.tokenizer;
    let r = seg.range.start as usize..(seg.range.end as usize).min(tokens.len());
    let text = tok.decode_text(&tokens[r])?;
    let most = (seg.len() as usize / 3).max(1);
    let prompt = tok.chat_ids(&[
        Message::new("system", "You write short, faithful summaries."),
        Message::new(
            "user",
            format!(
                "Summarise in at most {} words, keeping every name and number:\n{}",
                (most * 3 / 4).max(1),
                text.trim()
            ),
        ),
    ])?;
    let mut s = engine
        .cache
        .open(&prompt, &ExtraKeys::namespace("kvforge-summary"))?;
    let params = SamplingParams {
        max_tokens: most,
        ..SamplingParams::default()
    };
    let reused = s.len();
    let g = engine.generate(&mut s, &prompt[reused..], &params, &mut |_, _| true);
    engine.cache.free(&mut s)?;
    let mut out = g?.tokens;
    out.retain(|&t| t != tok.eos);
    Ok(out)
}
