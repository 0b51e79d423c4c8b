//! The parts of a [`Mechanisms`](super::Mechanisms) file: prefix reuse,
//! the cold tier, a policy named with its parameters, sharing, the
//! lifecycle. Each rejects a key it does not know.

use kvforge_coordinator::{DedupConfig, LabelSource, LifecycleConfig, SimHashConfig};
use kvforge_quant::Axis;
use serde::Deserialize;

use crate::manager::{IndexKind, TurnTail};
use crate::tier::KvQuant;

/// Prefix reuse.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PrefixSpec {
    /// `hash-chain` or `radix`.
    #[serde(default)]
    pub index: IndexName,
    /// The partial last block of a turn: `copy`, `seal` or `skip`.
    #[serde(default)]
    pub tail: TailName,
    /// Hash seed (absent: the run's seed, or a random one).
    pub seed: Option<u64>,
}

/// Prefix index implementations.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum IndexName {
    /// Chained block hashes.
    #[default]
    HashChain,
    /// Radix tree.
    Radix,
}

impl From<IndexName> for IndexKind {
    fn from(i: IndexName) -> Self {
        match i {
            IndexName::HashChain => IndexKind::HashChain,
            IndexName::Radix => IndexKind::Radix,
        }
    }
}

/// What becomes of a turn's partial last block.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum TailName {
    /// Cached; a continuing request copies it.
    #[default]
    Copy,
    /// Cached; new tokens start a new block.
    Seal,
    /// Not cached.
    Skip,
}

impl From<TailName> for TurnTail {
    fn from(t: TailName) -> Self {
        match t {
            TailName::Copy => TurnTail::Copy,
            TailName::Seal => TurnTail::Seal,
            TailName::Skip => TurnTail::Skip,
        }
    }
}

/// The cold tier as a file writes it: `format`, `window`, `sink`, `group`,
/// `keys`, `rotate` — read into the engine's [`KvQuant`], the one
/// description of a cold tier (the coordinator's `ColdConfig` is its byte
/// layout, which the cache derives from it).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ColdSpec {
    /// `int8`, `int4` or `int2`.
    format: String,
    /// Newest tokens kept hot (whole blocks).
    window: usize,
    /// First tokens kept hot (whole blocks).
    #[serde(default)]
    sink: usize,
    /// Group size along the head dim.
    #[serde(default = "default_group")]
    group: usize,
    /// Key groups: `channel` (KIVI) or `token`.
    #[serde(default)]
    keys: KeyAxis,
    /// Hadamard-rotate keys before quantizing.
    #[serde(default)]
    rotate: bool,
}

fn default_group() -> usize {
    32
}

impl TryFrom<ColdSpec> for KvQuant {
    type Error = String;
    fn try_from(c: ColdSpec) -> Result<Self, String> {
        let bits = kvforge_quant::QuantConfig::parse_bits(&c.format).map_err(|e| e.to_string())?;
        if c.group == 0 {
            return Err("cold.group must be at least 1".into());
        }
        Ok(KvQuant {
            bits,
            group_size: c.group,
            window: c.window,
            rotate: c.rotate,
            key_axis: match c.keys {
                KeyAxis::Channel => Axis::PerChannel,
                KeyAxis::Token => Axis::PerToken,
            },
            sink: c.sink,
        })
    }
}

/// Key grouping of the cold tier.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KeyAxis {
    /// Along a block's tokens, per channel (KIVI).
    #[default]
    Channel,
    /// Along the head dim, per token.
    Token,
}

/// A policy by name with its parameters: `{ policy = "keydiff", sink = 4,
/// … }`. What the parameters mean is the named policy's business (see
/// [`Registry`](super::Registry)).
#[derive(Clone, Debug, PartialEq)]
pub struct PolicySpec {
    /// The registered name.
    pub policy: String,
    /// Everything else in the table.
    pub params: serde_json::Map<String, serde_json::Value>,
}

