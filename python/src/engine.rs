//! The engine from Python: [`Engine`] wraps the engine's `CacheManager`
//! (a model, its tokenizer and the paged cache with the configured
//! mechanisms); `kvforge/engine.py` gives it its Python shape (chat
//! sessions, mechanisms as a dict or a TOML path, the default model).
//! [`ablate`] runs `cargo xtask ablate`'s runner in this process, so a
//! policy written in Python runs in it.
//!
//! Work runs with the GIL released; a Python policy takes it back for
//! each call. Every bad input is a `ValueError`, every failed step (a
//! policy that raised, a full cache) a `RuntimeError`, each with the
//! engine's one-line message; a failed call changes nothing.

use std::path::PathBuf;
use std::sync::Arc;

use kvforge_engine::mechanisms::Mechanisms;
use kvforge_engine::{
    CacheManager, EngineConfig, EngineError, Llama, LlamaConfig, ReuseConfig, Tokenizer, gguf,
    parse_device, parse_dtype,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{bad, done, raise};
use crate::policy::{PyPolicy, not_in_policy};
use crate::reply::{Sampling, replied};
use crate::tier::PyTier;

/// The dimensions of a random-weight model: `(d_model, layers, heads,
/// kv_heads, ffn, max_ctx)`.
type RandomDims = (usize, usize, usize, usize, usize, usize);

/// A model, its tokenizer and a paged KV cache with kvforge's mechanisms.
#[pyclass(module = "kvforge._native", frozen)]
pub(crate) struct Engine {
    manager: CacheManager,
}

/// The mechanisms of `json` (a table as JSON) or `path` (a TOML file).
fn mechanisms(
    json: Option<String>,
    path: Option<PathBuf>,
    block_size: usize,
) -> PyResult<Option<Mechanisms>> {
    let registry = crate::resolve::registry();
    match (json, path) {
        (Some(_), Some(_)) => Err(bad(
            "kvforge: give the mechanisms as a table or a file, not both",
        )),
        (None, Some(path)) => Mechanisms::load(&path, block_size, &registry)
            .map(Some)
            .map_err(bad),
        (Some(json), None) => {
            let m: Mechanisms = serde_json::from_str(&json).map_err(|e| {
                // Without " at line 1 column 21" of JSON the caller never wrote.
                let words = e.to_string();
                let words = words.split(" at line ").next().unwrap_or_default();
                bad(format!("mechanisms: {words}"))
            })?;
            m.check(m.block_size.unwrap_or(block_size), &registry)
                .map_err(|e| bad(format!("mechanisms: {e}")))?;
            Ok(Some(m))
        }
        (None, None) => Ok(None),
    }
}

/// Loads the model at `path` (or a random-weight one of `random`'s
/// dimensions with `path`'s tokenizer).
fn load(
    path: &std::path::Path,
    random: Option<RandomDims>,
    seed: i64,
    cfg: &EngineConfig,
) -> kvforge_engine::Result<kvforge_engine::Engine> {
    let Some((d_model, layers, heads, kv_heads, ffn, max_ctx)) = random else {
        return kvforge_engine::Engine::load(path, cfg);
    };
    if heads == 0 || d_model % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(EngineError::Request(format!(
            "random model: d_model {d_model} must split into heads {heads}, heads into kv_heads {kv_heads}"
        )));
    }
    let g = gguf::GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&g)?;
    let mc = LlamaConfig {
        vocab: tokenizer.vocab,
        d_model,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: d_model / heads,
        ffn,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        max_ctx,
    };
    let model = Llama::random(mc, seed, cfg.device, cfg.kind)?;
    kvforge_engine::Engine::new(model, tokenizer, cfg)
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model, *, mechanisms_json = None, mechanisms_path = None, policy = None,
        tier_policy = None, random = None, seed = 0, device = "cpu", dtype = "f32", kv_dtype = "f16", block_size = 16,
        kv_tokens = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        mechanisms_json: Option<String>,
        mechanisms_path: Option<PathBuf>,
        policy: Option<Bound<'_, PyAny>>,
        tier_policy: Option<Bound<'_, PyAny>>,
        random: Option<RandomDims>,
        seed: i64,
        device: &str,
        dtype: &str,
        kv_dtype: &str,
        block_size: usize,
        kv_tokens: usize,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(bad("kvforge: block_size must be at least 1"));
        }
        let mut cfg = EngineConfig {
            device: parse_device(device).map_err(raise)?,
            kind: parse_dtype(dtype).map_err(raise)?,
            kv_kind: Some(parse_dtype(kv_dtype).map_err(raise)?),
            block_size,
            kv_tokens,
            ..EngineConfig::default()
        };
        let mut reuse = ReuseConfig {
            enabled: false,
            ..ReuseConfig::default()
        };
        if let Some(m) = mechanisms(mechanisms_json, mechanisms_path, block_size)? {
            reuse = m
                .apply(&mut cfg, &crate::resolve::registry(), None)
                .map_err(bad)?;
        }
        if let Some(obj) = policy {
            PyPolicy::wrap(&obj)?;
            let obj = obj.unbind();
            cfg.policies.eviction = Some(Arc::new(move || {
                Python::attach(|py| PyPolicy::wrap(obj.bind(py)))
                    .map(|p| Box::new(p) as Box<dyn kvforge_evict::EvictionPolicy>)
                    .map_err(|e| e.to_string())
            }));
        }
        if let Some(obj) = tier_policy {
            PyTier::wrap(&obj)?;
            let obj = obj.unbind();
            cfg.policies.tier = Some(Arc::new(move || {
                Python::attach(|py| PyTier::wrap(obj.bind(py)))
                    .map(|p| Box::new(p) as Box<dyn kvforge_quant::TierPolicy>)
                    .map_err(|e| e.to_string())
            }));
        }
        let manager = py.detach(|| {
            let engine = load(&model, random, seed, &cfg)?;
            CacheManager::new(engine, reuse)
        });
        Ok(Engine {
            manager: manager.map_err(raise)?,
        })
    }

    /// The ids of `text`; control tokens in it are parsed only with
    /// `special`.
    #[pyo3(signature = (text, special = false))]
    fn encode(&self, text: &str, special: bool) -> PyResult<Vec<u32>> {
        let t = &self.manager.engine().tokenizer();
        if special {
            t.encode(text)
        } else {
            t.encode_text(text)
        }
        .map_err(raise)
    }

    /// The text of `ids`.
    fn decode(&self, ids: Vec<u32>) -> PyResult<String> {
        let t = &self.manager.engine().tokenizer();
        if let Some(bad_id) = ids.iter().find(|&&i| i as usize >= t.vocab) {
            return Err(bad(format!(
                "kvforge: token id {bad_id} is outside the vocabulary of {}",
                t.vocab
            )));
        }
        t.decode(&ids).map_err(raise)
    }

    /// `messages` (`(role, content)` pairs) in the chat template, the
    /// assistant's turn opened.
    fn chat_ids(&self, messages: Vec<(String, String)>) -> PyResult<Vec<u32>> {
        let m: Vec<_> = messages
            .iter()
            .map(|(r, c)| kvforge_engine::Message::new(r, c))
            .collect();
        self.manager
            .engine()
            .tokenizer()
            .chat_ids(&m)
            .map_err(raise)
    }

    /// A later user turn: `msg` after a reply (closed with `<|im_end|>`
    /// first unless `closed`).
    fn user_turn_ids(&self, closed: bool, msg: &str) -> PyResult<Vec<u32>> {
        let t = &self.manager.engine().tokenizer();
        t.user_turn_ids(!closed, msg).map_err(raise)
    }

    /// One stateless request: the reply to `ids` (reusing a cached prefix
    /// when prefix reuse is on) and its report.
    fn complete<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        sampling: Sampling,
    ) -> PyResult<(String, Bound<'py, PyDict>)> {
        replied(
            py,
            self.manager.engine().cache(),
            sampling,
            |params, on_token| self.manager.complete(&ids, "", params, on_token),
        )
    }

    /// Opens a chat session; its id.
    fn open_session(&self) -> PyResult<u64> {
        not_in_policy()?;
        Ok(self.manager.open_session(""))
    }

    /// One turn of session `id`: `ids` follow the previous reply.
    fn turn<'py>(
        &self,
        py: Python<'py>,
        id: u64,
        ids: Vec<u32>,
        sampling: Sampling,
    ) -> PyResult<(String, Bound<'py, PyDict>)> {
        replied(
            py,
            self.manager.engine().cache(),
            sampling,
            |params, on_token| self.manager.turn(id, &ids, params, on_token),
        )
    }

    /// Closes session `id`, releasing its blocks.
    fn close_session(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        not_in_policy()?;
        done(py.detach(|| self.manager.close_session(id)))
    }

    /// Perplexity of `ids` through the cache: streaming (prefill
    /// `prefix`, then chunks of `chunk`; `decode` timed greedy steps at
    /// the end) or, with `window`, windows from an empty cache.
    #[pyo3(signature = (ids, prefix, chunk, decode = 0, window = None))]
    fn ppl<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        prefix: usize,
        chunk: usize,
        decode: usize,
        window: Option<usize>,
    ) -> PyResult<Bound<'py, PyDict>> {
        not_in_policy()?;
        let e = self.manager.engine();
        let r = done(py.detach(|| match window {
            Some(w) => e.window_ppl(&ids, w),
            None => e.streaming_ppl(&ids, prefix, chunk, decode),
        }))?;
        let d = PyDict::new(py);
        d.set_item("ppl", r.ppl)?;
        d.set_item("scored", r.scored)?;
        d.set_item("nll_sum", r.nll_sum)?;
        d.set_item("kv_bytes", r.kv_bytes)?;
        d.set_item("hot_bytes", r.hot_bytes)?;
        d.set_item("cold_bytes", r.cold_bytes)?;
        d.set_item("kv_bytes_per_token", r.kv_bytes_per_token)?;
        d.set_item("tokens_per_s", r.tokens_per_sec)?;
        d.set_item("decode_tokens_per_s", r.decode_tokens_per_sec)?;
        d.set_item("chunks", r.chunks)?;
        Ok(d)
    }

    /// The manager's metrics (counters, tiers, policies) as JSON.
    fn metrics_json(&self, py: Python<'_>) -> PyResult<String> {
        not_in_policy()?;
        Ok(py.detach(|| self.manager.metrics().to_string()))
    }

    /// Blocks in use in each tier, hot first.
    fn blocks_in_use(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        not_in_policy()?;
        let e = self.manager.engine();
        Ok(py.detach(|| {
            e.cache()
                .tier_stats()
                .iter()
                .map(|t| t.pool.in_use)
                .collect()
        }))
    }
}
