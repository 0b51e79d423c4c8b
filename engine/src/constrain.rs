//! Constrained decoding: greedy generation that only ever emits text a
//! grammar can still accept, so even a small model always produces a
//! well-formed answer (a label block, a JSON object, a number...).
//!
//! A [`Constraint`] says whether a text is a sentence of its grammar, a
//! prefix of one, or neither. Each step takes the tokens in order of their
//! logits and emits the first whose text keeps the output viable — the
//! most likely token the grammar allows — until the output is complete.

use kvforge_lifecycle::{LabelGrammar, Viability};

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::{EngineError, Result};

/// A grammar over text.
pub trait Constraint {
    /// Whether `text` is a sentence, a prefix of one, or neither.
    fn check(&self, text: &str) -> Viability;
}

impl Constraint for LabelGrammar {
    fn check(&self, text: &str) -> Viability {
        LabelGrammar::check(self, text)
    }
}

/// What [`Engine::generate_constrained`] produced.
#[derive(Clone, Debug, Default)]
pub struct Constrained {
    /// The tokens emitted.
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
    /// Whether the text is a whole sentence (else `max_tokens` ran out).
    pub complete: bool,
    /// Steps whose most likely token the grammar refused.
    pub overridden: usize,
}

impl Engine {
    /// Prefills `prompt` after what `seq` holds, then decodes greedily
    /// under `c` for at most `max_tokens` tokens, stopping as soon as the
    /// text is complete. A step where no token keeps the text viable is an
    /// error (the grammar needs a character no token spells).
    pub fn generate_constrained(
        &self,
        seq: &mut Sequence,
        prompt: &[u32],
        c: &dyn Constraint,
        max_tokens: usize,
    ) -> Result<Constrained> {
        if prompt.is_empty() {
            return Err(EngineError::Request("empty prompt".into()));
        }
        let ctx = self.model.cfg.max_ctx;
        if seq.len() + prompt.len() + max_tokens >= ctx {
            return Err(EngineError::Request(format!(
                "a constrained answer of up to {max_tokens} tokens after {} does not fit the {ctx}-token context",
                seq.len() + prompt.len()
            )));
        }
        let pieces = self.tokenizer.pieces();
        let mut out = Constrained::default();
        let mut logits = self
            .model
            .forward(prompt, &mut self.cache.view(seq), false)?;
        while out.tokens.len() < max_tokens {
            let row = logits.f_get(0)?.f_to_kind(tch::Kind::Float)?;
            let row = Vec::<f32>::try_from(row)?;
            let mut order: Vec<u32> = (0..row.len().min(pieces.len()) as u32).collect();
            order.sort_unstable_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            let mut chosen = None;
            for (rank, &id) in order.iter().enumerate() {
                let mut t = out.text.clone();
                t.push_str(&pieces[id as usize]);
                let v = c.check(&t);
                if v != Viability::Dead {
                    out.overridden += usize::from(rank > 0);
                    chosen = Some((id, t, v));
                    break;
                }
            }
            let Some((id, text, v)) = chosen else {
                return Err(EngineError::Request(format!(
                    "no token continues {:?} under the constraint",
                    out.text
                )));
            };
            out.tokens.push(id);
            out.text = text;
            if v == Viability::Complete {
                out.complete = true;
                break;
            }
            logits = self
                .model
                .forward(&[id], &mut self.cache.view(seq), false)?;
        }
        Ok(out)
    }
}
