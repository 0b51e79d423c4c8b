//! The mechanism flags (`--kv-quant`, `--evict-window`, `--kv-share`,
//! `--keep-turns`, `--lifecycle`, `--kv-budget-mib` and their details):
//! checked against each other, then applied to an [`EngineConfig`].

use clap::Args;
use kvforge_engine::mechanisms::Registry;
use kvforge_engine::{
    Axis, DedupConfig, EngineConfig, EngineError, KvQuant, LabelSource, LifecycleConfig,
    SimHashConfig,
};

/// The mechanism flags; the quantized cold tier is off unless --kv-quant
/// is given.
#[derive(Args)]
pub(crate) struct MechanismFlags {
    /// Quantize KV blocks older than --kv-window: int8, int4 or int2.
    #[arg(long)]
    pub(crate) kv_quant: Option<String>,
    /// Newest tokens kept in full precision (a multiple of --block-size;
    /// default 128).
    #[arg(long)]
    pub(crate) kv_window: Option<usize>,
    /// Quantization group size along the head dim (must divide it;
    /// default 32). Per-channel key groups span one block's tokens.
    #[arg(long)]
    pub(crate) kv_group: Option<usize>,
    /// Key groups: channel (KIVI: along a block's tokens; the default) or
    /// token.
    #[arg(long)]
    pub(crate) kv_keys: Option<String>,
    /// Hadamard-rotate keys before quantizing.
    #[arg(long)]
    pub(crate) kv_rotate: bool,
    /// First tokens kept in full precision (attention sinks; a multiple of
    /// --block-size; 0 = none; default 32).
    #[arg(long)]
    pub(crate) kv_sink: Option<usize>,
    /// Evict (StreamingLLM): keep only the newest N tokens besides
    /// --evict-sink; whole blocks in between are dropped (0 = off).
    #[arg(long, default_value_t = 0)]
    pub(crate) evict_window: usize,
    /// First tokens eviction never drops (attention sinks; default 4).
    #[arg(long)]
    pub(crate) evict_sink: Option<usize>,
    /// Store identical quantized blocks once (needs --kv-quant).
    #[arg(long)]
    pub(crate) kv_share: bool,
    /// Store near-duplicate quantized blocks once: blocks whose dequantized
    /// K/V have at least this cosine (in (0, 1]), found by random-hyperplane
    /// hashing (needs --kv-quant; replaces --kv-share's exact matching).
    #[arg(long)]
    pub(crate) kv_share_cos: Option<f32>,
    /// Chat: drop turns older than the newest N (the first turn stays;
    /// 0 = keep everything).
    #[arg(long, default_value_t = 0)]
    pub(crate) keep_turns: u32,
    /// Chat: the context lifecycle — segments (sentences) labelled keep /
    /// compress / drop by the seed's rule (`rule`), or by the model in a
    /// labelling pass decoded freely (`free`) or under the label grammar
    /// (`constrained`), the rule standing in for missing labels.
    #[arg(long)]
    pub(crate) lifecycle: Option<String>,
    /// Lifecycle: newest rounds always kept (default 2).
    #[arg(long)]
    pub(crate) lifecycle_protect: Option<u32>,
    /// Lifecycle: K, rounds a dropped segment waits before its KV is freed
    /// (0 = at once; default 2).
    #[arg(long)]
    pub(crate) lifecycle_delay: Option<u32>,
    /// Lifecycle: segments this long or longer labelled compress are
    /// summarised by the model (0 = compression off; default 512).
    #[arg(long)]
    pub(crate) lifecycle_compress_min: Option<u64>,
    /// Bytes all KV tiers may hold, in MiB (0 = the hot tier's capacity).
    #[arg(long, default_value_t = 0)]
    pub(crate) kv_budget_mib: u64,
}

impl MechanismFlags {
    /// A flag that does nothing without another, or two that contradict
    /// each other: one line naming them (F10 of the inputs review).
    pub(crate) fn check_flags(&self) -> Result<(), EngineError> {
        if let Some((flag, _, (needed, _))) = self
            .details()
            .into_iter()
            .find(|&(_, given, (_, parent))| given && !parent)
        {
            return Err(EngineError::Request(format!(
                "{flag} needs {needed} (without it the flag does nothing)"
            )));
        }
        if self.kv_share && self.kv_share_cos.is_some() {
            return Err(EngineError::Request(
                "--kv-share (exact) and --kv-share-cos (near duplicates) are two sharings: give one".into(),
            ));
        }
        Ok(())
    }

