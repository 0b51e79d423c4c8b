//! The experiment file: model, workloads and the matrix of configurations,
//! in TOML (`configs/*.toml`). Unknown keys, unknown mechanisms and bad
//! values are errors naming the file, the line and the key.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use kvforge_coordinator::{DedupConfig, SimHashConfig};
use kvforge_evict::{Score, Scored, Trigger};
use serde::Deserialize;
use toml::Spanned;

/// One experiment: a model, its workloads, the configurations to compare.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    /// Names the output folder `target/ablate/<name>/`.
    pub name: String,
    /// The model every configuration runs.
    pub model: ModelSpec,
    /// What each configuration is measured on.
    #[serde(default)]
    pub workloads: Workloads,
    /// The matrix, in report order; the one named `baseline` (else the
    /// first) is what the others are compared with.
    #[serde(rename = "config")]
    pub configs: Vec<Spanned<Mechanisms>>,
}

/// The model, and how it runs.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A GGUF file (its tokenizer is used even for a random model).
    pub path: PathBuf,
    /// Replace the weights with a seeded random model of these dimensions
    /// (the quick run: seconds, not minutes).
    pub random: Option<RandomModel>,
    /// Weight storage: `f32`, `bf16` or `f16`.
    #[serde(default = "f32_name")]
    pub weights: String,
    /// Tokens per KV block.
    #[serde(default = "default_block")]
    pub block_size: usize,
    /// libtorch threads (0 = its default).
    #[serde(default)]
    pub threads: i32,
    /// Seed of every random choice (facts, pass keys, hash seeds).
    #[serde(default = "default_seed")]
    pub seed: u64,
}

/// Dimensions of a random model.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RandomModel {
    /// Hidden size.
    pub d_model: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// SwiGLU hidden size.
    pub ffn: usize,
    /// Context length.
    pub max_ctx: usize,
}

fn f32_name() -> String {
    "f32".into()
}
fn default_block() -> usize {
    32
}
fn default_seed() -> u64 {
    7
}

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
    /// Context lengths, one item each (articles concatenated, longest
    /// first, up to the length).
    pub contexts: Vec<usize>,
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

/// One configuration of the matrix: a name and the mechanisms it turns on
/// (each absent = off).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mechanisms {
    /// Row name in the report.
    pub name: String,
    /// Prefix reuse across requests and sessions.
    pub prefix: Option<PrefixSpec>,
    /// The quantized cold tier.
    pub cold: Option<ColdSpec>,
    /// Eviction.
    pub eviction: Option<EvictionSpec>,
    /// Sharing of duplicate cold blocks.
    pub share: Option<ShareSpec>,
    /// Context lifecycle at turn ends.
    pub lifecycle: Option<LifecycleSpec>,
    /// Byte budget of all KV tiers, MiB (0 = the hot tier's capacity).
    #[serde(default)]
    pub budget_mib: u64,
    /// Tokens per KV block for this configuration (default: the model's).
    pub block_size: Option<usize>,
}

impl Mechanisms {
    /// The block size this configuration runs with.
    pub fn block_size(&self, model: &ModelSpec) -> usize {
        self.block_size.unwrap_or(model.block_size)
    }
}

/// Prefix reuse.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PrefixSpec {
    /// `hash-chain` or `radix`.
    #[serde(default)]
    pub index: IndexName,
    /// The partial last block of a turn: `copy`, `seal` or `skip`.
    #[serde(default)]
    pub tail: TailName,
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

/// The quantized cold tier.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ColdSpec {
    /// Element format.
    pub format: ColdFormat,
    /// Newest tokens kept hot (whole blocks).
    pub window: usize,
    /// First tokens kept hot (whole blocks).
    #[serde(default)]
    pub sink: usize,
    /// Group size along the head dim.
    #[serde(default = "default_group")]
    pub group: usize,
    /// Key groups: `channel` (KIVI) or `token`.
    #[serde(default)]
    pub keys: KeyAxis,
    /// Hadamard-rotate keys before quantizing.
    #[serde(default)]
    pub rotate: bool,
}

fn default_decay() -> f32 {
    0.9
}

/// SnapKV's default observation window (the paper's 32 queries).
fn default_observe() -> usize {
    32
}

impl EvictionSpec {
    /// Whether each KV head keeps its own pages (KeyDiff's and SnapKV's
    /// `per_head`).
    pub fn per_head(&self) -> bool {
        matches!(
            self,
            EvictionSpec::Keydiff { per_head: true, .. }
                | EvictionSpec::Snapkv { per_head: true, .. }
        )
    }

