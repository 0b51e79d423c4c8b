//! One configuration's engine and how it measures each workload's item: a
//! chat as one session, a stream's perplexity, a pass key's answer, each
//! as a [`Record`].

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use kvforge_engine::{
    CacheManager, Engine, EngineConfig, Llama, Message, ReuseConfig, SamplingParams, Sequence,
    Tokenizer,
};

use crate::config::{Experiment, Mechanisms};
use crate::items::{
    Inputs, Item, PASSKEY_ANSWER, RECALL_PRIMER, SYSTEM, chat_seed, chat_users, first_number,
    passkey_prompt, passkey_seed,
};
use crate::record::Record;
use crate::workloads::{ChatWorkload, PasskeyWorkload, StreamWorkload};

/// The engine of one configuration for one workload.
pub(crate) struct Runner<'a> {
    manager: CacheManager,
    tok: &'a Tokenizer,
}

/// Engine and reuse configuration of `m` (its policies built by the
/// experiment's registry).
fn configure(exp: &Experiment, m: &Mechanisms) -> Result<(EngineConfig, ReuseConfig)> {
    let mut cfg = EngineConfig {
        weight_kind: None,
        kv_kind: Some(kvforge_engine::parse_dtype(crate::HOT_KV)?),
        block_size: exp.model.block_size,
        ..EngineConfig::default()
    };
    // The harness's own keys are resolved (or used) here, not by the engine.
    let m = Mechanisms {
        target_kv: None,
        workloads: None,
        ..m.clone()
    };
    let reuse = m
        .apply(&mut cfg, &exp.registry, Some(exp.model.seed))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((cfg, reuse))
}

impl<'a> Runner<'a> {
    pub(crate) fn new(
        exp: &Experiment,
        m: &Mechanisms,
        model: &Llama,
        tok: &'a Tokenizer,
    ) -> Result<Self> {
        let (cfg, reuse) = configure(exp, m)?;
        let engine = Engine::new(model.share(), tok.clone(), &cfg)?;
        let manager = CacheManager::new(engine, reuse)?;
        Ok(Runner { manager, tok })
    }

    pub(crate) fn item(&mut self, inputs: &Inputs, item: &Item) -> Result<Record> {
        match item.workload {
            "chat" => {
                let (w, chats) = inputs.chat.as_ref().context("no chat workload")?;
                self.chat(w, &chats[item.index], chat_seed(inputs, item))
            }
            "stream" => {
                let (w, ids) = inputs.stream.as_ref().context("no stream workload")?;
                let mut r = self.stream(w, &ids[item.article][..item.index])?;
                r.values.insert("article".into(), item.article as f64);
                Ok(r)
            }
            _ => {
                let (w, hay) = inputs.passkey.as_ref().context("no passkey workload")?;
                self.passkey(w, hay, item.index, item.depth, passkey_seed(inputs, item))
            }
        }
    }

    /// Block sizes of its cache (hot, and cold when it has a cold tier).
    pub(crate) fn sizes(&self) -> crate::target::Sizes {
        let cache = &self.engine().cache();
        let t = cache.tier_stats();
        crate::target::Sizes {
            block: cache.block_size(),
            hot: t.first().map_or(0, |t| t.pool.block_bytes),
            cold: t.get(1).map(|t| t.pool.block_bytes),
        }
    }

    /// Its engine's metrics, in Prometheus' text format.
    pub(crate) fn prometheus(&self) -> String {
        kvforge_engine::metrics::prometheus(&self.manager.metrics())
    }

    fn engine(&self) -> &Engine {
        self.manager.engine()
    }

