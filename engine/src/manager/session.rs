//! Sessions: the manager keeps a sequence between turns, rolls a failed
//! turn back exactly, runs the lifecycle at every turn end.

use std::any::Any;
use std::panic::resume_unwind;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvforge_coordinator::BlockTable;
use kvforge_prefix::ExtraKeys;

use crate::cache::Sequence;
use crate::error::{EngineError, Result};
use crate::generate::SamplingParams;
use crate::lifecycle::{self};

use super::*;

pub(super) struct Session {
    pub(super) extra: ExtraKeys,
    pub(super) seq: Sequence,
    /// Tokens whose KV `seq` holds.
    pub(super) tokens: Vec<u32>,
    /// Sampled but not yet run through the model (the last reply's last).
    pub(super) pending: Vec<u32>,
}

impl CacheManager {
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

    pub(super) fn run_turn(
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
        let source = engine.cache.lifecycle_source();
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

    pub(super) fn take_session(&self, id: SessionId) -> Result<Session> {
        let mut map = lock(&self.sessions);
        match map.get_mut(&id) {
            None => Err(EngineError::Request(format!("session {id} does not exist"))),
            Some(slot) => slot.take().ok_or_else(|| {
                EngineError::Request(format!("session {id} is busy with another turn"))
            }),
        }
    }
}