impl<'de> Deserialize<'de> for PolicySpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut params = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let policy = match params.remove("policy") {
            Some(serde_json::Value::String(s)) => s,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "policy must be a name, not {other}"
                )));
            }
            None => return Err(D::Error::missing_field("policy")),
        };
        Ok(PolicySpec { policy, params })
    }
}

/// Sharing of duplicate cold blocks, by `policy = "…"`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(tag = "policy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ShareSpec {
    /// Bit-identical quantized blocks, verified byte for byte. (An empty
    /// struct, not a unit variant: serde lets a tagged unit variant ignore
    /// unknown keys.)
    Exact {},
    /// Near-duplicate blocks: random-hyperplane signatures of the
    /// dequantized block, candidates verified by their exact cosine.
    Lsh {
        /// The least cosine shared, in (0, 1].
        threshold: f32,
        /// Hyperplanes per table (default 16, at most 64).
        #[serde(default = "default_lsh_bits")]
        bits: u32,
        /// Tables (default 4).
        #[serde(default = "default_lsh_tables")]
        tables: u32,
    },
}

fn default_lsh_bits() -> u32 {
    SimHashConfig::default().bits
}

fn default_lsh_tables() -> u32 {
    SimHashConfig::default().tables
}

impl ShareSpec {
    /// The coordinator's configuration.
    pub fn config(self) -> DedupConfig {
        match self {
            ShareSpec::Exact {} => DedupConfig::Exact,
            ShareSpec::Lsh {
                threshold,
                bits,
                tables,
            } => DedupConfig::SimHash(SimHashConfig {
                threshold,
                bits,
                tables,
                ..SimHashConfig::default()
            }),
        }
    }

    /// A label for reports.
    pub fn label(self) -> String {
        match self {
            ShareSpec::Exact {} => "share exact".into(),
            ShareSpec::Lsh { threshold, .. } => format!("share cos ≥ {threshold}"),
        }
    }
}

/// Context lifecycle, by `policy = "…"`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "policy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LifecycleSpec {
    /// Keep the first and the newest `keep` turns.
    RecentTurns {
        /// Turns kept at the end.
        keep: u32,
    },
    /// Sentence segments labelled by the seed's rule.
    Rule {
        /// Newest rounds always kept.
        protect: u32,
        /// K: rounds a dropped segment waits.
        delay: u32,
    },
    /// Labelled by the model's block, decoded freely (the rule stands in).
    Free {
        /// Newest rounds always kept.
        protect: u32,
        /// K: rounds a dropped segment waits.
        delay: u32,
    },
    /// Labelled by the model under the label grammar.
    Constrained {
        /// Newest rounds always kept.
        protect: u32,
        /// K: rounds a dropped segment waits.
        delay: u32,
    },
}

impl LifecycleSpec {
    /// The engine's configuration: summaries of 512+ token segments,
    /// revival by a repeated run of 6 tokens.
    pub fn config(self) -> LifecycleConfig {
        let labels = |source, protect, delay| LifecycleConfig::Labels {
            source,
            protect,
            delay,
            min_match: 6,
            compress_min: Some(512),
        };
        match self {
            LifecycleSpec::RecentTurns { keep } => LifecycleConfig::RecentTurns { keep },
            LifecycleSpec::Rule { protect, delay } => labels(LabelSource::Rule, protect, delay),
            LifecycleSpec::Free { protect, delay } => labels(LabelSource::Free, protect, delay),
            LifecycleSpec::Constrained { protect, delay } => {
                labels(LabelSource::Constrained, protect, delay)
            }
        }
    }

    /// How a report names it.
    pub fn label(self) -> String {
        match self {
            LifecycleSpec::RecentTurns { keep } => format!("lifecycle keep {keep}"),
            LifecycleSpec::Rule { protect, delay } => format!("lifecycle rule p{protect} k{delay}"),
            LifecycleSpec::Free { protect, delay } => format!("lifecycle free p{protect} k{delay}"),
            LifecycleSpec::Constrained { protect, delay } => {
                format!("lifecycle constrained p{protect} k{delay}")
            }
        }
    }

