//! A reply's text as its tokens arrive: decoded incrementally in whole
//! characters (the engine's [`Detokenizer`]), cut before the first stop
//! string, and held back while its end could still become one.

use kvforge_engine::{Detokenizer, EngineError, Tokenizer};

/// The text of one reply so far.
#[derive(Debug, Default)]
pub(super) struct Reply {
    detok: Detokenizer,
    /// The reply's text decoded so far.
    text: String,
    /// Bytes of `text` already sent to the client.
    sent: usize,
}

/// What a new token made of the reply.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Piece {
    /// Text to send now (may be empty).
    pub(super) text: String,
    /// A stop string was reached: the reply ends (before it).
    pub(super) stopped: bool,
}

impl Reply {
    /// The text that token `id` (`None`: no new token) adds to the reply;
    /// at `last` (the reply ends after it) everything held back goes out.
    pub(super) fn piece(
        &mut self,
        tok: &Tokenizer,
        id: Option<u32>,
        stop: &[String],
        last: bool,
    ) -> Result<Piece, EngineError> {
        if let Some(id) = id {
            let p = self.detok.step(tok, id)?;
            self.text.push_str(&p);
        }
        if last {
            let rest = self.detok.finish(tok)?;
            self.text.push_str(&rest);
        }
        let text = std::mem::take(&mut self.text);
        let p = self.cut(&text, stop, last);
        self.text = text;
        Ok(p)
    }

    pub(super) fn cut(&mut self, text: &str, stop: &[String], last: bool) -> Piece {
        let from = self.sent.min(text.len());
        // A stop string may start in text already sent (held back until
        // now), never before it.
        let found = stop
            .iter()
            .filter_map(|s| {
                let start = floor_boundary(text, from.saturating_sub(s.len()));
                text[start..].find(s.as_str()).map(|i| i + start)
            })
            .min();
        if let Some(at) = found {
            let out = text.get(from..at.max(from)).unwrap_or_default().to_string();
            self.sent = at.max(from);
            return Piece {
                text: out,
                stopped: true,
            };
        }
        let mut end = text.len();
        if !last {
            // An unfinished character decodes as U+FFFD: wait for it.
            if let Some(t) = text.strip_suffix('\u{fffd}') {
                end = t.len();
            }
            end -= held_back(&text[..end], stop);
        }
        let end = end.max(from);
        let out = text.get(from..end).unwrap_or_default().to_string();
        self.sent = end;
        Piece {
            text: out,
            stopped: false,
        }
    }
}

/// The largest character boundary of `text` at or below `i`.
fn floor_boundary(text: &str, i: usize) -> usize {
    let mut i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Bytes at the end of `text` that begin some stop string (they might
/// become it), on a character boundary.
fn held_back(text: &str, stop: &[String]) -> usize {
    let mut hold = 0;
    for s in stop {
        for (i, _) in s.char_indices().skip(1) {
            if text.ends_with(&s[..i]) {
                hold = hold.max(i);
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str], stop: &[&str]) -> (String, bool) {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut r = Reply::default();
        let mut text = String::new();
        let mut out = String::new();
        for (i, c) in chunks.iter().enumerate() {
            text.push_str(c);
            let p = r.cut(&text, &stop, i + 1 == chunks.len());
            out.push_str(&p.text);
            if p.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn text_is_cut_before_a_stop_string_spread_over_tokens() {
        assert_eq!(
            run(&["Hello", " wor", "ld!", " more"], &["world"]),
            ("Hello ".into(), true)
        );
        assert_eq!(run(&["a", "b", "c"], &["x"]), ("abc".into(), false));
        // A held-back prefix that does not become the stop string goes out.
        assert_eq!(
            run(&["ab", "wo", "rk"], &["world"]),
            ("abwork".into(), false)
        );
        assert_eq!(run(&["ab", "wo"], &["world"]), ("abwo".into(), false));
        // The earliest of several stop strings wins.
        assert_eq!(
            run(&["one two three"], &["three", "two"]),
            ("one ".into(), true)
        );
        assert_eq!(run(&["Stop"], &["Stop"]), (String::new(), true));
        // Multi-byte characters: a stop string after or made of them.
        assert_eq!(
            run(&["日本", "語です", "ね"], &["です"]),
            ("日本語".into(), true)
        );
        assert_eq!(run(&["ééé", "x", "yz"], &["xy"]), ("ééé".into(), true));
        assert_eq!(run(&["aé", "bé"], &["éb"]), ("a".into(), true));
    }

    #[test]
    fn a_stop_prefix_before_an_unfinished_character_is_held_back() {
        let stop = vec!["ab".to_string()];
        let mut r = Reply::default();
        let p = r.cut("xa\u{fffd}", &stop, false);
        assert_eq!(p.text, "x");
        let p = r.cut("xab", &stop, false);
        assert!(p.stopped);
        assert_eq!(p.text, "");
    }

    #[test]
    fn an_unfinished_character_waits() {
        let mut r = Reply::default();
        let p = r.cut("ab\u{fffd}", &[], false);
        assert_eq!(p.text, "ab");
        let p = r.cut("abé", &[], false);
        assert_eq!(p.text, "é");
    }
}
