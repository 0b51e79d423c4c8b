//! What a coordinator is built from: plain data, so that an ablation can
//! switch every mechanism on or off from a file.

use kvforge_evict::{Score, Trigger};
use kvforge_pool::{KvLayout, StorageFormat};

use crate::error::{CoordError, Result};

/// Which prefix index to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexKind {
    /// `HashChainIndex`: chained xxh3-128 keys in a flat map.
    HashChain,
    /// `RadixIndex`: a radix tree over blocks.
    Radix,
}

impl std::str::FromStr for IndexKind {
    type Err = CoordError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "hash-chain" | "chain" => Ok(IndexKind::HashChain),
            "radix" => Ok(IndexKind::Radix),
            _ => Err(CoordError::Config(format!(
                "unknown index {s:?}; use hash-chain or radix"
            ))),
        }
    }
}

/// What becomes of the partial last block of a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnTail {
    /// Not cached: the next request recomputes its tokens.
    Skip,
    /// Sealed and cached: the next token starts a new block, so every turn
    /// leaves a partly empty block behind.
    Seal,
    /// Cached as it is, still open: the sequence goes on filling it, and a
    /// request that continues it copies its tokens into a fresh block of
    /// its own (copy-on-partial-reuse, as in TensorRT-LLM). Hits like
    /// `Seal`, holds memory like `Skip`.
    Copy,
}

impl std::str::FromStr for TurnTail {
    type Err = CoordError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "skip" => Ok(TurnTail::Skip),
            "seal" => Ok(TurnTail::Seal),
            "copy" => Ok(TurnTail::Copy),
            _ => Err(CoordError::Config(format!(
                "unknown turn tail {s:?}; use skip, seal or copy"
            ))),
        }
    }
}

/// Prefix reuse across requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    /// The index implementation.
    pub index: IndexKind,
    /// Hash seed; `None` draws a random one (the safe default).
    pub seed: Option<u64>,
    /// What becomes of the partial last block at every turn end.
    pub tail: TurnTail,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            index: IndexKind::HashChain,
            seed: None,
            tail: TurnTail::Copy,
        }
    }
}

/// The quantized cold tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColdConfig {
    /// Storage of a cold block's keys (the bytes the budget counts).
    pub format: StorageFormat,
    /// Storage of its values (KIVI groups them differently).
    pub value_format: StorageFormat,
    /// Newest tokens kept hot: whole blocks.
    pub window: usize,
    /// First tokens kept hot (attention sinks): whole blocks.
    pub sink: usize,
}

/// Eviction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EvictionConfig {
    /// StreamingLLM: keep `sink` leading and `window` trailing tokens.
    SinkWindow {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
    },
    /// Whole entries between the sink and the window, lowest score first,
    /// when the trigger fires (`kvforge_evict::Scored`).
    Scored {
        /// What an entry is worth.
        score: Score,
        /// When to evict and how much.
        trigger: Trigger,
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Head-wise: every lane (one layer's one KV head) keeps its own
        /// pages, packed into fewer blocks (KeyDiff and SnapKV; hot blocks
        /// only).
        per_head: bool,
        /// Token-level: single rows of blocks are marked invalid and the
        /// live rows of holed blocks compacted into fewer blocks (KeyDiff
        /// and SnapKV; hot blocks of at most 64 tokens only).
        per_token: bool,
    },
}

impl EvictionConfig {
    /// The protected recent window.
    pub fn window(&self) -> usize {
        match *self {
            EvictionConfig::SinkWindow { window, .. } | EvictionConfig::Scored { window, .. } => {
                window
            }
        }
    }
}

/// Sharing of duplicate cold blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DedupConfig {
    /// Bit-identical quantized blocks, verified byte for byte.
    Exact,
    /// Near-duplicate blocks: random-hyperplane signatures of the
    /// dequantized block, candidates verified by their exact cosine.
    SimHash(kvforge_lsh::SimHashConfig),
}

/// Context lifecycle at turn ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifecycleConfig {
    /// Keep the first and the newest `keep` turns, drop the rest at once.
    RecentTurns {
        /// Turns kept at the end.
        keep: u32,
    },
    /// Segments labelled by the seed's rule or by the model (the rule
    /// standing in for missing labels), dropped ones freed after `delay`
    /// rounds unless a later turn refers to them.
    Labels {
        /// Where labels come from.
        source: kvforge_lifecycle::LabelSource,
        /// Newest rounds always kept (the seed: 2).
        protect: u32,
        /// K: rounds a dropped segment waits (0: freed at once).
        delay: u32,
        /// Tokens in a run that counts as a reference (0: never revive).
        min_match: usize,
        /// Segments this long or longer are summarised when labelled
        /// `compress` (`None`: compression off, such segments are kept).
        compress_min: Option<u64>,
    },
}

/// Everything a [`Coordinator`](crate::Coordinator) is built from. Each
/// optional mechanism is present or absent by configuration alone.
#[derive(Clone, Debug, PartialEq)]
pub struct CoordinatorConfig {
    /// The hot tier: model dims in the KV dtype, block size.
    pub layout: KvLayout,
    /// Blocks the hot tier can hold (the engine's KV tensors).
    pub hot_blocks: usize,
    /// Bytes all tiers may hold in use together; 0 means the hot tier's
    /// capacity.
    pub budget_bytes: u64,
    /// Prefix reuse (absent: every request computes its whole prompt).
    pub prefix: Option<PrefixConfig>,
    /// The quantized cold tier.
    pub cold: Option<ColdConfig>,
    /// Eviction.
    pub eviction: Option<EvictionConfig>,
    /// Sharing of duplicate cold blocks (needs the cold tier).
    pub dedup: Option<DedupConfig>,
    /// Context lifecycle.
    pub lifecycle: Option<LifecycleConfig>,
}

impl CoordinatorConfig {
    /// Only the hot tier, `hot_blocks` of `layout`; every mechanism off.
    pub fn new(layout: KvLayout, hot_blocks: usize) -> Self {
        CoordinatorConfig {
            layout,
            hot_blocks,
            budget_bytes: 0,
            prefix: None,
            cold: None,
            eviction: None,
            dedup: None,
            lifecycle: None,
        }
    }

    /// The byte budget in effect.
    pub fn budget(&self) -> u64 {
        if self.budget_bytes == 0 {
            self.layout
                .block_bytes()
                .saturating_mul(self.hot_blocks as u64)
        } else {
            self.budget_bytes
        }
    }
}
