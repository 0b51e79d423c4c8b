//! The experiment file: model, workloads and the matrix of configurations,
//! in TOML (`configs/*.toml`). Unknown keys, unknown mechanisms and bad
//! values are errors naming the file, the line and the key.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
pub use kvforge_engine::mechanisms::{
    IndexName, KeyAxis, LifecycleSpec, Mechanisms, PolicySpec, PrefixSpec, Registry, ShareSpec,
    TailName, located,
};
use serde::Deserialize;
use toml::Spanned;

use crate::workloads::Workloads;

/// One experiment: a model, its workloads, the configurations to compare.
#[derive(Clone, Debug, Deserialize)]
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
    /// What its eviction and tier policy names are built by (not in the
    /// file: [`registry`](crate::registry) unless read with another).
    #[serde(skip, default = "crate::registry")]
    pub registry: Registry,
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

impl Experiment {
    /// Reads and checks `path` (its eviction policies against
    /// [`registry`](crate::registry)).
    pub fn load(path: &Path) -> Result<Experiment> {
        Self::read(path, crate::registry()).map(|(exp, _)| exp)
    }

    /// Reads and checks `path`, its policy names built by `registry`; and
    /// the text it was read from (read once: the run keeps it as its
    /// stamp). Only a regular file of at most 1 MiB is read (a FIFO or
    /// `/dev/zero` is one line, not a hang).
    pub fn read(path: &Path, registry: Registry) -> Result<(Experiment, String)> {
        let src = kvforge_engine::input::read_text(path, kvforge_engine::input::MAX_CONFIG_BYTES)
            .map_err(anyhow::Error::msg)?;
        Ok((Self::parse_with(&src, path, registry)?, src))
    }

    /// Parses and checks `src`, read from `path` (for messages), against
    /// [`registry`](crate::registry).
    pub fn parse(src: &str, path: &Path) -> Result<Experiment> {
        Self::parse_with(src, path, crate::registry())
    }

    /// [`parse`](Self::parse), its policy names built by `registry`.
    pub fn parse_with(src: &str, path: &Path, registry: Registry) -> Result<Experiment> {
        let mut exp: Experiment = match toml::from_str(src) {
            Ok(e) => e,
            Err(e) => bail!("{}", located(path, src, e.span(), e.message())),
        };
        exp.registry = registry;
        exp.check(src, path)?;
        Ok(exp)
    }

    /// The block size configuration `m` runs with (its own, else the
    /// model's).
    pub fn block_size(&self, m: &Mechanisms) -> usize {
        m.block_size.unwrap_or(self.model.block_size)
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

    /// The configurations' mechanisms, without their spans.
    pub fn matrix(&self) -> Vec<&Mechanisms> {
        self.configs.iter().map(|c| c.get_ref()).collect()
    }

    /// The configuration named `name`.
    pub fn config(&self, name: &str) -> Option<&Mechanisms> {
        self.configs
            .iter()
            .map(|c| c.get_ref())
            .find(|c| c.name() == name)
    }

    /// Whether configuration `name` runs `workload` (`chat`, `stream` or
    /// `passkey`): every workload unless its `workloads` lists some.
    pub fn runs(&self, name: &str, workload: &str) -> bool {
        self.config(name).is_some_and(|c| runs(c, workload))
    }

    /// The configuration the others are compared with.
    pub fn baseline(&self) -> &str {
        let m = self.matrix();
        m.iter()
            .find(|c| c.name() == "baseline")
            .or(m.first())
            .map_or("", |c| c.name())
    }

    fn check(&self, src: &str, path: &Path) -> Result<()> {
        let top = |msg: String| anyhow::anyhow!("{}", located(path, src, None, &msg));
        self.check_model().map_err(top)?;
        if self.configs.is_empty() {
            return Err(top("no [[config]]: the matrix is empty".into()));
        }
        self.workloads.check().map_err(top)?;
        self.check_configs(src, path)
    }

    /// The experiment's name and model settings, or what is wrong with
    /// them.
    fn check_model(&self) -> Result<(), String> {
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!(
                "name {:?} must be letters, digits, - and _ (it names the output folder)",
                self.name
            ));
        }
        let m = &self.model;
        if !(1..=4096).contains(&m.block_size) {
            return Err("model.block_size must be within 1..=4096".into());
        }
        if !["f32", "bf16", "f16"].contains(&m.weights.as_str()) {
            return Err(format!(
                "model.weights {:?}: use f32, bf16 or f16",
                m.weights
            ));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if m.threads < 0 || m.threads as usize > cores {
            return Err(format!(
                "model.threads = {} must be between 0 (libtorch's default) and this machine's {cores} cores",
                m.threads
            ));
        }
        Ok(())
    }

