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

use std::collections::BTreeMap;
use std::panic::resume_unwind;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use kvforge_coordinator::PrefixConfig;
pub use kvforge_coordinator::{IndexKind, TurnTail};
use kvforge_prefix::ExtraKeys;

use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{Generation, SamplingParams};
use crate::lifecycle::LifecycleReport;

mod session;

pub use metrics::{HotPool, IndexMetrics, LastTurn, Metrics};
use request::{Timed, check_request, generate_timed};
use session::Session;
mod metrics;
mod request;

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

impl ReuseConfig {
    /// Turns prefix reuse on (or off) in `cache`, on top of whatever else
    /// it is configured with; for a caller that drives sequences itself
    /// (a server's scheduler) instead of through a [`CacheManager`].
    pub fn apply(&self, cache: &mut crate::cache::PagedKvCache) -> Result<()> {
        let mut c = cache.config();
        c.prefix = self.enabled.then_some(PrefixConfig {
            index: self.index,
            seed: self.seed,
            tail: self.tail,
        });
        let quant = cache.cold_tier();
        cache.configure(c, quant)
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
        cfg.apply(&mut engine.cache)?;
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
