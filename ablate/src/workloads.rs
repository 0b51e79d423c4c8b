//! The workloads of an experiment file: chats with a planted fact,
//! streaming perplexity, pass key retrieval; their settings and the checks
//! of them.

use std::path::PathBuf;

use serde::Deserialize;

/// The workloads; an absent one is not run.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Workloads {
    /// Multi-turn chats with a planted fact.
    pub chat: Option<ChatWorkload>,
    /// Streaming perplexity over long articles.
    pub stream: Option<StreamWorkload>,
    /// Pass key retrieval in a haystack of essays.
    pub passkey: Option<PasskeyWorkload>,
}

/// Multi-turn chats from `chitchat`: each chat is one session; the second
/// user message plants a fact (a four-digit code) and a last turn asks for
/// it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ChatWorkload {
    /// `chitchat-dataset`'s `dataset.json`.
    pub data: PathBuf,
    /// Conversations.
    pub chats: usize,
    /// User turns taken from each (the recall question comes after them).
    pub turns: usize,
    /// Greedy tokens per answer at most.
    pub answer_tokens: usize,
}

/// Streaming perplexity: prefill `prefix` tokens, feed the rest in chunks
/// through the cache, score every token after the prefix; then time
/// `decode` greedy steps.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamWorkload {
    /// An exllamav2-style `<doc>` file (`wiki.utf8`).
    pub data: PathBuf,
    /// Context lengths, one item each per article (articles concatenated,
    /// longest first, up to the length).
    pub contexts: Vec<usize>,
    /// Streams of distinct text: the longest articles are taken in turn,
    /// each stream concatenating the next ones until it holds the longest
    /// context; every stream is an item at every context.
    #[serde(default = "one")]
    pub articles: usize,
    /// Tokens prefilled before scoring.
    pub prefix: usize,
    /// Tokens per streamed chunk.
    pub chunk: usize,
    /// Greedy decode steps timed at the end.
    pub decode: usize,
}

/// Pass key retrieval: a five-digit key planted at a depth of a haystack of
/// essays; the haystack is prefilled in chunks (so eviction acts while it
/// streams in), then the question is asked.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PasskeyWorkload {
    /// A folder of `.txt` essays (`PaulGrahamEssays`).
    pub data: PathBuf,
    /// Prompt lengths in tokens.
    pub lengths: Vec<usize>,
    /// Depths of the key, fractions of the haystack in `[0, 1]`.
    pub depths: Vec<f64>,
    /// Prefill chunk.
    pub chunk: usize,
    /// The question is prefilled with the context, so that the eviction
    /// after the prompt sees it (SnapKV's setting; kvpress without a
    /// separate question); by default it is asked after the context has
    /// been compressed.
    #[serde(default)]
    pub question_seen: bool,
}

fn one() -> usize {
    1
}

impl Workloads {
    /// At least one workload, each with settings that can run, and no
    /// item measured twice; or what is wrong, in one line.
    pub(crate) fn check(&self) -> Result<(), String> {
        let w = self;
        if w.chat.is_none() && w.stream.is_none() && w.passkey.is_none() {
            return Err("no [workloads.chat], [workloads.stream] or [workloads.passkey]: nothing to measure".into());
        }
        if let Some(c) = &w.chat
            && (c.chats == 0 || c.turns < 2 || c.answer_tokens == 0)
        {
            return Err("workloads.chat: chats and answer_tokens must be at least 1, turns at least 2 (the fact is planted in the second)".into());
        }
        if let Some(s) = &w.stream
            && (s.contexts.is_empty()
                || s.prefix == 0
                || s.chunk == 0
                || s.articles == 0
                || s.contexts.iter().any(|&c| c <= s.prefix))
        {
            return Err("workloads.stream: needs contexts, each longer than prefix > 0, chunk > 0 and articles > 0"
                        .into());
        }
        if let Some(p) = &w.passkey
            && (p.lengths.is_empty()
                || p.depths.is_empty()
                || p.chunk == 0
                || p.depths
                    .iter()
                    .any(|d| !(0.0..=1.0).contains(d) || d.is_sign_negative()))
        {
            return Err(
                "workloads.passkey: needs lengths, depths within [0, 1] and chunk > 0".into(),
            );
        }
        match w.repeated_item() {
            Some(msg) => Err(msg),
            None => Ok(()),
        }
    }

    /// A matrix that would measure one item twice, or name two items alike
    /// (depths that round to the same name): what is wrong, in one line.
    pub(crate) fn repeated_item(&self) -> Option<String> {
        let twice = |what: &str, v: &[usize]| {
            let mut seen = std::collections::BTreeSet::new();
            v.iter()
                .find(|x| !seen.insert(**x))
                .map(|x| format!("{what} lists {x} twice"))
        };
        if let Some(s) = &self.stream {
            if let Some(msg) = twice("workloads.stream.contexts", &s.contexts) {
                return Some(msg);
            }
        }
        let p = self.passkey.as_ref()?;
        if let Some(msg) = twice("workloads.passkey.lengths", &p.lengths) {
            return Some(msg);
        }
        let mut names = std::collections::BTreeMap::new();
        for &d in &p.depths {
            if let Some(old) = names.insert(format!("{d:.2}"), d) {
                return Some(format!(
                    "workloads.passkey.depths {old} and {d} are the same item (depth{d:.2}): give depths at least 0.01 apart"
                ));
            }
        }
        None
    }
}