    /// Every configuration: named, safely and once; its mechanisms and the
    /// harness's own keys valid.
    fn check_configs(&self, src: &str, path: &Path) -> Result<()> {
        let mut names = std::collections::BTreeSet::new();
        let base = self.baseline();
        for c in &self.configs {
            let at = |msg: String| located(path, src, Some(c.span()), &msg);
            let mech = c.get_ref();
            if mech.name.is_none() {
                bail!("{}", at("a [[config]] needs a name".into()));
            }
            if !file_name_ok(mech.name()) {
                bail!(
                    "{}",
                    at(format!(
                        "config name {:?} must be 1 to {MAX_NAME} letters, digits, -, _, . or + and not start with . (it names files of the report)",
                        mech.name()
                    ))
                );
            }
            if !names.insert(mech.name()) {
                bail!("{}", at(format!("config {:?} appears twice", mech.name())));
            }
            if let Err(msg) = mech.check(self.block_size(mech), &self.registry) {
                bail!("{}", at(format!("config {:?}: {msg}", mech.name())));
            }
            if let Err(msg) = self.check_harness_keys(c.get_ref(), base, &names) {
                bail!("{}", at(format!("config {:?}: {msg}", mech.name())));
            }
        }
        Ok(())
    }

    /// `workloads` names workloads of the experiment; a `target_kv` is a
    /// share the configuration has a knob for, measured against a
    /// baseline that comes before it (`seen`) and runs its workloads.
    fn check_harness_keys(
        &self,
        c: &Mechanisms,
        base: &str,
        seen: &std::collections::BTreeSet<&str>,
    ) -> Result<(), String> {
        let w = &self.workloads;
        let present = |name: &str| match name {
            "chat" => w.chat.is_some(),
            "stream" => w.stream.is_some(),
            "passkey" => w.passkey.is_some(),
            _ => false,
        };
        if let Some(list) = &c.workloads {
            if list.is_empty() {
                return Err("workloads = [] runs nothing".into());
            }
            if let Some(bad) = list.iter().find(|x| !present(x)) {
                return Err(format!(
                    "workloads: {bad:?} is not a workload of this experiment (chat, stream, passkey)"
                ));
            }
        }
        let Some(t) = c.target_kv else {
            return Ok(());
        };
        if !(t > 0.0 && t < 1.0) {
            return Err(format!("target_kv = {t} must be within (0, 1)"));
        }
        crate::target::knob(c)?;
        let name = c.name();
        if name == base || !seen.contains(base) {
            return Err(format!(
                "target_kv is measured against the baseline {base:?}, which must come before it in the matrix and have no target_kv"
            ));
        }
        let b = self.config(base).ok_or("no baseline")?;
        for wl in ["chat", "stream", "passkey"] {
            if present(wl) && runs(c, wl) && !runs(b, wl) {
                return Err(format!(
                    "target_kv on {wl} needs the baseline {base:?} to run {wl}"
                ));
            }
        }
        Ok(())
    }
}

/// Whether `m` runs `workload`.
fn runs(m: &Mechanisms, workload: &str) -> bool {
    m.workloads
        .as_ref()
        .is_none_or(|w| w.iter().any(|x| x == workload))
}

/// The longest configuration name (it names files: `metrics/<name>-chat.prom`).
const MAX_NAME: usize = 64;

