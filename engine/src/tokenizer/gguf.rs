//! The tokenizer a GGUF file stores (`tokenizer.ggml.*`): GPT-2 byte-level
//! BPE, rebuilt as the Hugging Face pipeline SmolLM2's `tokenizer.json`
//! describes; and GPT-2's byte-level alphabet read back into bytes.

use super::{Tokenizer, tok_err};
use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, Value};

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file (`tokenizer.ggml.*`).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("");
        if model != "gpt2" {
            return Err(EngineError::Unsupported(format!(
                "tokenizer model {model:?}; only GPT-2 byte-level BPE (\"gpt2\") is supported"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            g.get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| EngineError::Model(format!("GGUF metadata {key} missing")))?
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        EngineError::Model(format!("GGUF metadata {key}: not a string"))
                    })
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => {
                let bad = || {
                    EngineError::Model(
                        "GGUF metadata tokenizer.ggml.token_type: not an array of integers, one per token"
                            .into(),
                    )
                };
                let a = v.as_array().ok_or_else(bad)?;
                if a.len() != tokens.len() {
                    return Err(bad());
                }
                a.iter()
                    .map(|v| match v {
                        Value::U64(_) | Value::I64(_) => v.as_u64().ok_or_else(bad),
                        _ => Err(bad()),
                    })
                    .collect::<Result<_>>()?
            }
        };
        // Special token ids must name tokens of the vocabulary.
        for key in ["bos", "eos", "unknown", "padding"] {
            let key = format!("tokenizer.ggml.{key}_token_id");
            if let Some(v) = g.get(&key) {
                match v.as_u64() {
                    Some(id) if (id as usize) < tokens.len() => {}
                    _ => {
                        return Err(EngineError::Model(format!(
                            "GGUF metadata {key} = {v:?} is not a token id below the vocabulary size {}",
                            tokens.len()
                        )));
                    }
                }
            }
        }
        // Control (3) and user-defined (4) tokens are matched whole, never split.
        let added: Vec<serde_json::Value> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
            .map(|(i, t)| {
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), serde_json::json!(i)))
            .collect();
        // The same pipeline as SmolLM2's tokenizer.json: single digits, then
        // GPT-2 byte-level BPE.
        let spec = serde_json::json!({
            "version": "1.0",
            "added_tokens": added,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "vocab": vocab, "merges": merges}
        });
        let inner: tokenizers::Tokenizer = spec.to_string().parse().map_err(tok_err)?;
        let eos = g.u64("tokenizer.ggml.eos_token_id")? as u32;
        Ok(Self::with_plain(inner, eos, tokens.len()))
    }
}

/// The byte GPT-2's byte-level alphabet writes as `c`: the printable bytes
/// `!`..`~`, `¡`..`¬` and `®`..`ÿ` as themselves, the other 68 as U+0100
/// onwards in byte order.
pub(super) fn byte_level(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let c = c as u32;
    if printable(c) {
        return Some(c as u8);
    }
    let nth = c.checked_sub(0x100)?;
    (0..=255u32)
        .filter(|&b| !printable(b))
        .nth(nth as usize)
        .map(|b| b as u8)
}
