//! The workloads' items and their inputs: chats with a planted fact,
//! article streams, pass-key prompts in a haystack, tokenized once per run,
//! and the seeds their random choices come from.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kvforge_engine::{Message, Tokenizer};

use crate::config::Experiment;
use crate::inputs::SplitMix;
use crate::workloads::{ChatWorkload, PasskeyWorkload, StreamWorkload};

/// The workloads, in the order every configuration runs them.
pub(crate) const WORKLOADS: [&str; 3] = ["chat", "stream", "passkey"];

/// One unit of work of a workload.
pub(crate) struct Item {
    pub(crate) workload: &'static str,
    pub(crate) name: String,
    /// Chat index, context length, or passkey (length, depth).
    pub(crate) index: usize,
    pub(crate) depth: f64,
    /// A stream's article.
    pub(crate) article: usize,
}

/// Token streams of the workloads, tokenized once.
pub(crate) struct Inputs {
    pub(crate) chat: Option<(ChatWorkload, Vec<Vec<String>>)>,
    /// One token stream per article, each as long as the longest context.
    pub(crate) stream: Option<(StreamWorkload, Vec<Vec<u32>>)>,
    pub(crate) passkey: Option<(PasskeyWorkload, Vec<u32>)>,
    seed: u64,
}

/// The first run of digits in `answer` (empty if none): what is scored.
pub(crate) fn first_number(answer: &str) -> String {
    answer
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect()
}

/// The last user turn of a chat, and the start of the answer.
const RECALL_QUESTION: &str = "What is my locker code?";
pub(crate) const RECALL_PRIMER: &str = "Your locker code is";

/// The system prompt every chat starts with (the shared prefix prefix
/// reuse finds across sessions).
pub(crate) const SYSTEM: &str = "You are SmolLM, a friendly assistant in a long conversation. Answer the user \
in one or two short sentences. Be warm and curious, and keep to the topic the user brings up. \
If the user tells you something about themselves, such as a name, a plan or a number, remember \
it exactly: they may ask for it later, and then you repeat it word for word. Do not invent facts \
about the user. If you do not know something, say so plainly. Never use lists or headings; write \
plain sentences. Do not repeat the question back. Do not greet the user again after the first turn.";

impl Inputs {
    pub(crate) fn load(exp: &Experiment, tok: &Tokenizer, max_ctx: usize) -> Result<Inputs> {
        let w = &exp.workloads;
        let chat = match &w.chat {
            Some(c) => Some((
                c.clone(),
                crate::inputs::load_chats(&c.data, c.turns, c.chats, c.turns..=usize::MAX)?,
            )),
            None => None,
        };
        let stream = match &w.stream {
            Some(s) => {
                let need = s.contexts.iter().copied().max().unwrap_or(0);
                if need.saturating_add(s.decode) > max_ctx {
                    bail!(
                        "workloads.stream: context {need} plus decode {} exceed the model's context of {max_ctx} tokens",
                        s.decode
                    );
                }
                let text = crate::inputs::read_text(&s.data)?;
                let mut articles = kvforge_engine::ppl::articles(&text).into_iter();
                let mut streams = Vec::new();
                for k in 0..s.articles {
                    let mut ids = Vec::new();
                    for a in articles.by_ref() {
                        ids.extend(tok.encode_text(&a)?);
                        if ids.len() >= need {
                            break;
                        }
                    }
                    if ids.len() < need {
                        bail!(
                            "{}: too little text for stream {} of {} ({} tokens left, a stream needs {need})",
                            s.data.display(),
                            k + 1,
                            s.articles,
                            ids.len()
                        );
                    }
                    ids.truncate(need);
                    streams.push(ids);
                }
                Some((s.clone(), streams))
            }
            None => None,
        };
        let passkey = match &w.passkey {
            Some(p) => {
                let need = p.lengths.iter().copied().max().unwrap_or(0);
                if need.saturating_add(PASSKEY_ANSWER) > max_ctx {
                    bail!(
                        "workloads.passkey: length {need} plus the {PASSKEY_ANSWER}-token answer exceed the model's context of {max_ctx} tokens"
                    );
                }
                Some((p.clone(), haystack(&p.data, tok, need)?))
            }
            None => None,
        };
        Ok(Inputs {
            chat,
            stream,
            passkey,
            seed: exp.model.seed,
        })
    }

