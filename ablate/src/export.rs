//! The run's inputs written out, the same for every configuration
//! (`inputs.jsonl`: every item's seed and token ids; `passkey_items.jsonl`:
//! the pass-key prompts), so that another implementation can run the very
//! same tokens.

use std::path::Path;

use anyhow::{Context, Result};
use kvforge_engine::Tokenizer;

use crate::items::{
    Inputs, Item, SYSTEM, chat_seed, chat_users, item_seed, passkey_prompt, passkey_seed,
};

/// Writes every pass-key item of the run (name, length, depth, key, context
/// and question token ids) to `passkey_items.jsonl` in `out`, so that
/// another implementation (`scripts/kvpress_passkey.py`) can run the very
/// same tokens.
pub(crate) fn export_passkey(
    inputs: &Inputs,
    items: &[Item],
    tok: &Tokenizer,
    out: &Path,
) -> Result<()> {
    let Some((w, hay)) = &inputs.passkey else {
        return Ok(());
    };
    let mut lines = String::new();
    for item in items.iter().filter(|i| i.workload == "passkey") {
        let p = passkey_prompt(tok, hay, item.index, item.depth, passkey_seed(inputs, item))?;
        let (context, question) = p.split(w.question_seen);
        let line = serde_json::json!({
            "item": item.name,
            "length": item.index,
            "depth": item.depth,
            "key": p.key.to_string(),
            "question_seen": w.question_seen,
            "context": context,
            "question": question,
        });
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    let path = out.join("passkey_items.jsonl");
    std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))
}

/// Writes every item's seed and token ids to `inputs.jsonl` in `out`
/// (the same for every configuration): a chat's code and each user
/// message's ids (the answers between them are the model's own), a
/// stream's ids, a pass key's key, context and question.
pub(crate) fn export_inputs(
    inputs: &Inputs,
    items: &[Item],
    tok: &Tokenizer,
    out: &Path,
) -> Result<()> {
    let mut lines = String::new();
    for item in items {
        let seed = item_seed(inputs, item);
        let line = match item.workload {
            "chat" => {
                let (_, chats) = inputs.chat.as_ref().context("no chat workload")?;
                let (code, users) = chat_users(&chats[item.index], chat_seed(inputs, item));
                let ids = users
                    .iter()
                    .map(|u| tok.encode_text(u))
                    .collect::<Result<Vec<_>, _>>()?;
                serde_json::json!({"workload": "chat", "item": item.name, "seed": seed,
                    "code": code.to_string(), "system": SYSTEM, "users": ids})
            }
            "stream" => {
                let (_, ids) = inputs.stream.as_ref().context("no stream workload")?;
                serde_json::json!({"workload": "stream", "item": item.name,
                    "article": item.article, "tokens": &ids[item.article][..item.index]})
            }
            _ => {
                let (w, hay) = inputs.passkey.as_ref().context("no passkey workload")?;
                let p =
                    passkey_prompt(tok, hay, item.index, item.depth, passkey_seed(inputs, item))?;
                let (context, question) = p.split(w.question_seen);
                serde_json::json!({"workload": "passkey", "item": item.name, "seed": seed,
                    "key": p.key.to_string(), "context": context, "question": question})
            }
        };
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    let path = out.join("inputs.jsonl");
    std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))
}