    /// The chat-only flag given, if any (a lifecycle acts at turn ends).
    pub(crate) fn chat_only(&self) -> Option<&'static str> {
        if self.keep_turns > 0 {
            Some("--keep-turns")
        } else if self.lifecycle.is_some() {
            Some("--lifecycle")
        } else {
            None
        }
    }

    /// The first mechanism flag given, if any.
    pub(crate) fn given(&self) -> Option<&'static str> {
        [
            (self.kv_quant.is_some(), "--kv-quant"),
            (self.evict_window > 0, "--evict-window"),
            (self.kv_share, "--kv-share"),
            (self.kv_share_cos.is_some(), "--kv-share-cos"),
            (self.keep_turns > 0, "--keep-turns"),
            (self.lifecycle.is_some(), "--lifecycle"),
            (self.kv_budget_mib > 0, "--kv-budget-mib"),
        ]
        .into_iter()
        .find_map(|(set, flag)| set.then_some(flag))
    }

    /// The first detail flag of a mechanism given, if any.
    pub(crate) fn detail(&self) -> Option<&'static str> {
        self.details()
            .into_iter()
            .find_map(|(flag, given, _)| given.then_some(flag))
    }

    /// Each flag that only refines another: its name, whether it was given,
    /// and the flag it refines with whether that was given.
    #[allow(clippy::type_complexity)]
    fn details(&self) -> [(&'static str, bool, (&'static str, bool)); 11] {
        let cold = ("--kv-quant", self.kv_quant.is_some());
        let evict = ("--evict-window", self.evict_window > 0);
        let lc = ("--lifecycle", self.lifecycle.is_some());
        [
            ("--kv-window", self.kv_window.is_some(), cold),
            ("--kv-group", self.kv_group.is_some(), cold),
            ("--kv-keys", self.kv_keys.is_some(), cold),
            ("--kv-sink", self.kv_sink.is_some(), cold),
            ("--kv-rotate", self.kv_rotate, cold),
            ("--kv-share", self.kv_share, cold),
            ("--kv-share-cos", self.kv_share_cos.is_some(), cold),
            ("--evict-sink", self.evict_sink.is_some(), evict),
            ("--lifecycle-protect", self.lifecycle_protect.is_some(), lc),
            ("--lifecycle-delay", self.lifecycle_delay.is_some(), lc),
            (
                "--lifecycle-compress-min",
                self.lifecycle_compress_min.is_some(),
                lc,
            ),
        ]
    }

    pub(crate) fn apply(&self, cfg: &mut EngineConfig) -> Result<(), EngineError> {
        self.check_flags()?;
        cfg.kv_quant = self.spec()?;
        if self.evict_window > 0 {
            let params = serde_json::json!({
                "sink": self.evict_sink.unwrap_or(4),
                "window": self.evict_window,
            });
            cfg.evict_with(&Registry::builtin(), "sink-window", params)
                .map_err(|e| EngineError::Request(format!("--evict-window: {e}")))?;
        }
        cfg.dedup = match self.kv_share_cos {
            Some(threshold) => Some(DedupConfig::SimHash(SimHashConfig {
                threshold,
                ..SimHashConfig::default()
            })),
            None => self.kv_share.then_some(DedupConfig::Exact),
        };
        cfg.lifecycle = (self.keep_turns > 0).then_some(LifecycleConfig::RecentTurns {
            keep: self.keep_turns,
        });
        if let Some(name) = &self.lifecycle {
            if self.keep_turns > 0 {
                return Err(EngineError::Request(
                    "--lifecycle and --keep-turns are two lifecycles: give one".into(),
                ));
            }
            let source = match name.as_str() {
                "rule" => LabelSource::Rule,
                "free" => LabelSource::Free,
                "constrained" => LabelSource::Constrained,
                _ => {
                    return Err(EngineError::Request(format!(
                        "unknown --lifecycle {name:?}; choose rule, free or constrained"
                    )));
                }
            };
            cfg.lifecycle = Some(LifecycleConfig::Labels {
                source,
                protect: self.lifecycle_protect.unwrap_or(2),
                delay: self.lifecycle_delay.unwrap_or(2),
                min_match: 6,
                compress_min: Some(self.lifecycle_compress_min.unwrap_or(512)).filter(|&n| n > 0),
            });
        }
        cfg.kv_budget = self.kv_budget_mib.checked_mul(1 << 20).ok_or_else(|| {
            EngineError::Request(format!(
                "--kv-budget-mib {} is too large",
                self.kv_budget_mib
            ))
        })?;
        Ok(())
    }

    pub(crate) fn spec(&self) -> Result<Option<KvQuant>, EngineError> {
        let Some(format) = &self.kv_quant else {
            return Ok(None);
        };
        let key_axis = match self.kv_keys.as_deref().unwrap_or("channel") {
            "channel" => Axis::PerChannel,
            "token" => Axis::PerToken,
            other => {
                return Err(EngineError::Request(format!(
                    "unknown --kv-keys {other:?}; use channel or token"
                )));
            }
        };
        Ok(Some(KvQuant {
            group_size: self.kv_group.unwrap_or(32),
            window: self.kv_window.unwrap_or(128),
            rotate: self.kv_rotate,
            key_axis,
            sink: self.kv_sink.unwrap_or(32),
            ..KvQuant::parse(format)?
        }))
    }
}