    pub(crate) fn items(&self) -> Vec<Item> {
        let mut v = Vec::new();
        if let Some((_, chats)) = &self.chat {
            for i in 0..chats.len() {
                v.push(Item {
                    workload: "chat",
                    name: format!("chat{i}"),
                    index: i,
                    depth: 0.0,
                    article: 0,
                });
            }
        }
        if let Some((s, _)) = &self.stream {
            for article in 0..s.articles {
                for &c in &s.contexts {
                    v.push(Item {
                        workload: "stream",
                        // One article keeps the name it always had.
                        name: match s.articles {
                            1 => format!("ctx{c}"),
                            _ => format!("a{article}-ctx{c}"),
                        },
                        index: c,
                        depth: 0.0,
                        article,
                    });
                }
            }
        }
        if let Some((p, _)) = &self.passkey {
            for &l in &p.lengths {
                for &d in &p.depths {
                    v.push(Item {
                        workload: "passkey",
                        name: format!("len{l}-depth{d:.2}"),
                        index: l,
                        depth: d,
                        article: 0,
                    });
                }
            }
        }
        v
    }
}

/// One pass-key item's tokens: what is prefilled (compressed by the
/// cache's policies as it streams in), and the question asked after it.
pub struct PasskeyPrompt {
    /// The five-digit key.
    pub key: u64,
    /// Instructions, haystack with the needle at its depth.
    pub context: Vec<u32>,
    /// `What is the pass key? The pass key is` (a completion prompt).
    pub question: Vec<u32>,
}

impl PasskeyPrompt {
    /// What is prefilled (and compressed) and what is asked after it: the
    /// context and the question, or, when the compression is to see the
    /// question, everything but the question's last token and that token.
    pub fn split(&self, question_seen: bool) -> (Vec<u32>, Vec<u32>) {
        match self.question.split_last() {
            Some((last, head)) if question_seen => {
                let mut context = self.context.clone();
                context.extend_from_slice(head);
                (context, vec![*last])
            }
            _ => (self.context.clone(), self.question.clone()),
        }
    }
}

