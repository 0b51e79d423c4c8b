//! The `[LIFECYCLE]` block a model appends to its reply, labelling the
//! context's segments:
//!
//! ```text
//! [LIFECYCLE] seg_0: keep seg_1: drop seg_2: compress [/LIFECYCLE]
//! ```
//!
//! [`parse_labels`] is tolerant, because small models write it loosely:
//! tags and labels in any case, spaces inside the brackets, `seg_3`, `seg 3`,
//! `seg-3`, `segment_3`, `:` or `=` or nothing before the label, entries
//! separated by spaces, commas, semicolons or new lines; a block cut off
//! before its closing tag still counts. A segment without a label is kept,
//! an unknown label or a segment that does not exist is ignored (counted),
//! a later label for the same segment wins, and every block is removed from
//! the text so that it never enters the next turn's context.

use std::ops::Range;

/// What to do with a segment.
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Label {
    /// Keep its KV as it is.
    Keep,
    /// Replace it with a summary.
    Compress,
    /// Drop it (after the delay of reclamation).
    Drop,
}

impl Label {
    /// The label a word names (`keep`, `retain`; `compress`, `summarize`,
    /// `summarise`; `drop`, `remove`, `discard`), in any case.
    pub fn from_word(w: &str) -> Option<Label> {
        match w.to_ascii_lowercase().as_str() {
            "keep" | "retain" => Some(Label::Keep),
            "compress" | "summarize" | "summarise" => Some(Label::Compress),
            "drop" | "remove" | "discard" => Some(Label::Drop),
            _ => None,
        }
    }
}

/// What [`parse_labels`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The text with every block removed.
    pub text: String,
    /// One label per segment (`Keep` where none was given).
    pub labels: Vec<Label>,
    /// Blocks found (complete or cut off).
    pub blocks: u32,
    /// Whether the last block had its closing tag.
    pub complete: bool,
    /// Segments given a label by the blocks.
    pub labelled: u32,
    /// Entries ignored: an unknown label, a segment that does not exist, a
    /// segment without a label.
    pub ignored: u32,
}

impl Parsed {
    /// Whether the model's block is usable: present, closed, and
    /// labelling at least one segment without ignored entries.
    pub fn valid(&self) -> bool {
        self.blocks > 0 && self.complete && self.labelled > 0 && self.ignored == 0
    }
}

const OPEN: &str = "lifecycle";

/// Finds a tag `[ lifecycle ]` (`close`: `[ / lifecycle ]`) at or after
/// byte `from` of `lower` (the text, ASCII-lowercased: same byte offsets).
/// Returns its byte range.
fn find_tag(lower: &[u8], from: usize, close: bool) -> Option<Range<usize>> {
    let mut i = from;
    while i < lower.len() {
        let start = i + lower[i..].iter().position(|&b| b == b'[')?;
        let mut j = start + 1;
        let skip_ws = |j: &mut usize| {
            while *j < lower.len() && lower[*j].is_ascii_whitespace() {
                *j += 1;
            }
        };
        skip_ws(&mut j);
        let slash = j < lower.len() && lower[j] == b'/';
        if slash {
            j += 1;
            skip_ws(&mut j);
        }
        if slash == close && lower[j..].starts_with(OPEN.as_bytes()) {
            j += OPEN.len();
            skip_ws(&mut j);
            if j < lower.len() && lower[j] == b']' {
                return Some(start..j + 1);
            }
        }
        i = start + 1;
    }
    None
}

/// Parses the entries of one block's body into `labels`.
fn parse_body(body: &str, labels: &mut [Label], p: &mut Parsed) {
    // Tokens: runs of ASCII letters, or of digits; everything else separates.
    let mut toks: Vec<&str> = Vec::new();
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let kind = |c: u8| {
            if c.is_ascii_alphabetic() {
                1
            } else if c.is_ascii_digit() {
                2
            } else {
                0
            }
        };
        let k = kind(b[i]);
        if k == 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && kind(b[i]) == k {
            i += 1;
        }
        // ASCII runs start and end on char boundaries.
        toks.push(&body[start..i]);
    }
    let mut t = 0;
    while t < toks.len() {
        let word = toks[t].to_ascii_lowercase();
        if word != "seg" && word != "segment" {
            t += 1;
            continue;
        }
        let Some(id) = toks.get(t + 1).filter(|s| s.as_bytes()[0].is_ascii_digit()) else {
            p.ignored += 1;
            t += 1;
            continue;
        };
        let label = toks.get(t + 2).and_then(|w| Label::from_word(w));
        let seg = id.parse::<usize>().ok().filter(|&s| s < labels.len());
        match (seg, label) {
            (Some(s), Some(l)) => {
                labels[s] = l;
                p.labelled += 1;
                t += 3;
            }
            _ => {
                p.ignored += 1;
                t += 2;
            }
        }
    }
}

