//! [`Record`]: one measured item of one workload under one configuration,
//! what the runner writes (`items.jsonl`) and the report, the intervals
//! and the equal-memory tables read.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One measured item of one workload under one configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Configuration name.
    pub config: String,
    /// `chat`, `stream` or `passkey`.
    pub workload: String,
    /// The item (`chat0`, `ctx4096`, `len1024-depth0.50`).
    pub item: String,
    /// Why it failed, if it did (the other items still run).
    pub error: Option<String>,
    /// Its measurements.
    pub values: BTreeMap<String, f64>,
    /// Per-turn snapshots (chats).
    pub turns: Vec<BTreeMap<String, f64>>,
    /// The scored answer (the recall turn's, the pass key's).
    pub answer: Option<String>,
    /// Streams: each scored chunk's `[tokens, NLL sum]`, in order (what
    /// the perplexity change's paired interval resamples).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<[f64; 2]>,
    /// The seed of its random choices (the chat's code, the pass key);
    /// its token ids are in the run's `inputs.jsonl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Seconds it took.
    pub secs: f64,
    /// The commit that measured it.
    #[serde(default)]
    pub commit: String,
}

impl Record {
    /// The value of `key`, NaN when absent.
    pub fn get(&self, key: &str) -> f64 {
        self.values.get(key).copied().unwrap_or(f64::NAN)
    }
}