/// A configuration name that is safe as (part of) a file name in the
/// output folder: no separator, no `..`, not hidden, not too long.
fn file_name_ok(name: &str) -> bool {
    (1..=MAX_NAME).contains(&name.len())
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.+".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::PasskeyWorkload;

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
        assert_eq!(m[1].cold.unwrap().bits, 4);
        assert_eq!(m[1].cold.unwrap().key_axis, kvforge_quant::Axis::PerChannel);
        let e1 = m[1].eviction.as_ref().unwrap();
        assert_eq!(e1.policy, "sink-window");
        assert_eq!(e1.params["window"], 64);
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
        assert_eq!((e.block_size(m[0]), e.block_size(m[1])), (16, 8));
    }

    #[test]
    fn depths_that_name_one_item_twice_are_refused() {
        let pk = |depths: Vec<f64>| Workloads {
            passkey: Some(PasskeyWorkload {
                data: "essays".into(),
                lengths: vec![160],
                depths,
                chunk: 32,
                question_seen: false,
            }),
            ..Workloads::default()
        };
        let e = pk(vec![0.501, 0.502]).repeated_item().unwrap();
        assert!(e.contains("are the same item (depth0.50)"), "{e}");
        assert_eq!(pk(vec![0.5, 0.51]).repeated_item(), None);
        // NaN and -0.0 are out of range, not a repeated item.
        for depths in ["[nan, nan]", "[-0.0, 0.5]"] {
            let src = GOOD.replace(
                "[[config]]\nname = \"baseline\"",
                &format!(
                    "[workloads.passkey]\ndata = \"e\"\nlengths = [160]\ndepths = {depths}\nchunk = 32\n\n[[config]]\nname = \"baseline\""
                ),
            );
            let e = err(&src);
            assert!(e.contains("depths within [0, 1]"), "{depths}: {e}");
        }
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
                "x.toml:17:1:",
                "unknown eviction policy \"h3o\"; known: h2o, hybrid, keydiff, lfu, sink-window, snapkv, strided",
            ),
            // A parameter the policy does not take.
            (
                GOOD.replace("window = 64 }", "window = 64, stride = 3 }"),
                "x.toml:17:1:",
                "eviction sink-window: unknown field `stride`",
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
            // The red team of the inputs: names that escape the output
            // folder or cannot be file names, threads out of range, no
            // workloads, the same item twice.
            (
                GOOD.replace("name = \"all\"", "name = \"../../../escaped\""),
                "x.toml:17:1:",
                "config name \"../../../escaped\" must be 1 to 64 letters",
            ),
            (
                GOOD.replace("name = \"all\"", "name = \"a/b\""),
                "x.toml:17:1:",
                "it names files of the report",
            ),
            (
                GOOD.replace("name = \"all\"", &format!("name = \"{}\"", "n".repeat(300))),
                "x.toml:17:1:",
                "must be 1 to 64",
            ),
            (
                GOOD.replace("block_size = 16", "block_size = 16\nthreads = 100000"),
                "x.toml:",
                "model.threads = 100000 must be between 0",
            ),
            (
                GOOD.replace("block_size = 16", "block_size = 16\nthreads = -3"),
                "x.toml:",
                "model.threads = -3 must be between 0",
            ),
            (
                GOOD.replace(
                    "[workloads.stream]\ndata = \"wiki\"\ncontexts = [256]\nprefix = 64\nchunk = 32\ndecode = 4\n",
                    "",
                ),
                "x.toml:",
                "nothing to measure",
            ),
            (
                GOOD.replace("contexts = [256]", "contexts = [256, 256]"),
                "x.toml:",
                "workloads.stream.contexts lists 256 twice",
            ),
        ];
        for (src, at, what) in cases {
            let e = err(&src);
            assert!(e.starts_with(at) && e.contains(what), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn target_kv_and_workloads_are_checked_before_anything_runs() {
        let ok = GOOD.replace(
            "name = \"all\"",
            "name = \"all\"\ntarget_kv = 0.25\nworkloads = [\"stream\"]",
        );
        let e = Experiment::parse(&ok, Path::new("x.toml")).unwrap();
        assert!(e.runs("all", "stream") && !e.runs("all", "chat") && e.runs("baseline", "chat"));
        assert_eq!(e.config("all").and_then(|c| c.target_kv), Some(0.25));
        let cases = [
            ("target_kv = 1.5", "target_kv = 1.5 must be within (0, 1)"),
            ("target_kv = 0.0", "must be within (0, 1)"),
            ("target_kv = nan", "must be within (0, 1)"),
            ("target_kv = \"half\"", "invalid type"),
            ("workloads = []", "workloads = [] runs nothing"),
            (
                "workloads = [\"passkey\"]",
                "\"passkey\" is not a workload of this experiment",
            ),
        ];
        for (line, what) in cases {
            let src = GOOD.replace("name = \"all\"", &format!("name = \"all\"\n{line}"));
            let e = err(&src);
            assert!(e.starts_with("x.toml:") && e.contains(what), "{line}: {e}");
        }
        // Nothing to size; a target on the baseline itself.
        let src = GOOD.replace(
            "name = \"baseline\"",
            "name = \"baseline\"\ntarget_kv = 0.5",
        );
        assert!(
            err(&src).contains("needs something to size"),
            "{}",
            err(&src)
        );
        let src = GOOD.replace("name = \"baseline\"", "name = \"baseline\"\neviction = { policy = \"sink-window\", sink = 16, window = 64 }\ntarget_kv = 0.5");
        assert!(err(&src).contains("must come before it"), "{}", err(&src));
        // The baseline must run what a target is measured on.
        let src = GOOD
            .replace("name = \"baseline\"", "name = \"baseline\"\nworkloads = [\"stream\"]")
            .replace("[workloads.stream]", "[workloads.chat]\ndata = \"c\"\nchats = 1\nturns = 2\nanswer_tokens = 4\n\n[workloads.stream]")
            .replace("name = \"all\"", "name = \"all\"\ntarget_kv = 0.5");
        assert!(
            err(&src).contains("needs the baseline \"baseline\" to run chat"),
            "{}",
            err(&src)
        );
    }
}