    /// What cannot work.
    pub(crate) fn problem(self) -> Option<String> {
        match self {
            LifecycleSpec::RecentTurns { keep: 0 } => {
                Some("lifecycle.keep must be at least 1".into())
            }
            LifecycleSpec::Rule { protect: 0, .. }
            | LifecycleSpec::Free { protect: 0, .. }
            | LifecycleSpec::Constrained { protect: 0, .. } => {
                Some("lifecycle.protect must be at least 1".into())
            }
            _ => None,
        }
    }
}

/// A remote tier shared by several instances (`remote = { url, seed, … }`):
/// read by `kvforge serve`, which connects to the store.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RemoteSpec {
    /// `redis://host:port[/db]`; with `cluster`, the seed nodes separated
    /// by commas (no TLS: `rediss://` is refused).
    pub url: String,
    /// A Redis Cluster.
    #[serde(default)]
    pub cluster: bool,
    /// The cluster-wide hash seed: the same on every instance that shares.
    pub seed: u64,
    /// A file holding the cluster's secret (the same on every instance;
    /// at least 16 bytes): blobs are authenticated with it and tenants'
    /// namespaces keyed by it. Absent: the `KVFORGE_REMOTE_SECRET`
    /// environment variable. Never the secret itself in this file.
    pub secret_file: Option<std::path::PathBuf>,
    /// Keys expire after this many seconds (0: never).
    #[serde(default = "RemoteSpec::default_ttl")]
    pub ttl_s: u64,
    /// A lookup gives up (a miss) after this many milliseconds.
    #[serde(default = "RemoteSpec::default_deadline")]
    pub deadline_ms: u64,
    /// `cold` (the cold tier's quantized bytes) or `hot` (the KV dtype);
    /// absent: `cold` when there is a cold tier.
    pub blocks: Option<BlockFormat>,
    /// Blocks the write-behind queue holds at most (more are dropped).
    #[serde(default = "RemoteSpec::default_queue")]
    pub queue_blocks: usize,
}

/// The format blocks travel in.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum BlockFormat {
    /// The KV dtype.
    Hot,
    /// The cold tier's quantized bytes.
    Cold,
}

impl RemoteSpec {
    fn default_ttl() -> u64 {
        3600
    }
    fn default_deadline() -> u64 {
        250
    }
    fn default_queue() -> usize {
        1024
    }

    /// What cannot work, before anything connects.
    pub fn problem(&self, cold_tier: bool, prefix: bool) -> Option<String> {
        if self.url.contains("rediss://") {
            return Some(
                "remote.url: rediss:// (TLS) is not built in; use redis:// (or a TLS tunnel)"
                    .into(),
            );
        }
        let url_ok = self
            .url
            .split(',')
            .all(|u| u.trim().starts_with("redis://"));
        if !url_ok {
            return Some(format!(
                "remote.url {:?} must be redis://host:port (comma-separated with cluster = true)",
                self.url
            ));
        }
        if !self.cluster && self.url.contains(',') {
            return Some("remote.url lists several nodes: set cluster = true".into());
        }
        if !(1..=60_000).contains(&self.deadline_ms) {
            return Some(format!(
                "remote.deadline_ms must be within 1..=60000, not {}",
                self.deadline_ms
            ));
        }
        if !(1..=1 << 20).contains(&self.queue_blocks) {
            return Some(format!(
                "remote.queue_blocks must be within 1..=1048576, not {}",
                self.queue_blocks
            ));
        }
        if !prefix {
            return Some(
                "remote needs prefix reuse (prefix = { … }): it shares the prefix chain".into(),
            );
        }
        if self.blocks == Some(BlockFormat::Cold) && !cold_tier {
            return Some("remote.blocks = \"cold\" needs a cold tier (cold = { … })".into());
        }
        None
    }

    /// Whether blocks travel as cold bytes.
    pub fn cold_blocks(&self, cold_tier: bool) -> bool {
        self.blocks.map_or(cold_tier, |b| b == BlockFormat::Cold)
    }
}