    /// Whether single tokens are evicted and holed blocks compacted
    /// (KeyDiff's and SnapKV's `per_token`).
    pub fn per_token(&self) -> bool {
        matches!(
            self,
            EvictionSpec::Keydiff {
                per_token: true,
                ..
            } | EvictionSpec::Snapkv {
                per_token: true,
                ..
            }
        )
    }

    /// The scored policies' score and trigger (`None` for the others);
    /// an error names what is wrong with the trigger.
    pub fn scored(&self) -> Option<Result<(Score, Trigger, usize, usize), String>> {
        let (score, sink, window, budget, high, low) = match *self {
            EvictionSpec::H2o {
                sink,
                window,
                decay,
                budget_tokens,
                high,
                low,
            } => (
                Score::AttentionEma { decay },
                sink,
                window,
                budget_tokens,
                high,
                low,
            ),
            EvictionSpec::Lfu {
                sink,
                window,
                budget_tokens,
                high,
                low,
            } => (Score::Lfu, sink, window, budget_tokens, high, low),
            EvictionSpec::Keydiff {
                sink,
                window,
                budget_tokens,
                high,
                low,
                ..
            } => (Score::KeyDiff, sink, window, budget_tokens, high, low),
            EvictionSpec::Snapkv {
                sink,
                window,
                observe,
                budget_tokens,
                high,
                low,
                ..
            } => (
                Score::SnapKv { window: observe },
                sink,
                window,
                budget_tokens,
                high,
                low,
            ),
            EvictionSpec::Hybrid {
                sink,
                window,
                alpha,
                beta,
                gamma,
                budget_tokens,
                high,
                low,
            } => (
                Score::Hybrid { alpha, beta, gamma },
                sink,
                window,
                budget_tokens,
                high,
                low,
            ),
            EvictionSpec::SinkWindow { .. } | EvictionSpec::Strided { .. } => return None,
        };
        let trigger = match (budget, high, low) {
            (Some(n), None, None) => Ok(Trigger::Tokens(n)),
            (None, Some(high), Some(low)) => Ok(Trigger::Watermark { high, low }),
            _ => Err("eviction: give either budget_tokens or both high and low".to_string()),
        };
        Some(trigger.map(|t| (score, t, sink, window)))
    }
}

fn default_group() -> usize {
    32
}

/// Cold-tier element formats.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ColdFormat {
    /// 8-bit symmetric.
    Int8,
    /// 4-bit affine.
    Int4,
    /// 2-bit affine.
    Int2,
}

