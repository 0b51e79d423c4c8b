//! Semantic segments: a turn's tokens cut at sentence and paragraph ends.
//!
//! Works on the decoded text of each token (its "piece"), so it serves any
//! tokenizer: a segment ends after a token that ends a sentence (`.`, `!`,
//! `?`, optionally followed by closing quotes or brackets) when the next
//! token starts with white space, after a token holding a line break, and
//! after a special token (`<|im_end|>`, ...). Pieces shorter than
//! `min_tokens` join the segment before them (the first joins the next), so
//! "Ok." does not become a segment of its own.

use std::ops::Range;

fn is_special(piece: &str) -> bool {
    piece.len() > 2 && piece.starts_with('<') && piece.ends_with('>')
}

fn ends_sentence(piece: &str) -> bool {
    let t = piece.trim_end_matches(['"', '\'', ')', ']', '”', '’']);
    t.ends_with(['.', '!', '?'])
}

/// Cuts `pieces` (one decoded string per token) into segments of at least
/// `min_tokens` tokens (except when there are fewer tokens in all). The
/// ranges tile `0..pieces.len()`, ascending; empty input gives none.
pub fn split_sentences<S: AsRef<str>>(pieces: &[S], min_tokens: usize) -> Vec<Range<usize>> {
    let n = pieces.len();
    let mut cuts = Vec::new();
    for i in 0..n {
        let p = pieces[i].as_ref();
        let next_ws = pieces
            .get(i + 1)
            .is_none_or(|q| q.as_ref().starts_with(char::is_whitespace));
        let next_special = pieces.get(i + 1).is_some_and(|q| is_special(q.as_ref()));
        if p.contains('\n') || is_special(p) || next_special || (ends_sentence(p) && next_ws) {
            cuts.push(i + 1);
        }
    }
    if cuts.last() != Some(&n) {
        cuts.push(n);
    }
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut start = 0;
    for c in cuts {
        if c <= start {
            continue;
        }
        let r = start..c;
        start = c;
        match out.last_mut() {
            // Too short: joins the one before.
            Some(prev) if r.len() < min_tokens => prev.end = r.end,
            _ => out.push(r),
        }
        // The first piece too short: the next joins it.
        if out.len() == 2 && out[0].len() < min_tokens {
            let second = out.pop().map_or(0, |r| r.end);
            out[0].end = second;
        }
    }
    out
}
