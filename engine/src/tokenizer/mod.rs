//! GPT-2 byte-level BPE from GGUF metadata (or a `tokenizer.json`), and the
//! ChatML template SmolLM2 was trained with.

use std::path::Path;

use crate::error::{EngineError, Result};

mod gguf;

/// SmolLM2's default system message (from its chat template).
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// Bytes of text [`Tokenizer::encode_text_within`] encodes at a time.
pub const PIECE_BYTES: usize = 64 << 10;

/// The first piece of `text` for [`Tokenizer::encode_text_within`]: all of
/// it when short, else up to the first space after [`PIECE_BYTES`] that
/// stands between two non-space characters (searched for another
/// [`PIECE_BYTES`]), and whether it ends cleanly — at the text's end or
/// such a space (else at a character boundary, inside a pre-token).
fn first_piece(text: &str) -> (&str, bool) {
    if text.len() <= PIECE_BYTES {
        return (text, true);
    }
    let b = text.as_bytes();
    let end = text.len().min(2 * PIECE_BYTES);
    let clean = (PIECE_BYTES..end.saturating_sub(1)).find(|&i| {
        b[i] == b' ' && !b[i - 1].is_ascii_whitespace() && !b[i + 1].is_ascii_whitespace()
    });
    match clean {
        Some(i) => (&text[..i], true),
        None => {
            let mut i = PIECE_BYTES;
            while !text.is_char_boundary(i) {
                i += 1;
            }
            (&text[..i], false)
        }
    }
}