/// The pass-key item of `length` tokens (context and question) with the
/// needle at `depth` of the haystack `hay`; the key comes from `seed`.
pub fn passkey_prompt(
    tok: &Tokenizer,
    hay: &[u32],
    length: usize,
    depth: f64,
    seed: u64,
) -> Result<PasskeyPrompt> {
    let key = 10_000 + SplitMix::new(seed).next_u64() % 90_000;
    // A completion prompt (no chat template): SmolLM2-135M answers it,
    // it does not answer the same text as a chat turn.
    let head = tok.encode_text(
        "There is an important pass key hidden inside a lot of irrelevant text. \
         Find it and memorize it. I will quiz you about the pass key.\n",
    )?;
    let needle = tok.encode_text(&format!(
        "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    ))?;
    let question = tok.encode_text("\nWhat is the pass key? The pass key is")?;
    let fixed = head.len() + needle.len() + question.len();
    let Some(room) = length.checked_sub(fixed).filter(|&r| r > 0) else {
        bail!("a {length}-token prompt has no room for a haystack ({fixed} tokens of frame)");
    };
    let cut = ((room as f64) * depth).round() as usize;
    let mut context = head;
    context.extend(&hay[..cut]);
    context.extend(&needle);
    context.extend(&hay[cut..room]);
    Ok(PasskeyPrompt {
        key,
        context,
        question,
    })
}

/// A chat's planted code and its user messages: the code in the second,
/// the recall question after the last.
pub(crate) fn chat_users(chat: &[String], seed: u64) -> (u64, Vec<String>) {
    let code = 1000 + SplitMix::new(seed).next_u64() % 9000;
    let mut users: Vec<String> = chat.to_vec();
    if let Some(second) = users.get_mut(1) {
        *second = format!("By the way, my locker code is {code}. Please remember it. {second}");
    }
    users.push(RECALL_QUESTION.into());
    (code, users)
}

/// The seed of a pass-key item's key.
pub(crate) fn passkey_seed(inputs: &Inputs, item: &Item) -> u64 {
    inputs.seed ^ (item.index as u64) << 8 ^ (item.depth * 1000.0) as u64
}

/// The essays of `dir` in name order, tokenized until `need` tokens.
fn haystack(dir: &Path, tok: &Tokenizer, need: usize) -> Result<Vec<u32>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut ids = Vec::new();
    for f in files {
        let text = crate::inputs::read_text(&f)?;
        ids.extend(tok.encode_text(&format!("{}\n\n", text.trim()))?);
        if ids.len() >= need {
            return Ok(ids);
        }
    }
    bail!(
        "{}: the essays hold fewer than {need} tokens",
        dir.display()
    )
}

/// The seed of `item`'s random choices (none for a stream).
pub(crate) fn item_seed(inputs: &Inputs, item: &Item) -> Option<u64> {
    match item.workload {
        "chat" => Some(chat_seed(inputs, item)),
        "passkey" => Some(passkey_seed(inputs, item)),
        _ => None,
    }
}

pub(crate) fn chat_seed(inputs: &Inputs, item: &Item) -> u64 {
    inputs.seed ^ item.index as u64
}

/// Greedy tokens of a pass-key answer.
pub(crate) const PASSKEY_ANSWER: usize = 8;

/// Every chat fits the model's context even if each answer runs to
/// `answer_tokens` (positions past the context fail the item mid-run).
pub(crate) fn check_fits(inputs: &Inputs, tok: &Tokenizer, max_ctx: usize) -> Result<()> {
    let Some((w, chats)) = &inputs.chat else {
        return Ok(());
    };
    for (i, chat) in chats.iter().enumerate() {
        // The system prompt and the first turn; the planted fact's sentence
        // (32 tokens cover it); the other turns, the recall question and
        // its primer; an answer after each.
        let first = [
            Message::new("system", SYSTEM),
            Message::new("user", &chat[0]),
        ];
        let mut need = tok.chat_ids(&first)?.len() + 32 + tok.encode_text(RECALL_PRIMER)?.len();
        for text in chat[1..]
            .iter()
            .map(String::as_str)
            .chain([RECALL_QUESTION])
        {
            need += tok.user_turn_ids(true, text)?.len();
        }
        need += w.answer_tokens * (chat.len() + 1);
        if need > max_ctx {
            bail!(
                "workloads.chat: chat {i} may need {need} positions (its turns plus answer_tokens = {} per answer), more than the model's context of {max_ctx} tokens",
                w.answer_tokens
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::PasskeyPrompt;

    /// Seen or not, the same tokens in the same order; seen, the question
    /// but its last token is prefilled with the context.
    #[test]
    fn a_seen_question_is_prefilled_with_the_context_but_its_last_token() {
        let p = PasskeyPrompt {
            key: 12345,
            context: vec![1, 2, 3],
            question: vec![7, 8, 9],
        };
        assert_eq!(p.split(false), (vec![1, 2, 3], vec![7, 8, 9]));
        assert_eq!(p.split(true), (vec![1, 2, 3, 7, 8], vec![9]));
        let empty = PasskeyPrompt {
            question: vec![],
            ..p
        };
        assert_eq!(empty.split(true), (vec![1, 2, 3], vec![]));
    }
}
