//! The cache manager: prefix reuse across turns, requests and sessions.
//!
//! Every request opens a sequence in the cache's coordinator, which starts
//! it with the longest verified cached prefix (hot or quantized blocks,
//! with a reference on each); the request prefills only the rest and
//! registers its completed blocks afterwards, so a system prompt shared by
//! many requests is computed once. Whatever else the cache is configured
//! with (a quantized cold tier, eviction, sharing, lifecycle) runs inside
//! the coordinator's steps, together with reuse. Two request shapes:
//!
//! * **stateless** ([`CacheManager::complete`]): the client sends the whole
//!   history every turn, as OpenAI-style APIs do;
//! * **sessions** ([`CacheManager::open_session`], [`CacheManager::turn`]):
//!   the manager keeps the sequence between turns; the first turn of a
//!   session still reuses what other requests cached.
//!
//! A namespace comes with every request; two namespaces never share a block.
//! The partial last block of each turn is cached too ([`TurnTail::Copy`],
//! the default): the session goes on filling it, and a request that
//! continues it copies its tokens into a block of its own, so the next
//! turn reuses every token computed before without leaving partly empty
//! blocks behind.
//!
//! No lock is held across a generation: the coordinator is locked for the
//! plan and the commit of each step, so requests and sessions of many
//! threads generate at the same time. A session is busy while one of its
//! turns runs. A failed request leaves the pools and the index as they
//! were; a failed session turn is rolled back exactly (demotions and drops
//! included). So does a request that panics (in the model, or in the
//! caller's `on_token`): its blocks are given back (a session is rolled
//! back to before the turn) before the panic continues.

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvforge_coordinator::{BlockTable, PrefixConfig};
pub use kvforge_coordinator::{IndexKind, TurnTail};
use kvforge_prefix::ExtraKeys;

use crate::cache::Sequence;
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::generate::{Generation, SamplingParams};
use crate::lifecycle::{self, LifecycleReport};

/// How the manager reuses KV.
#[derive(Clone, Debug)]
pub struct ReuseConfig {
    /// Look up and register prefixes at all (off = recompute everything).
    pub enabled: bool,
    /// The index implementation.
    pub index: IndexKind,
    /// What becomes of the partial last block of every turn.
    pub tail: TurnTail,
    /// Hash seed; `None` draws a random one (the safe default).
    pub seed: Option<u64>,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            enabled: true,
            index: IndexKind::HashChain,
            tail: TurnTail::Copy,
            seed: None,
        }
    }
}

/// What one turn did.
#[derive(Clone, Debug, Default)]
pub struct TurnReport {
    /// Tokens in the prompt (for a session turn: the whole sequence so far).
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused instead of computed.
    pub reused_tokens: usize,
    /// Prompt tokens prefilled.
    pub prefilled_tokens: usize,
    /// Seconds from the request to its first new token.
    pub ttft_secs: f64,
    /// KV bytes held by all live sequences when the turn ended.
    pub kv_bytes_in_use: u64,
    /// The generation itself.
    pub generation: Generation,
    /// What the context lifecycle did when the turn ended (sessions with a
    /// lifecycle only).
    pub lifecycle: Option<LifecycleReport>,
}

struct Session {
    extra: ExtraKeys,
    seq: Sequence,
    /// Tokens whose KV `seq` holds.
    tokens: Vec<u32>,
    /// Sampled but not yet run through the model (the last reply's last).
    pending: Vec<u32>,
}

#[derive(Default)]
struct Totals {
    requests: u64,
    prompt_tokens: u64,
    reused_tokens: u64,
    last: Option<TurnReport>,
}

/// An [`Engine`] with prefix reuse, sessions and metrics.
pub struct CacheManager {
    cfg: ReuseConfig,
    engine: Engine,
    /// `None` while a turn of the session runs.
    sessions: Mutex<BTreeMap<SessionId, Option<Session>>>,
    next_session: AtomicU64,
    totals: Mutex<Totals>,
}