/// Parses every `[LIFECYCLE]` block of `text` for a context of `segments`
/// segments. Never panics; never labels a segment `>= segments`; the text
/// returned holds no opening tag (removing a block can join a tag from the
/// text around it: that one is parsed and removed too).
pub fn parse_labels(text: &str, segments: usize) -> Parsed {
    let mut p = Parsed {
        text: text.to_owned(),
        labels: Vec::new(),
        blocks: 0,
        complete: false,
        labelled: 0,
        ignored: 0,
    };
    let mut labels = vec![Label::Keep; segments];
    // Each pass removes at least one tag's bytes, so this ends.
    while let Some(rest) = one_pass(&p.text.clone(), &mut labels, &mut p) {
        p.text = rest;
    }
    p.labels = labels;
    p
}

/// Removes and parses the blocks of `text`; `None` if there is none.
fn one_pass(text: &str, labels: &mut [Label], p: &mut Parsed) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let lower = lower.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    let mut found = false;
    while let Some(open) = find_tag(lower, at, false) {
        found = true;
        out.push_str(&text[at..open.start]);
        p.blocks += 1;
        // The body ends at the closing tag, or at the next opening tag, or
        // at the end of the text (cut off).
        let close = find_tag(lower, open.end, true);
        let next = find_tag(lower, open.end, false);
        let (end, resume, complete) = match (close, next) {
            (Some(c), Some(n)) if n.start < c.start => (n.start, n.start, false),
            (Some(c), _) => (c.start, c.end, true),
            (None, Some(n)) => (n.start, n.start, false),
            (None, None) => (text.len(), text.len(), false),
        };
        parse_body(&text[open.end..end], labels, p);
        p.complete = complete;
        at = resume;
    }
    out.push_str(&text[at..]);
    found.then_some(out)
}

/// How far a text is from a sentence of a grammar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Viability {
    /// No continuation makes it a sentence.
    Dead,
    /// A prefix of a sentence.
    Open,
    /// A whole sentence.
    Complete,
}

/// The canonical label block for `segments` segments, as a grammar for
/// constrained decoding: `[LIFECYCLE] seg_0: L seg_1: L … [/LIFECYCLE]`,
/// every segment once and in order, `L` one of `keep`, `compress`, `drop`.
/// A text that is [`Complete`](Viability::Complete) always parses with
/// [`parse_labels`] into a [`valid`](Parsed::valid) block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LabelGrammar {
    segments: usize,
}

const WORDS: [&str; 3] = ["keep", "compress", "drop"];

impl LabelGrammar {
    /// The grammar of a block labelling `segments` segments.
    pub fn new(segments: usize) -> Self {
        LabelGrammar { segments }
    }

    /// The block that gives `labels`, in the grammar.
    pub fn render(labels: &[Label]) -> String {
        let mut s = String::from("[LIFECYCLE]");
        for (i, l) in labels.iter().enumerate() {
            let w = match l {
                Label::Keep => WORDS[0],
                Label::Compress => WORDS[1],
                Label::Drop => WORDS[2],
            };
            s.push_str(&format!(" seg_{i}: {w}"));
        }
        s.push_str(" [/LIFECYCLE]");
        s
    }

    /// Whether `text` is a block of the grammar, a prefix of one, or
    /// neither.
    pub fn check(&self, text: &str) -> Viability {
        // `Err(v)`: decided before the end of the grammar.
        fn lit<'a>(rest: &'a str, l: &str) -> Result<&'a str, Viability> {
            if rest.len() < l.len() {
                Err(if l.starts_with(rest) {
                    Viability::Open
                } else {
                    Viability::Dead
                })
            } else {
                rest.strip_prefix(l).ok_or(Viability::Dead)
            }
        }
        let walk = || -> Result<&str, Viability> {
            let mut rest = lit(text, "[LIFECYCLE]")?;
            for i in 0..self.segments {
                rest = lit(rest, &format!(" seg_{i}: "))?;
                if WORDS
                    .iter()
                    .any(|w| rest.len() < w.len() && w.starts_with(rest))
                {
                    return Err(Viability::Open);
                }
                let w = WORDS
                    .iter()
                    .find(|w| rest.starts_with(*w))
                    .ok_or(Viability::Dead)?;
                rest = &rest[w.len()..];
            }
            lit(rest, " [/LIFECYCLE]")
        };
        match walk() {
            Ok("") => Viability::Complete,
            Ok(_) => Viability::Dead,
            Err(v) => v,
        }
    }
}