    /// One conversation as one session: the planted fact in the second
    /// user message, the recall question after the last.
    fn chat(&self, w: &ChatWorkload, chat: &[String], seed: u64) -> Result<Record> {
        let tok = self.tok;
        let (code, users) = chat_users(chat, seed);
        let params = SamplingParams {
            max_tokens: w.answer_tokens,
            ..SamplingParams::default()
        };
        let before = self.manager.metrics();
        let id = self.manager.open_session("chat");
        let mut rec = Record::default();
        let mut closed = true;
        let mut peak_all: f64 = 0.0;
        let mut answer = String::new();
        let out = (|| -> Result<()> {
            for (t, text) in users.iter().enumerate() {
                let mut ids = if t == 0 {
                    tok.chat_ids(&[Message::new("system", SYSTEM), Message::new("user", text)])?
                } else {
                    tok.user_turn_ids(!closed, text)?
                };
                if t + 1 == users.len() {
                    // The answer's start is given, as in pass key retrieval.
                    ids.extend(tok.encode_text(RECALL_PRIMER)?);
                }
                let cache = &self.engine().cache();
                let mut peak = cache.bytes_in_use();
                let r = self.manager.turn(id, &ids, &params, &mut |_, _| {
                    peak = peak.max(cache.bytes_in_use());
                    true
                })?;
                closed = r.generation.stopped_at_eos;
                let m = self.manager.metrics();
                let now = cache.bytes_in_use();
                peak = peak.max(now);
                peak_all = peak_all.max(peak as f64);
                let tier = |i: usize| m["tiers"][i]["bytes_in_use"].as_f64().unwrap_or(0.0);
                let f = |a: &str, b: &str| m[a][b].as_f64().unwrap_or(0.0);
                rec.turns.push(BTreeMap::from([
                    ("prompt_tokens".into(), r.prompt_tokens as f64),
                    ("reused_tokens".into(), r.reused_tokens as f64),
                    ("new_tokens".into(), r.generation.tokens.len() as f64),
                    ("ttft_ms".into(), r.ttft_secs * 1e3),
                    ("kv_bytes".into(), now as f64),
                    ("peak_kv_bytes".into(), peak as f64),
                    ("hot_bytes".into(), tier(0)),
                    ("cold_bytes".into(), tier(1)),
                    ("index_hit_rate".into(), f("index", "hit_rate")),
                    ("evicted_entries".into(), f("policies", "evicted_entries")),
                    ("demoted_blocks".into(), f("policies", "demoted_blocks")),
                    (
                        "lifecycle_dropped_entries".into(),
                        f("policies", "lifecycle_dropped_entries"),
                    ),
                    ("shared_blocks".into(), f("sharing", "shared")),
                ]));
                if t + 1 == users.len() {
                    answer = tok.decode_text(&r.generation.tokens)?;
                }
            }
            Ok(())
        })();
        let closed_ok = self.manager.close_session(id);
        out?;
        closed_ok?;
        let after = self.manager.metrics();
        let delta = |k: &str| {
            after["index"][k].as_f64().unwrap_or(0.0) - before["index"][k].as_f64().unwrap_or(0.0)
        };
        let recalled = first_number(&answer) == code.to_string();
        rec.answer = Some(answer);
        let turns = rec.turns.len().max(1) as f64;
        let sum = |k: &str| {
            rec.turns
                .iter()
                .map(|t| t.get(k).copied().unwrap_or(0.0))
                .sum::<f64>()
        };
        rec.values = BTreeMap::from([
            ("turns".into(), rec.turns.len() as f64),
            ("peak_kv_bytes".into(), peak_all),
            ("mean_kv_bytes".into(), sum("peak_kv_bytes") / turns),
            ("recalled".into(), f64::from(u8::from(recalled))),
            ("index_hit_tokens".into(), delta("hit_tokens")),
            ("index_query_tokens".into(), delta("query_tokens")),
            (
                "prompt_tokens".into(),
                rec.turns.last().map_or(0.0, |t| t["prompt_tokens"]),
            ),
        ]);
        Ok(rec)
    }

    fn stream(&self, w: &StreamWorkload, ids: &[u32]) -> Result<Record> {
        let r = self
            .engine()
            .streaming_ppl(ids, w.prefix, w.chunk, w.decode)?;
        Ok(Record {
            values: BTreeMap::from([
                ("context".into(), ids.len() as f64),
                ("ppl".into(), r.ppl),
                ("nll_sum".into(), r.nll_sum),
                ("scored".into(), r.scored as f64),
                ("kv_bytes".into(), r.kv_bytes as f64),
                ("hot_bytes".into(), r.hot_bytes as f64),
                ("cold_bytes".into(), r.cold_bytes as f64),
                ("tok_s".into(), r.tokens_per_sec),
                ("decode_tok_s".into(), r.decode_tokens_per_sec),
                (
                    "dropped_chunks".into(),
                    r.chunks.iter().filter(|c| !c.1.is_finite()).count() as f64,
                ),
            ]),
            // A chunk whose NLL is not finite would not read back (JSON has
            // no NaN); it is left out, and a record that dropped one is
            // not paired chunk by chunk (`dropped_chunks`).
            chunks: r
                .chunks
                .iter()
                .filter(|c| c.1.is_finite())
                .map(|&(n, nll)| [n as f64, nll])
                .collect(),
            ..Record::default()
        })
    }

    fn passkey(
        &self,
        w: &PasskeyWorkload,
        hay: &[u32],
        length: usize,
        depth: f64,
        seed: u64,
    ) -> Result<Record> {
        let tok = self.tok;
        let prompt = passkey_prompt(tok, hay, length, depth, seed)?;
        let (key, (context, question)) = (prompt.key, prompt.split(w.question_seen));
        let engine = self.engine();
        let mut seq = Sequence::default();
        engine.cache().take_step_peak_bytes();
        let out = (|| -> Result<(String, u64, u64)> {
            let mut peak = 0;
            for piece in context.chunks(w.chunk) {
                let _last =
                    engine
                        .model()
                        .forward(piece, &mut engine.cache().view(&mut seq), false)?;
                peak = peak.max(engine.cache().bytes_in_use());
            }
            let params = SamplingParams {
                max_tokens: PASSKEY_ANSWER,
                ..SamplingParams::default()
            };
            let g = engine.generate(&mut seq, &question, &params, &mut |_, _| true)?;
            let end = engine.cache().bytes_in_use();
            Ok((tok.decode_text(&g.tokens)?, peak.max(end), end))
        })();
        let step_peak = engine.cache().take_step_peak_bytes();
        let freed = engine.cache().free(&mut seq);
        let (answer, peak, end) = out?;
        freed?;
        Ok(Record {
            values: BTreeMap::from([
                ("length".into(), (context.len() + question.len()) as f64),
                ("depth".into(), depth),
                (
                    "correct".into(),
                    f64::from(u8::from(first_number(&answer) == key.to_string())),
                ),
                ("kv_bytes".into(), peak as f64),
                // After the answer: what the compressed cache settled to.
                ("end_kv_bytes".into(), end as f64),
                // Inside a step: what it releases at commit still held.
                ("step_peak_kv_bytes".into(), step_peak as f64),
            ]),
            answer: Some(answer),
            ..Record::default()
        })
    }
}