/// A session handle.
pub type SessionId = u64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CacheManager {
    /// Wraps `engine`, turning prefix reuse on (or off) in its cache on top
    /// of whatever else the cache is configured with (cold tier, eviction,
    /// sharing, lifecycle).
    pub fn new(mut engine: Engine, cfg: ReuseConfig) -> Result<Self> {
        let mut c = engine.cache.config();
        c.prefix = cfg.enabled.then_some(PrefixConfig {
            index: cfg.index,
            seed: cfg.seed,
            tail: cfg.tail,
        });
        let quant = engine.cache.cold_tier();
        engine.cache.configure(c, quant)?;
        Ok(CacheManager {
            cfg,
            engine,
            sessions: Mutex::new(BTreeMap::new()),
            next_session: AtomicU64::new(1),
            totals: Mutex::new(Totals::default()),
        })
    }

    /// Runs `f` with the engine (tokenizer, model, cache).
    pub fn with_engine<T>(&self, f: impl FnOnce(&Engine) -> T) -> T {
        f(&self.engine)
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Stateless request: `tokens` is the whole conversation so far.
    pub fn complete(
        &self,
        tokens: &[u32],
        namespace: &str,
        params: &SamplingParams,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<TurnReport> {
        let start = Instant::now();
        let engine = &self.engine;
        check_request(engine, 0, tokens, params)?;
        let extra = ExtraKeys::namespace(namespace);
        let mut seq = engine.cache.open(tokens, &extra)?;
        let reused = seq.len();
        let timed = generate_timed(engine, &mut seq, &tokens[reused..], params, on_token, start);
        let (generation, ttft) = match timed {
            Timed::Done(g, ttft) => (g, ttft),
            Timed::Failed(e) => {
                engine.cache.free(&mut seq)?;
                return Err(e);
            }
            Timed::Panicked(payload) => {
                engine.cache.free(&mut seq)?;
                resume_unwind(payload);
            }
        };
        let mut held = tokens.to_vec();
        held.extend(&generation.tokens[..generation.tokens.len().saturating_sub(1)]);
        let registered = engine.cache.register(&seq, &held, &extra);
        engine.cache.free(&mut seq)?;
        registered?;
        Ok(self.account(tokens.len(), reused, ttft, generation))
    }

    /// Opens a session in `namespace`.
    pub fn open_session(&self, namespace: &str) -> SessionId {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let s = Session {
            extra: ExtraKeys::namespace(namespace),
            seq: Sequence::default(),
            tokens: Vec::new(),
            pending: Vec::new(),
        };
        lock(&self.sessions).insert(id, Some(s));
        id
    }

    /// One turn of a session: `new_tokens` follow the previous reply.
    /// On error the session is as it was before the call.
    pub fn turn(
        &self,
        id: SessionId,
        new_tokens: &[u32],
        params: &SamplingParams,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
    ) -> Result<TurnReport> {
        let start = Instant::now();
        let mut s = self.take_session(id)?;
        let mut panicked = None;
        let out = self.run_turn(&mut s, new_tokens, params, on_token, start, &mut panicked);
        lock(&self.sessions).insert(id, Some(s));
        if let Some(payload) = panicked {
            resume_unwind(payload);
        }
        out
    }

    fn run_turn(
        &self,
        s: &mut Session,
        new_tokens: &[u32],
        params: &SamplingParams,
        on_token: &mut dyn FnMut(u32, &str) -> bool,
        start: Instant,
        panicked: &mut Option<Box<dyn Any + Send>>,
    ) -> Result<TurnReport> {
        let engine = &self.engine;
        if new_tokens.is_empty() {
            return Err(EngineError::Request("empty prompt".into()));
        }
        let mut input = s.pending.clone();
        input.extend_from_slice(new_tokens);
        check_request(engine, s.seq.len(), &input, params)?;
        let first_turn = s.tokens.is_empty();
        if first_turn {
            s.seq = engine.cache.open(&input, &s.extra)?;
        }
        if let Err(e) = engine.cache.begin_turn(&mut s.seq) {
            if first_turn {
                engine.cache.free(&mut s.seq)?;
            }
            return Err(e);
        }
        let skip = s.seq.len() - s.tokens.len();
        let timed = generate_timed(engine, &mut s.seq, &input[skip..], params, on_token, start);
        let undo = |s: &mut Session| -> Result<()> {
            engine.cache.rollback_turn(&mut s.seq)?;
            if first_turn {
                engine.cache.free(&mut s.seq)?;
            }
            Ok(())
        };
        let (generation, ttft) = match timed {
            Timed::Done(g, ttft) => (g, ttft),
            Timed::Failed(e) => {
                undo(s)?;
                return Err(e);
            }
            Timed::Panicked(payload) => {
                undo(s)?;
                *panicked = Some(payload);
                return Err(EngineError::Request("the turn panicked".into()));
            }
        };
        let reused = skip.min(input.len());
        let prompt_len = s.tokens.len() + input.len();
        s.tokens.extend(&input);
        let (last, rest) = generation.tokens.split_last().unwrap_or((&0, &[]));
        s.tokens.extend(rest);
        s.pending = vec![*last];
        engine.cache.register(&s.seq, &s.tokens, &s.extra)?;
        let prior = prompt_len - input.len();
        let source = engine.cache.coordinator().lifecycle_source();
        let lifecycle = match source {
            Some(source) => Some(lifecycle::end_turn(
                engine,
                &mut s.seq,
                &s.tokens,
                &mut s.pending,
                prior,
                prior + input.len(),
                source,
            )?),
            None => {
                engine.cache.end_turn(&mut s.seq)?;
                None
            }
        };
        let mut report = self.account(prompt_len, prior + reused, ttft, generation);
        report.lifecycle = lifecycle;
        if let Some(t) = lock(&self.totals).last.as_mut() {
            t.lifecycle = report.lifecycle.clone();
        }
        Ok(report)
    }

    /// The block table of session `id` (empty before its first turn): which
    /// of its entries are hot, cold, dropped or packed.
    pub fn session_table(&self, id: SessionId) -> Result<BlockTable> {
        let map = lock(&self.sessions);
        match map.get(&id) {
            None => Err(EngineError::Request(format!("session {id} does not exist"))),
            Some(None) => Err(EngineError::Request(format!(
                "session {id} is busy with another turn"
            ))),
            Some(Some(s)) => self.engine.cache.table(&s.seq),
        }
    }

    /// Ends a session and releases its blocks (cached ones stay reusable).
    pub fn close_session(&self, id: SessionId) -> Result<()> {
        let mut s = self.take_session(id)?;
        lock(&self.sessions).remove(&id);
        self.engine.cache.free(&mut s.seq)
    }

    fn take_session(&self, id: SessionId) -> Result<Session> {
        let mut map = lock(&self.sessions);
        match map.get_mut(&id) {
            None => Err(EngineError::Request(format!("session {id} does not exist"))),
            Some(slot) => slot.take().ok_or_else(|| {
                EngineError::Request(format!("session {id} is busy with another turn"))
            }),
        }
    }

    /// Metrics as JSON: requests, reuse, per-tier occupancy and bytes,
    /// index and sharing counters, what the policies did (evictions,
    /// demotions, lifecycle drops), and the last turn. In Prometheus' text
    /// format: [`metrics::prometheus`](crate::metrics::prometheus).
    pub fn metrics(&self) -> serde_json::Value {
        let (tiers, index, share, budget, bytes, counters) = {
            let c = self.engine.cache.coordinator();
            (
                c.tier_stats(),
                c.index_stats(),
                c.share_stats(),
                c.budget(),
                c.bytes_in_use(),
                c.counters(),
            )
        };
        let t = lock(&self.totals);
        let last = t.last.as_ref().map(|r| {
            serde_json::json!({
                "prompt_tokens": r.prompt_tokens,
                "reused_tokens": r.reused_tokens,
                "prefilled_tokens": r.prefilled_tokens,
                "ttft_secs": r.ttft_secs,
                "new_tokens": r.generation.tokens.len(),
                "decode_tok_s": r.generation.decode_tokens_per_sec(),
                "kv_bytes_in_use": r.kv_bytes_in_use,
                "lifecycle": r.lifecycle.as_ref().map(|l| serde_json::json!({
                    "segments": l.segments,
                    "labels_valid": l.labels_valid,
                    "labels": l.labels.iter().map(|x| format!("{x:?}").to_lowercase()).collect::<Vec<_>>(),
                    "fallback": l.fallback,
                    "queued": l.queued,
                    "revived": l.revived,
                    "reclaimed": l.reclaimed,
                    "dropped_entries": l.dropped_entries,
                    "compressed": l.compressed,
                    "compress_refused": l.compress_refused,
                    "summary_tokens": l.summary_tokens,
                    "label_secs": l.label_secs,
                    "compress_secs": l.compress_secs,
                })),
            })
        });
        let hot = tiers.first().map(|t| t.pool).unwrap_or_default();
        let tier_json: Vec<serde_json::Value> = tiers
            .iter()
            .map(|t| {
                serde_json::json!({
                    "tier": t.name,
                    "block_bytes": t.pool.block_bytes,
                    "capacity_blocks": t.pool.capacity,
                    "max_blocks": t.pool.max_blocks,
                    "blocks_in_use": t.pool.in_use,
                    "cached_free_blocks": t.pool.cached_free,
                    "bytes_in_use": t.pool.in_use_bytes,
                })
            })
            .collect();
        let index = index.unwrap_or_default();
        serde_json::json!({
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "reused_tokens": t.reused_tokens,
            "reuse_rate": t.reused_tokens as f64 / t.prompt_tokens.max(1) as f64,
            "sessions_open": lock(&self.sessions).len(),
            "kv_bytes_in_use": bytes,
            "kv_budget_bytes": budget,
            "pool": {
                "block_size": self.engine.cache.block_size(),
                "capacity_blocks": hot.capacity,
                "blocks_in_use": hot.in_use,
                "cached_free_blocks": hot.cached_free,
                "kv_bytes_in_use": hot.in_use_bytes,
                "kv_bytes_capacity": hot.capacity_bytes,
            },
            "tiers": tier_json,
            "index": {
                "kind": format!("{:?}", self.cfg.index),
                "enabled": self.cfg.enabled,
                "queries": index.queries,
                "query_tokens": index.query_tokens,
                "hit_tokens": index.hit_tokens,
                "hit_rate": index.hit_rate(),
                "cached_blocks": index.cached_blocks,
                "namespaces": index.namespaces,
                "inserted_blocks": index.inserted_blocks,
                "duplicate_blocks": index.duplicate_blocks,
                "collisions": index.collisions,
                "forgotten_blocks": index.forgotten_blocks,
            },
            "sharing": share.map(|s| serde_json::json!({
                "offered": s.offered, "shared": s.shared, "rejected": s.rejected,
                "canonical": s.canonical,
            })),
            "policies": {
                "steps": counters.steps,
                "evicted_entries": counters.evicted_entries,
                "demoted_blocks": counters.demoted_blocks,
                "packed_blocks": counters.packed_blocks,
                "evicted_idle_entries": counters.evicted_idle_entries,
                "lifecycle_dropped_entries": counters.lifecycle_dropped_entries,
                "lifecycle_queued": counters.lifecycle_queued,
                "lifecycle_revived": counters.lifecycle_revived,
                "lifecycle_reclaimed": counters.lifecycle_reclaimed,
                "lifecycle_compressed": counters.lifecycle_compressed,
                "lifecycle_fallbacks": counters.lifecycle_fallbacks,
            },
            "last_turn": last,
        })
    }

    fn account(
        &self,
        prompt: usize,
        reused: usize,
        ttft: Option<f64>,
        generation: Generation,
    ) -> TurnReport {
        let report = TurnReport {
            prompt_tokens: prompt,
            reused_tokens: reused,
            prefilled_tokens: prompt - reused,
            ttft_secs: ttft.unwrap_or(generation.prefill_secs),
            kv_bytes_in_use: self.engine.cache.bytes_in_use(),
            generation,
            lifecycle: None,
        };
        let mut t = lock(&self.totals);
        t.requests += 1;
        t.prompt_tokens += prompt as u64;
        t.reused_tokens += reused as u64;
        t.last = Some(report.clone());
        report
    }
}

/// Checks a request before anything changes: empty, ids outside the
/// vocabulary, context, and a request larger than the whole pool.
fn check_request(
    engine: &Engine,
    cached: usize,
    tokens: &[u32],
    params: &SamplingParams,
) -> Result<()> {
    params.validate()?;
    if tokens.is_empty() {
        return Err(EngineError::Request("empty prompt".into()));
    }
    let vocab = engine.model.cfg.vocab;
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Request(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let ctx = engine.model.cfg.max_ctx;
    if cached + tokens.len() >= ctx {
        return Err(EngineError::Request(format!(
            "prompt of {} tokens leaves no room in the {ctx}-token context",
            cached + tokens.len()
        )));
    }
    let bs = engine.cache.block_size();
    let need = (cached + tokens.len() + params.max_tokens)
        .min(ctx)
        .div_ceil(bs);
    let have = engine.cache.hot_blocks();
    // A cold tier or eviction keeps a long sequence in fewer hot blocks:
    // then only its steps can tell (a full cache is a clean error there).
    let bounded = {
        let c = engine.cache.coordinator();
        c.config().cold.is_none() && c.config().eviction.is_none()
    };
    if bounded && need > have {
        return Err(EngineError::Request(format!(
            "request needs up to {need} KV blocks but the whole pool has {have}"
        )));
    }
    Ok(())
}

/// How a generation ended.
enum Timed {
    /// With the seconds from the request to its first new token.
    Done(Generation, Option<f64>),
    Failed(EngineError),
    /// The model or the caller's `on_token` panicked: the caller cleans up,
    /// then resumes the panic.
    Panicked(Box<dyn Any + Send>),
}

/// `Engine::generate`, timing the first token and catching a panic so that
/// the caller can give back what the request holds before it goes on.
fn generate_timed(
    engine: &Engine,
    seq: &mut Sequence,
    tokens: &[u32],
    params: &SamplingParams,
    on_token: &mut dyn FnMut(u32, &str) -> bool,
    start: Instant,
) -> Timed {
    let mut ttft = None;
    let run = catch_unwind(AssertUnwindSafe(|| {
        engine.generate(seq, tokens, params, &mut |t, piece| {
            ttft.get_or_insert_with(|| start.elapsed().as_secs_f64());
            on_token(t, piece)
        })
    }));
    match run {
        Ok(Ok(g)) => Timed::Done(g, ttft),
        Ok(Err(e)) => Timed::Failed(e),
        Err(payload) => Timed::Panicked(payload),
    }
}
