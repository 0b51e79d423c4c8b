//! [`Detokenizer`]: the text of generated tokens piece by piece, for the
//! cost of the tokens since the last piece (vLLM's and HF's incremental
//! detokenization), not of the whole reply at every token.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// The text of a stream of generated tokens, piece by piece, for the cost
/// of a few tokens per step rather than the whole reply (vLLM's and HF's
/// incremental detokenization): each step decodes only the tokens since
/// the start of the last piece emitted, that piece's tokens being the
/// context that leading spaces and merged bytes need. A character still
/// unfinished (U+FFFD at the end) waits for the next token.
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    /// The last piece's tokens, then those not yet emitted.
    ids: Vec<u32>,
    /// Bytes of the text of `ids` already emitted.
    emitted: usize,
    /// Tokens of `ids` whose text was emitted.
    read: usize,
}

impl Detokenizer {
    /// The text token `id` completes ("" while a character is unfinished).
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode_text(&self.ids)?;
        if text.ends_with('\u{fffd}') || text.len() <= self.emitted {
            return Ok(String::new());
        }
        let piece = text.get(self.emitted..).unwrap_or_default().to_string();
        if piece.is_empty() {
            // Not on a character boundary (earlier text changed): wait.
            return Ok(piece);
        }
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.emitted = tok.decode_text(&self.ids)?.len();
        Ok(piece)
    }

    /// Everything still held back (an unfinished character as U+FFFD);
    /// the stream starts over after it.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let text = tok.decode_text(&self.ids)?;
        let rest = text.get(self.emitted..).unwrap_or_default().to_string();
        *self = Detokenizer::default();
        Ok(rest)
    }
}
