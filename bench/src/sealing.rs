//! Turn tails: what caching the partial last block of each turn buys in hit
//! rate and costs in memory — not cached (skip), sealed, or cached open and
//! copied by the request that continues it (copy) — on multi-turn chats.
//!
//! Each conversation is replayed statelessly, as OpenAI-style clients do:
//! turn N's prompt is turn N-1's prompt and answer plus the new user message.
//! *Reusable* tokens are those already computed in an earlier turn (the whole
//! previous prompt and answer); the hit rate is the share of them the index
//! returns. Memory is the KV blocks the live conversation holds after its
//! last turn: a sealed block occupies a whole block but holds fewer tokens;
//! a copied one is the conversation's own block, filled on.

pub use kvforge_coordinator::TurnTail;
use kvforge_pool::BlockId;
use kvforge_prefix::{BlockRef, ExtraKeys, HashChainIndex, PrefixMatcher, RadixIndex};

use crate::synthetic_tokens;
use kvforge_ablate::inputs::SplitMix;

/// One turn: the user's message and the model's answer, as token ids.
#[derive(Clone, Debug)]
pub struct Turn {
    /// User message including its chat-template framing.
    pub user: Vec<u32>,
    /// Answer including its framing.
    pub answer: Vec<u32>,
}

/// A conversation of `turns` turns with user messages of 16..=160 tokens and
/// answers of 32..=400 tokens (ChatML-like framing tokens included).
pub fn synthetic_chat(turns: usize, seed: u64) -> Vec<Turn> {
    let mut r = SplitMix::new(seed);
    (0..turns)
        .map(|t| {
            let framed = |role: u32, body: Vec<u32>| {
                let mut v = vec![1, role, 198];
                v.extend(body);
                v.extend([2, 198]);
                v
            };
            let u = r.range(16, 160) as usize;
            let a = r.range(32, 400) as usize;
            Turn {
                user: framed(4093, synthetic_tokens(u, seed ^ (2 * t as u64 + 1) << 8)),
                answer: framed(520, synthetic_tokens(a, seed ^ (2 * t as u64 + 2) << 8)),
            }
        })
        .collect()
}

/// Which index implementation to replay with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexKind {
    /// [`HashChainIndex`].
    HashChain,
    /// [`RadixIndex`].
    Radix,
}

/// Totals of one replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replay {
    /// Tokens computed in an earlier turn and present in a later prompt.
    pub reusable_tokens: u64,
    /// Of those, tokens the index returned.
    pub hit_tokens: u64,
    /// Tokens prefilled (prompt minus hit).
    pub prefill_tokens: u64,
    /// Blocks held by the live conversations after their last turn.
    pub blocks_held: u64,
    /// Tokens those blocks hold.
    pub tokens_held: u64,
}

impl Replay {
    /// `hit_tokens / reusable_tokens`.
    pub fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.reusable_tokens.max(1) as f64
    }
}

/// A [`Replay`] with its block size (kept out of the totals for `Default`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SealRun {
    /// Tokens per block.
    pub block_size: usize,
    /// What became of turn tails.
    pub tail: TurnTail,
    /// Totals.
    pub replay: Replay,
}

impl SealRun {
    /// Share of the held blocks' token slots that hold no token.
    pub fn waste(&self) -> f64 {
        let slots = self.replay.blocks_held.max(1) as f64 * self.block_size as f64;
        1.0 - self.replay.tokens_held as f64 / slots
    }
}

/// Replays `chats` with one index; every conversation has its own namespace
/// so they cannot help each other.
pub fn replay(
    chats: &[Vec<Turn>],
    block_size: usize,
    tail: TurnTail,
    kind: IndexKind,
) -> anyhow::Result<SealRun> {
    let mut index: Box<dyn PrefixMatcher> = match kind {
        IndexKind::HashChain => Box::new(HashChainIndex::with_seed(block_size, 0)?),
        IndexKind::Radix => Box::new(RadixIndex::new(block_size)?),
    };
    let mut total = Replay::default();
    let mut next_slot = 0u32;
    for (c, chat) in chats.iter().enumerate() {
        let extra = ExtraKeys::namespace(format!("chat-{c}"));
        let mut history: Vec<u32> = Vec::new();
        let mut table: Vec<BlockRef> = Vec::new();
        for turn in chat {
            let mut seq = history.clone();
            seq.extend(&turn.user);
            let m = index.match_prefix(&seq, &extra);
            total.reusable_tokens += history.len() as u64;
            total.hit_tokens += m.tokens.min(history.len()) as u64;
            total.prefill_tokens += (seq.len() - m.tokens) as u64;
            seq.extend(&turn.answer);
            // The hit's blocks; a partial last one is copied into a block of
            // the conversation's own when tails are copied. New blocks
            // follow: full ones, then the tail.
            table = m.blocks.clone();
            if tail == TurnTail::Copy && table.last().is_some_and(|b| (b.len as usize) < block_size)
            {
                table.pop();
            }
            let mut left = seq.len() - table.iter().map(|b| b.len as usize).sum::<usize>();
            while left > 0 {
                let len = left.min(block_size);
                table.push(BlockRef::new(BlockId::new(next_slot, 1), len as u32));
                next_slot += 1;
                left -= len;
            }
            let indexed = match table.last() {
                Some(last) if tail == TurnTail::Skip && (last.len as usize) < block_size => {
                    &table[..table.len() - 1]
                }
                _ => &table[..],
            };
            index.insert(&seq, &extra, indexed)?;
            history = seq;
        }
        total.blocks_held += table.len() as u64;
        total.tokens_held += history.len() as u64;
    }
    Ok(SealRun {
        block_size,
        tail,
        replay: total,
    })
}