impl ColdFormat {
    /// Bits per element.
    pub fn bits(self) -> u32 {
        match self {
            ColdFormat::Int8 => 8,
            ColdFormat::Int4 => 4,
            ColdFormat::Int2 => 2,
        }
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

/// Eviction policies, by `policy = "…"`. A new policy is one variant here
/// and one arm in `policy::eviction` (see the bench README).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(tag = "policy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EvictionSpec {
    /// StreamingLLM: the first `sink` and the newest `window` tokens.
    SinkWindow {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
    },
    /// H2O: entries between the sink and the window, lowest attention EMA
    /// first, when the trigger fires (`budget_tokens`, or `high`/`low`
    /// watermarks over `budget_mib`).
    H2o {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Weight of the past in the EMA.
        #[serde(default = "default_decay")]
        decay: f32,
        /// Live tokens per sequence at most.
        budget_tokens: Option<usize>,
        /// Watermark that starts eviction (fraction of the byte budget).
        high: Option<f64>,
        /// Watermark eviction brings it back to.
        low: Option<f64>,
    },
    /// LFU: the entries that drew more than their share least often go.
    Lfu {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Live tokens per sequence at most.
        budget_tokens: Option<usize>,
        /// Watermark that starts eviction.
        high: Option<f64>,
        /// Watermark eviction brings it back to.
        low: Option<f64>,
    },
    /// KeyDiff: the entries whose keys stand closest to the mean key go.
    Keydiff {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Head-wise: each layer's each KV head keeps its own pages, packed
        /// into fewer blocks (hot blocks only: no cold tier).
        #[serde(default)]
        per_head: bool,
        /// Token-level: single tokens are marked invalid and the live rows
        /// of holed blocks compacted into fewer blocks (hot blocks of at
        /// most 64 tokens: no cold tier).
        #[serde(default)]
        per_token: bool,
        /// Live tokens per sequence at most.
        budget_tokens: Option<usize>,
        /// Watermark that starts eviction.
        high: Option<f64>,
        /// Watermark eviction brings it back to.
        low: Option<f64>,
    },
    /// SnapKV: the attention of the latest step's last `observe` queries
    /// (at the end of a prompt: its observation window) ranks the entries.
    Snapkv {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Queries in the observation window.
        #[serde(default = "default_observe")]
        observe: usize,
        /// Head-wise: each layer's each KV head keeps its own pages, packed
        /// into fewer blocks (hot blocks only: no cold tier).
        #[serde(default)]
        per_head: bool,
        /// Token-level: single tokens are marked invalid and the live rows
        /// of holed blocks compacted into fewer blocks (hot blocks of at
        /// most 64 tokens: no cold tier).
        #[serde(default)]
        per_token: bool,
        /// Live tokens per sequence at most.
        budget_tokens: Option<usize>,
        /// Watermark that starts eviction.
        high: Option<f64>,
        /// Watermark eviction brings it back to.
        low: Option<f64>,
    },
    /// Seed 004's hybrid `α(1−recency) + β(1−attention) + γ(1−frequency)`.
    Hybrid {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// Weight of age.
        alpha: f32,
        /// Weight of low attention.
        beta: f32,
        /// Weight of rare use.
        gamma: f32,
        /// Live tokens per sequence at most.
        budget_tokens: Option<usize>,
        /// Watermark that starts eviction.
        high: Option<f64>,
        /// Watermark eviction brings it back to.
        low: Option<f64>,
    },
    /// The README's worked example: sink and window as StreamingLLM, and
    /// of the blocks between them every `stride`-th one kept.
    Strided {
        /// Tokens kept at the start.
        sink: usize,
        /// Tokens kept at the end.
        window: usize,
        /// One block in `stride` of the middle stays.
        stride: usize,
    },
}

/// Sharing of duplicate cold blocks, by `policy = "…"`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(tag = "policy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ShareSpec {
    /// Bit-identical quantized blocks, verified byte for byte.
    Exact,
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
            ShareSpec::Exact => DedupConfig::Exact,
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
            ShareSpec::Exact => "share exact".into(),
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
    pub fn config(self) -> kvforge_engine::LifecycleConfig {
        use kvforge_engine::{LabelSource, LifecycleConfig};
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

    /// How the report names it.
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
}

impl Experiment {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> Result<Experiment> {
        let src = match std::fs::read_to_string(path) {
            Ok(s) => s,
            Err(e) => bail!("{}: {e}", path.display()),
        };
        Self::parse(&src, path)
    }

    /// Parses and checks `src`, read from `path` (for messages).
    pub fn parse(src: &str, path: &Path) -> Result<Experiment> {
        let exp: Experiment = match toml::from_str(src) {
            Ok(e) => e,
            Err(e) => bail!("{}", located(path, src, e.span(), e.message())),
        };
        exp.check(src, path)?;
        Ok(exp)
    }

    /// Resolves the relative model and data paths against `root` (the
    /// project root they are written for).
    pub fn rebase(&mut self, root: &Path) {
        let join = |p: &mut PathBuf| {
            if p.is_relative() && root != Path::new(".") {
                *p = root.join(&*p);
            }
        };
        join(&mut self.model.path);
        let w = &mut self.workloads;
        if let Some(c) = &mut w.chat {
            join(&mut c.data);
        }
        if let Some(s) = &mut w.stream {
            join(&mut s.data);
        }
        if let Some(p) = &mut w.passkey {
            join(&mut p.data);
        }
    }

    /// The configurations, without their spans.
    pub fn matrix(&self) -> Vec<&Mechanisms> {
        self.configs.iter().map(|c| c.get_ref()).collect()
    }

    /// The configuration the others are compared with.
    pub fn baseline(&self) -> &str {
        let m = self.matrix();
        m.iter()
            .find(|c| c.name == "baseline")
            .or(m.first())
            .map_or("", |c| c.name.as_str())
    }