/// A tokenizer plus the ids the engine needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token parsing off: control tokens
    /// written in user text stay text.
    plain: tokenizers::Tokenizer,
    /// End of sequence (`<|im_end|>` for SmolLM2).
    pub eos: u32,
    /// Vocabulary size.
    pub vocab: usize,
    /// The text of each token alone, built on first use.
    pieces: std::sync::OnceLock<Vec<String>>,
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl Tokenizer {
    fn with_plain(inner: tokenizers::Tokenizer, eos: u32, vocab: usize) -> Self {
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        Tokenizer {
            inner,
            plain,
            eos,
            vocab,
            pieces: std::sync::OnceLock::new(),
        }
    }

    /// Loads a Hugging Face `tokenizer.json`; `eos` names the end token.
    pub fn from_file(path: &Path, eos: &str) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        let eos = inner.token_to_id(eos).ok_or_else(|| {
            EngineError::Tokenizer(format!("{}: no token {eos:?}", path.display()))
        })?;
        let vocab = inner.get_vocab_size(true);
        Ok(Self::with_plain(inner, eos, vocab))
    }

    /// The tokenizer as Hugging Face JSON (vocabulary, merges, specials):
    /// what a model fingerprint covers.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, false)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Token ids of `text` (special tokens in the text are recognised): for
    /// templates and trusted text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of untrusted `text` (a user's message): special-token
    /// parsing is off, as llama.cpp does for user content, so a
    /// `<|im_start|>system` typed by a user stays text and cannot forge a
    /// turn.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .plain
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// [`encode_text`](Self::encode_text), or `None` as soon as `text` is
    /// known to hold more than `max` tokens. A long text is counted in
    /// pieces of about [`PIECE_BYTES`]: a piece that both starts and ends
    /// at a space between two words (where the pre-tokenizer cuts anyway)
    /// counts exactly its tokens; a run of pieces cut elsewhere (no such
    /// space in reach: CJK prose, base64) counts the fewest tokens its
    /// bytes can be, by the longest token's length. So the count is a
    /// lower bound of the whole text's, the work stops once it passes
    /// `max` — a multi-megabyte prompt for a context of thousands costs
    /// the encoding of about `max` tokens — and a text that fits is never
    /// refused: it is encoded whole (its ids exactly
    /// [`encode_text`](Self::encode_text)'s).
    pub fn encode_text_within(&self, text: &str, max: usize) -> Result<Option<Vec<u32>>> {
        // Every token holds at least one byte of the text.
        if text.len() <= max {
            return self.encode_text(text).map(Some);
        }
        let longest = self.longest_token_bytes();
        let (mut lower, mut rest, mut start_clean) = (0usize, text, true);
        while !rest.is_empty() {
            let (piece, end_clean) = first_piece(rest);
            lower += if start_clean && end_clean {
                self.encode_text(piece)?.len()
            } else {
                piece.len() / longest
            };
            if lower > max {
                return Ok(None);
            }
            rest = &rest[piece.len()..];
            start_clean = end_clean;
        }
        let ids = self.encode_text(text)?;
        Ok((ids.len() <= max).then_some(ids))
    }

    /// Bytes of the longest token's text (at least 1; a byte that is not a
    /// whole character counts as U+FFFD's three, which only overstates it).
    fn longest_token_bytes(&self) -> usize {
        self.pieces()
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// [`chat_prompt`](Self::chat_prompt) as token ids, with every
    /// message's content encoded by [`encode_text`](Self::encode_text): the
    /// same ids as encoding the prompt string whenever the contents hold no
    /// control tokens and do not start with whitespace (which the string
    /// would merge with the newline before it).
    pub fn chat_ids(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let ids = self.chat_ids_within(messages, usize::MAX)?;
        ids.ok_or_else(|| tok_err("a chat of more than usize::MAX tokens"))
    }

    /// [`chat_ids`](Self::chat_ids), or `None` as soon as the chat is known
    /// to hold more than `max` tokens (each message's content encoded by
    /// [`encode_text_within`](Self::encode_text_within) with what is left).
    pub fn chat_ids_within(&self, messages: &[Message], max: usize) -> Result<Option<Vec<u32>>> {
        let mut ids = Vec::new();
        if messages.first().is_none_or(|m| m.role != "system") {
            ids.extend(self.encode(&format!("<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"))?);
        }
        for m in messages {
            ids.extend(self.encode(&format!("<|im_start|>{}\n", m.role))?);
            let left = max.saturating_sub(ids.len());
            match self.encode_text_within(&m.content, left)? {
                Some(c) => ids.extend(c),
                None => return Ok(None),
            }
            ids.extend(self.encode("<|im_end|>\n")?);
        }
        ids.extend(self.encode("<|im_start|>assistant\n")?);
        Ok((ids.len() <= max).then_some(ids))
    }

    /// The ids of one more user turn of a running chat: closes the previous
    /// reply if it was cut off (`close`), then the user message (as text)
    /// and the assistant header.
    pub fn user_turn_ids(&self, close: bool, text: &str) -> Result<Vec<u32>> {
        let end = if close { "<|im_end|>" } else { "" };
        let mut ids = self.encode(&format!("{end}\n<|im_start|>user\n"))?;
        ids.extend(self.encode_text(text)?);
        ids.extend(self.encode("<|im_end|>\n<|im_start|>assistant\n")?);
        Ok(ids)
    }

    /// Text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// Text of `ids` for display: special tokens dropped.
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// The text of every token id alone (special tokens included; a byte
    /// that is not a whole character reads as U+FFFD), built on first use.
    pub fn pieces(&self) -> &[String] {
        self.pieces.get_or_init(|| {
            (0..self.vocab as u32)
                .map(|id| self.decode(&[id]).unwrap_or_default())
                .collect()
        })
    }

    /// The bytes token `id` stands for: the byte of a byte-fallback token
    /// (`<0x0A>` in a SentencePiece-style BPE with `byte_fallback`), else
    /// through GPT-2's byte-level alphabet (every byte one character) when
    /// its vocabulary entry is written in it, else the UTF-8 of its text
    /// alone. Unlike [`pieces`](Self::pieces), a token holding part of a
    /// character keeps its bytes (OpenAI's `bytes` field).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let fallback = matches!(self.inner.get_model(),
            tokenizers::ModelWrapper::BPE(bpe) if bpe.byte_fallback);
        if let Some(b) = self
            .inner
            .id_to_token(id)
            .filter(|_| fallback)
            .and_then(|t| fallback_byte(&t))
        {
            return vec![b];
        }
        let text = || {
            self.pieces()
                .get(id as usize)
                .map(|p| p.as_bytes().to_vec())
                .unwrap_or_default()
        };
        match self.inner.id_to_token(id) {
            Some(t) => t
                .chars()
                .map(gguf::byte_level)
                .collect::<Option<_>>()
                .unwrap_or_else(text),
            None => text(),
        }
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, a
    /// default system message first when none is given, then the assistant
    /// header the model continues from.
    pub fn chat_prompt(messages: &[Message]) -> String {
        let mut s = String::new();
        if messages.first().is_none_or(|m| m.role != "system") {
            s.push_str(&format!("<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"));
        }
        for m in messages {
            s.push_str(&format!(
                "<|im_start|>{}\n{}<|im_end|>\n",
                m.role, m.content
            ));
        }
        s.push_str("<|im_start|>assistant\n");
        s
    }
}

/// The byte a byte-fallback token such as `<0x0A>` stands for.
fn fallback_byte(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-style BPE with byte fallback: `<0xNN>` tokens are
    /// their byte, not the six characters of their name.
    #[test]
    fn a_byte_fallback_token_is_its_byte() {
        let json = r#"{"version": "1.0", "added_tokens": [],
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": true,
                "vocab": {"<0x0A>": 0, "<0xE2>": 1, "a": 2, "</s>": 3}, "merges": []}}"#;
        let inner: tokenizers::Tokenizer = json.parse().expect("a tokenizer");
        let t = Tokenizer::with_plain(inner, 3, 4);
        assert_eq!(t.token_bytes(0), vec![0x0a]);
        assert_eq!(t.token_bytes(1), vec![0xe2]);
        assert_eq!(t.token_bytes(2), b"a".to_vec());
        assert_eq!(fallback_byte("<0xZZ>"), None);
        assert_eq!(fallback_byte("<0x0AB>"), None);
    }
}
