//! The cache manager: prefix reuse across turns, requests and sessions.
//!
//! Every request asks the [`PrefixMatcher`] for its longest verified cached
//! prefix, takes a reference on those blocks ([`acquire_prefix`]), prefills
//! only the rest, and registers its completed blocks afterwards, so a system
//! prompt shared by many requests is computed once. Two request shapes:
//!
//! * **stateless** ([`CacheManager::complete`]): the client sends the whole
//!   history every turn, as OpenAI-style APIs do;
//! * **sessions** ([`CacheManager::open_session`], [`CacheManager::turn`]):
//!   the manager keeps the sequence between turns; the first turn of a
//!   session still reuses what other requests cached.
//!
//! A namespace comes with every request; two namespaces never share a block.
//! With `seal_turns`, the partial last block of each turn is sealed and
//! cached, so the next turn reuses every token computed before.
//!
//! All state sits behind one mutex: requests from many threads are served
//! one step at a time (the CPU forward pass is the bottleneck anyway), and a
//! failed request leaves the pool and the index as they were. So does a
//! request that panics (in the model, or in the caller's `on_token`): its
//! blocks are given back (a session is rolled back to before the turn)
//! before the panic continues, so the state behind the lock stays whole.

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;
use std::time::Instant;

use kvforge_pool::BlockAllocator;
use kvforge_prefix::{
    BlockRef, ExtraKeys, HashChainIndex, PrefixMatcher, RadixIndex, Xxh3Hasher, acquire_prefix,
};

use crate::cache::Sequence;
use crate::generate::{Generation, SamplingParams};
use crate::{Engine, EngineError, Result};

/// Which prefix index to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexKind {
    /// [`HashChainIndex`]: chained xxh3-128 keys in a flat map.
    HashChain,
    /// [`RadixIndex`]: a radix tree over blocks.
    Radix,
}

impl std::str::FromStr for IndexKind {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "hash-chain" | "chain" => Ok(IndexKind::HashChain),
            "radix" => Ok(IndexKind::Radix),
            _ => Err(EngineError::Request(format!(
                "unknown index {s:?}; use hash-chain or radix"
            ))),
        }
    }
}