    fn check(&self, src: &str, path: &Path) -> Result<()> {
        let top = |msg: String| located(path, src, None, &msg);
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            bail!(
                "{}",
                top(format!(
                    "name {:?} must be letters, digits, - and _ (it names the output folder)",
                    self.name
                ))
            );
        }
        let m = &self.model;
        if !(1..=4096).contains(&m.block_size) {
            bail!("{}", top("model.block_size must be within 1..=4096".into()));
        }
        if !["f32", "bf16", "f16"].contains(&m.weights.as_str()) {
            bail!(
                "{}",
                top(format!(
                    "model.weights {:?}: use f32, bf16 or f16",
                    m.weights
                ))
            );
        }
        if self.configs.is_empty() {
            bail!("{}", top("no [[config]]: the matrix is empty".into()));
        }
        let w = &self.workloads;
        if let Some(c) = &w.chat
            && (c.chats == 0 || c.turns < 2 || c.answer_tokens == 0)
        {
            bail!(
                "{}",
                top("workloads.chat: chats and answer_tokens must be at least 1, turns at least 2 (the fact is planted in the second)".into())
            );
        }
        if let Some(s) = &w.stream
            && (s.contexts.is_empty()
                || s.prefix == 0
                || s.chunk == 0
                || s.contexts.iter().any(|&c| c <= s.prefix))
        {
            bail!(
                "{}",
                top(
                    "workloads.stream: needs contexts, each longer than prefix > 0, and chunk > 0"
                        .into()
                )
            );
        }
        if let Some(p) = &w.passkey
            && (p.lengths.is_empty()
                || p.depths.is_empty()
                || p.chunk == 0
                || p.depths.iter().any(|d| !(0.0..=1.0).contains(d)))
        {
            bail!(
                "{}",
                top("workloads.passkey: needs lengths, depths within [0, 1] and chunk > 0".into())
            );
        }
        let mut names = std::collections::BTreeSet::new();
        for c in &self.configs {
            let at = |msg: String| located(path, src, Some(c.span()), &msg);
            let mech = c.get_ref();
            if !names.insert(mech.name.as_str()) {
                bail!("{}", at(format!("config {:?} appears twice", mech.name)));
            }
            if mech.block_size.is_some_and(|b| !(1..=4096).contains(&b)) {
                bail!(
                    "{}",
                    at(format!(
                        "config {:?}: block_size must be within 1..=4096",
                        mech.name
                    ))
                );
            }
            if let Some(msg) = mech.problem(mech.block_size(m)) {
                bail!("{}", at(format!("config {:?}: {msg}", mech.name)));
            }
        }
        Ok(())
    }
}