/// How the manager reuses KV.
#[derive(Clone, Debug)]
pub struct ReuseConfig {
    /// Look up and register prefixes at all (off = recompute everything).
    pub enabled: bool,
    /// The index implementation.
    pub index: IndexKind,
    /// Seal (and cache) the partial last block of every turn.
    pub seal_turns: bool,
    /// Hash seed; `None` draws a random one (the safe default).
    pub seed: Option<u64>,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            enabled: true,
            index: IndexKind::HashChain,
            seal_turns: true,
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

struct Inner {
    engine: Engine,
    index: Box<dyn PrefixMatcher>,
    sessions: BTreeMap<u64, Session>,
    next_session: u64,
    totals: Totals,
}

/// An [`Engine`] with a prefix index, sessions and metrics.
pub struct CacheManager {
    cfg: ReuseConfig,
    inner: Mutex<Inner>,
}

/// A session handle.
pub type SessionId = u64;

impl CacheManager {
    /// Wraps `engine`; the index uses the engine cache's block size. An
    /// engine with a quantized cold tier is refused: cold blocks cannot be
    /// shared through the index, and a failed session turn could not undo a
    /// demotion (its rollback restores the block table).
    pub fn new(engine: Engine, cfg: ReuseConfig) -> Result<Self> {
        if engine.cache.cold_tier().is_some() {
            return Err(EngineError::Request(
                "the cache manager (chat sessions, prefix reuse) does not support a quantized cold tier yet: cold blocks are not shareable and a failed turn cannot undo a demotion".into(),
            ));
        }
        let bs = engine.cache.block_size();
        let hasher = cfg
            .seed
            .map_or_else(Xxh3Hasher::random, Xxh3Hasher::with_seed);
        let index: Box<dyn PrefixMatcher> = match cfg.index {
            IndexKind::HashChain => Box::new(HashChainIndex::with_hasher(bs, hasher)?),
            IndexKind::Radix => Box::new(RadixIndex::new(bs)?),
        };
        let inner = Inner {
            engine,
            index,
            sessions: BTreeMap::new(),
            next_session: 1,
            totals: Totals::default(),
        };
        Ok(CacheManager {
            cfg,
            inner: Mutex::new(inner),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` with the engine (tokenizer, model, cache) under the lock.
    pub fn with_engine<T>(&self, f: impl FnOnce(&Engine) -> T) -> T {
        f(&self.lock().engine)
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
        let mut guard = self.lock();
        let inner = &mut *guard;
        check_request(&inner.engine, 0, tokens, params)?;
        let extra = ExtraKeys::namespace(namespace);
        let mut seq = self.acquire(inner, tokens, &extra)?;
        let reused = seq.len;
        let timed = generate_timed(
            &inner.engine,
            &mut seq,
            &tokens[reused..],
            params,
            on_token,
            start,
        );
        let (generation, ttft) = match timed {
            Timed::Done(g, ttft) => (g, ttft),
            Timed::Failed(e) => {
                inner.engine.cache.free(&mut seq)?;
                return Err(e);
            }
            Timed::Panicked(payload) => {
                inner.engine.cache.free(&mut seq)?;
                drop(guard);
                resume_unwind(payload);
            }
        };
        let mut held = tokens.to_vec();
        held.extend(&generation.tokens[..generation.tokens.len().saturating_sub(1)]);
        self.register(inner, &mut seq, &held, &extra)?;
        inner.engine.cache.free(&mut seq)?;
        Ok(self.account(inner, tokens.len(), reused, ttft, generation))
    }

    /// Opens a session in `namespace`.
    pub fn open_session(&self, namespace: &str) -> SessionId {
        let mut inner = self.lock();
        let id = inner.next_session;
        inner.next_session += 1;
        let s = Session {
            extra: ExtraKeys::namespace(namespace),
            seq: Sequence::default(),
            tokens: Vec::new(),
            pending: Vec::new(),
        };
        inner.sessions.insert(id, s);
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
        let mut guard = self.lock();
        let inner = &mut *guard;
        let mut s = take_session(inner, id)?;
        let mut input = s.pending.clone();
        input.extend_from_slice(new_tokens);
        let mut panicked = None;
        let out = (|| {
            if new_tokens.is_empty() {
                return Err(EngineError::Request("empty prompt".into()));
            }
            check_request(&inner.engine, s.seq.len, &input, params)?;
            let first_turn = s.seq.len == 0;
            if first_turn {
                s.seq = self.acquire(inner, &input, &s.extra)?;
            }
            let before = s.seq.clone();
            let skip = s.seq.len - s.tokens.len();
            let timed = generate_timed(
                &inner.engine,
                &mut s.seq,
                &input[skip..],
                params,
                on_token,
                start,
            );
            let (generation, ttft) = match timed {
                Timed::Done(g, ttft) => (g, ttft),
                Timed::Failed(e) => {
                    rollback(&inner.engine, &mut s.seq, &before, first_turn)?;
                    return Err(e);
                }
                Timed::Panicked(payload) => {
                    rollback(&inner.engine, &mut s.seq, &before, first_turn)?;
                    panicked = Some(payload);
                    return Err(EngineError::Request("the turn panicked".into()));
                }
            };
            let reused = skip.min(input.len());
            let prompt_len = s.tokens.len() + input.len();
            s.tokens.extend(&input);
            let (last, rest) = generation.tokens.split_last().unwrap_or((&0, &[]));
            s.tokens.extend(rest);
            s.pending = vec![*last];
            let extra = s.extra.clone();
            self.register(inner, &mut s.seq, &s.tokens, &extra)?;
            let prior = prompt_len - input.len();
            Ok(self.account(inner, prompt_len, prior + reused, ttft, generation))
        })();
        inner.sessions.insert(id, s);
        if let Some(payload) = panicked {
            drop(guard);
            resume_unwind(payload);
        }
        out
    }

    /// Ends a session and releases its blocks (cached ones stay reusable).
    pub fn close_session(&self, id: SessionId) -> Result<()> {
        let mut inner = self.lock();
        let mut s = take_session(&mut inner, id)?;
        inner.engine.cache.free(&mut s.seq)
    }

    /// Metrics as JSON: requests, reuse, pool occupancy and bytes, index
    /// counters, and the last turn.
    pub fn metrics(&self) -> serde_json::Value {
        let inner = self.lock();
        let p = inner.engine.cache.pool().stats();
        let i = inner.index.stats();
        let t = &inner.totals;
        let last = t.last.as_ref().map(|r| {
            serde_json::json!({
                "prompt_tokens": r.prompt_tokens,
                "reused_tokens": r.reused_tokens,
                "prefilled_tokens": r.prefilled_tokens,
                "ttft_secs": r.ttft_secs,
                "new_tokens": r.generation.tokens.len(),
                "decode_tok_s": r.generation.decode_tokens_per_sec(),
                "kv_bytes_in_use": r.kv_bytes_in_use,
            })
        });
        serde_json::json!({
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "reused_tokens": t.reused_tokens,
            "reuse_rate": t.reused_tokens as f64 / t.prompt_tokens.max(1) as f64,
            "sessions_open": inner.sessions.len(),
            "pool": {
                "block_size": inner.engine.cache.block_size(),
                "capacity_blocks": p.capacity,
                "blocks_in_use": p.in_use,
                "cached_free_blocks": p.cached_free,
                "kv_bytes_in_use": p.in_use_bytes,
                "kv_bytes_capacity": p.capacity_bytes,
            },
            "index": {
                "kind": format!("{:?}", self.cfg.index),
                "queries": i.queries,
                "query_tokens": i.query_tokens,
                "hit_tokens": i.hit_tokens,
                "hit_rate": i.hit_rate(),
                "cached_blocks": i.cached_blocks,
                "namespaces": i.namespaces,
                "inserted_blocks": i.inserted_blocks,
                "duplicate_blocks": i.duplicate_blocks,
                "collisions": i.collisions,
                "forgotten_blocks": i.forgotten_blocks,
            },
            "last_turn": last,
        })
    }

    /// The longest cached prefix of `tokens` (leaving at least the last token
    /// to compute), retained, as the start of a sequence.
    fn acquire(&self, inner: &mut Inner, tokens: &[u32], extra: &ExtraKeys) -> Result<Sequence> {
        if !self.cfg.enabled {
            return Ok(Sequence::default());
        }
        let forgotten = inner.engine.cache.take_reclaimed();
        inner.index.forget_all(&forgotten);
        let m = acquire_prefix(
            &mut inner.index,
            inner.engine.cache.pool(),
            &tokens[..tokens.len() - 1],
            extra,
        )?;
        Ok(Sequence::from_blocks(
            m.blocks.iter().map(|b| (b.block, b.len)),
        ))
    }

    /// Registers every completed (full or, at a turn end, sealed) block of
    /// `seq`, which holds the KV of `tokens`.
    fn register(
        &self,
        inner: &mut Inner,
        seq: &mut Sequence,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Result<()> {
        if !self.cfg.enabled {
            return Ok(());
        }
        if self.cfg.seal_turns {
            seq.seal();
        }
        let forgotten = inner.engine.cache.take_reclaimed();
        inner.index.forget_all(&forgotten);
        let done = if seq.open {
            seq.blocks.len() - 1
        } else {
            seq.blocks.len()
        };
        let refs: Vec<BlockRef> = (0..done)
            .map(|i| BlockRef::new(seq.blocks[i], seq.lens[i]))
            .collect();
        inner.index.insert(tokens, extra, &refs)?;
        let pool = inner.engine.cache.pool();
        for r in &refs {
            pool.mark_cached(r.block)?;
        }
        Ok(())
    }

    fn account(
        &self,
        inner: &mut Inner,
        prompt: usize,
        reused: usize,
        ttft: Option<f64>,
        generation: Generation,
    ) -> TurnReport {
        let t = &mut inner.totals;
        t.requests += 1;
        t.prompt_tokens += prompt as u64;
        t.reused_tokens += reused as u64;
        let report = TurnReport {
            prompt_tokens: prompt,
            reused_tokens: reused,
            prefilled_tokens: prompt - reused,
            ttft_secs: ttft.unwrap_or(generation.prefill_secs),
            kv_bytes_in_use: inner.engine.cache.bytes_in_use(),
            generation,
        };
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
    let have = engine.cache.pool().stats().max_blocks;
    if need > have {
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

fn take_session(inner: &mut Inner, id: SessionId) -> Result<Session> {
    inner
        .sessions
        .remove(&id)
        .ok_or_else(|| EngineError::Request(format!("session {id} does not exist")))
}

/// Shrinks `seq` back to `before` (a failed turn), releasing added blocks;
/// on a session's first turn, also gives back the prefix it acquired.
fn rollback(
    engine: &Engine,
    seq: &mut Sequence,
    before: &Sequence,
    first_turn: bool,
) -> Result<()> {
    let added: Vec<_> = seq.blocks[before.blocks.len()..].to_vec();
    engine.cache.pool().release_sequence(&added)?;
    *seq = before.clone();
    if first_turn {
        engine.cache.free(seq)?;
    }
    Ok(())
}