impl Mechanisms {
    /// What cannot work in this configuration, checked before anything
    /// runs (the engine checks the rest).
    fn problem(&self, block: usize) -> Option<String> {
        if self.name.is_empty() || self.name.contains([',', '\n', '|']) {
            return Some("a name must be non-empty, without commas or |".into());
        }
        if let Some(c) = &self.cold {
            if c.window % block != 0 || c.sink % block != 0 {
                return Some(format!(
                    "cold.window and cold.sink must be multiples of the block size {block}"
                ));
            }
            if c.group == 0 {
                return Some("cold.group must be at least 1".into());
            }
        }
        if self.share.is_some() && self.cold.is_none() {
            return Some("share needs a cold tier (it shares quantized blocks)".into());
        }
        if let Some(DedupConfig::SimHash(c)) = self.share.map(ShareSpec::config) {
            if let Err(e) = c.validate() {
                return Some(e.to_string());
            }
        }
        if let Some(Some(scored)) = self.eviction.map(|e| e.scored()) {
            let built = scored.and_then(|(score, trigger, sink, window)| {
                Scored::new(score, trigger, sink, window)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = built {
                return Some(e);
            }
        }
        if self.eviction.is_some_and(|e| e.per_head()) && self.cold.is_some() {
            return Some(
                "eviction.per_head packs hot blocks; it does not combine with a cold tier yet"
                    .into(),
            );
        }
        if let Some(e) = self.eviction.filter(|e| e.per_token()) {
            if e.per_head() {
                return Some("eviction is per_head or per_token, not both".into());
            }
            if self.cold.is_some() {
                return Some(
                    "eviction.per_token compacts hot blocks; it does not combine with a cold tier yet"
                        .into(),
                );
            }
            if block > kvforge_pool::MAX_HOLED_BLOCK as usize {
                return Some(format!(
                    "eviction.per_token marks rows of blocks of at most {} tokens, not {block}",
                    kvforge_pool::MAX_HOLED_BLOCK
                ));
            }
        }
        match self.eviction {
            Some(EvictionSpec::SinkWindow { window: 0, .. })
            | Some(EvictionSpec::Strided { window: 0, .. }) => {
                return Some("eviction.window must keep at least one token".into());
            }
            Some(EvictionSpec::Strided { stride: 0, .. }) => {
                return Some("eviction.stride must be at least 1".into());
            }
            _ => {}
        }
        match self.lifecycle {
            Some(LifecycleSpec::RecentTurns { keep: 0 }) => {
                return Some("lifecycle.keep must be at least 1".into());
            }
            Some(
                LifecycleSpec::Rule { protect: 0, .. }
                | LifecycleSpec::Free { protect: 0, .. }
                | LifecycleSpec::Constrained { protect: 0, .. },
            ) => return Some("lifecycle.protect must be at least 1".into()),
            _ => {}
        }
        None
    }
}

/// `file:line:col: message (at `source line`)`: one line.
fn located(path: &Path, src: &str, span: Option<Range<usize>>, msg: &str) -> String {
    let msg = msg.trim().replace('\n', " ");
    let Some(span) = span else {
        return format!("{}: {msg}", path.display());
    };
    let start = span.start.min(src.len());
    let before = &src[..start];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = src[line_start..start].chars().count() + 1;
    let text = src[line_start..]
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .chars()
        .take(60)
        .collect::<String>();
    format!("{}:{line}:{col}: {msg} (at `{text}`)", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
[model]
path = "m.gguf"
block_size = 16

[workloads.stream]
data = "wiki"
contexts = [256]
prefix = 64
chunk = 32
decode = 4

[[config]]
name = "baseline"

[[config]]
name = "all"
prefix = { index = "radix", tail = "seal" }
cold = { format = "int4", window = 32, sink = 16 }
eviction = { policy = "sink-window", sink = 16, window = 64 }
share = { policy = "exact" }
lifecycle = { policy = "recent-turns", keep = 2 }
budget_mib = 64
block_size = 8
"#;

    const SINK_WINDOW: &str = "\"sink-window\", sink = 16, window = 64";
    /// `src` without GOOD's cold tier and sharing (which needs it).
    fn no_cold(src: String) -> String {
        src.replace("cold = { format = \"int4\", window = 32, sink = 16 }\n", "")
            .replace("share = { policy = \"exact\" }\n", "")
    }

    fn err(src: &str) -> String {
        Experiment::parse(src, Path::new("x.toml"))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_good_file_parses_into_the_matrix() {
        let e = Experiment::parse(GOOD, Path::new("x.toml")).unwrap();
        let m = e.matrix();
        assert_eq!(m.len(), 2);
        assert_eq!(e.baseline(), "baseline");
        assert_eq!(m[1].prefix.unwrap().index, IndexName::Radix);
        assert_eq!(m[1].cold.unwrap().format.bits(), 4);
        assert_eq!(m[1].cold.unwrap().keys, KeyAxis::Channel);
        assert_eq!(
            m[1].eviction,
            Some(EvictionSpec::SinkWindow {
                sink: 16,
                window: 64
            })
        );
        assert_eq!(e.model.weights, "f32");
        let lc = GOOD.replace(
            "\"recent-turns\", keep = 2",
            "\"constrained\", protect = 2, delay = 3",
        );
        let e2 = Experiment::parse(&lc, Path::new("x.toml")).unwrap();
        assert_eq!(
            e2.matrix()[1].lifecycle,
            Some(LifecycleSpec::Constrained {
                protect: 2,
                delay: 3
            })
        );
        assert_eq!(
            (m[0].block_size(&e.model), m[1].block_size(&e.model)),
            (16, 8)
        );
    }

    #[test]
    fn bad_files_name_the_file_line_and_key_in_one_line() {
        let cases = [
            // An unknown key.
            (
                GOOD.replace("budget_mib = 64", "budget_mb = 64"),
                "x.toml:24:1:",
                "unknown field `budget_mb`",
            ),
            // A mechanism that does not exist.
            (
                GOOD.replace("budget_mib = 64", "dedupe = { policy = \"lsh\" }"),
                "x.toml:24:1:",
                "unknown field `dedupe`",
            ),
            // A policy that does not exist.
            (
                GOOD.replace("\"sink-window\"", "\"h3o\""),
                "x.toml:21:",
                "unknown variant `h3o`",
            ),
            // A wrong type.
            (
                GOOD.replace("window = 32,", "window = \"32\","),
                "x.toml:20:",
                "invalid type",
            ),
            // A parameter of another policy.
            (
                GOOD.replace("keep = 2", "keep = 2, k = 3"),
                "x.toml:23:",
                "unknown field `k`",
            ),
            // A lifecycle that protects nothing; one without its delay.
            (
                GOOD.replace("\"recent-turns\", keep = 2", "\"constrained\", protect = 0, delay = 2"),
                "x.toml:17:1:",
                "lifecycle.protect must be at least 1",
            ),
            (
                GOOD.replace("\"recent-turns\", keep = 2", "\"rule\", protect = 2"),
                "x.toml:23:",
                "missing field `delay`",
            ),
            // Semantics: sharing without a cold tier; a window off the block grid.
            (
                GOOD.replace("cold = { format = \"int4\", window = 32, sink = 16 }", ""),
                "x.toml:17:1:",
                "share needs a cold tier",
            ),
            (
                GOOD.replace("window = 32,", "window = 36,"),
                "x.toml:17:1:",
                "multiples of the block size",
            ),
            // Near-duplicate sharing at an impossible threshold or width.
            (
                GOOD.replace("policy = \"exact\"", "policy = \"lsh\", threshold = 1.2"),
                "x.toml:17:1:",
                "outside (0, 1]",
            ),
            (
                GOOD.replace("policy = \"exact\"", "policy = \"lsh\", threshold = 0.9, bits = 80"),
                "x.toml:17:1:",
                "at most 64",
            ),
            (
                GOOD.replace("policy = \"exact\"", "policy = \"lsh\""),
                "x.toml:",
                "missing field `threshold`",
            ),
            (
                GOOD.replace("name = \"all\"", "name = \"baseline\""),
                "x.toml:17:1:",
                "appears twice",
            ),
            (
                GOOD.replace("contexts = [256]", "contexts = [64]"),
                "x.toml:",
                "each longer than prefix",
            ),
            (
                "name = \"t\"\n[model\n".to_string(),
                "x.toml:2:",
                "unclosed table",
            ),
            // Scored eviction: a budget inside the protected tokens, two
            // triggers at once, negative weights, watermarks upside down.
            (
                GOOD.replace(SINK_WINDOW, "\"h2o\", sink = 16, window = 64, budget_tokens = 64"),
                "x.toml:17:1:",
                "leaves nothing to choose",
            ),
            (
                GOOD.replace(
                    SINK_WINDOW,
                    "\"lfu\", sink = 16, window = 64, budget_tokens = 200, high = 0.9, low = 0.5",
                ),
                "x.toml:17:1:",
                "either budget_tokens or both high and low",
            ),
            (
                GOOD.replace(
                    SINK_WINDOW,
                    "\"hybrid\", sink = 16, window = 64, alpha = -1.0, beta = 1.0, gamma = 0.0, budget_tokens = 200",
                ),
                "x.toml:17:1:",
                "must be finite, >= 0",
            ),
            (
                GOOD.replace(SINK_WINDOW, "\"h2o\", sink = 16, window = 64, high = 0.5, low = 0.9"),
                "x.toml:17:1:",
                "0 < low < high <= 1",
            ),
            (
                GOOD.replace(
                    SINK_WINDOW,
                    "\"snapkv\", sink = 16, window = 64, observe = 0, budget_tokens = 200",
                ),
                "x.toml:17:1:",
                "observation window must hold at least one query",
            ),
            (
                no_cold(GOOD.replace(
                    SINK_WINDOW,
                    "\"keydiff\", per_head = true, per_token = true, sink = 16, window = 64, budget_tokens = 200",
                )),
                "x.toml:17:1:",
                "per_head or per_token, not both",
            ),
            (
                no_cold(GOOD.replace(
                    SINK_WINDOW,
                    "\"snapkv\", per_token = true, sink = 16, window = 64, budget_tokens = 200",
                ))
                .replace("block_size = 8", "block_size = 128"),
                "x.toml:17:1:",
                "blocks of at most 64 tokens, not 128",
            ),
            (
                GOOD.replace("block_size = 8", "block_size = 0"),
                "x.toml:17:1:",
                "block_size must be within 1..=4096",
            ),
            (
                GOOD.replace("path = \"m.gguf\"", ""),
                "x.toml:",
                "missing field `path`",
            ),
        ];
        for (src, at, what) in cases {
            let e = err(&src);
            assert!(e.starts_with(at) && e.contains(what), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
