//! Admission: with a remote tier, a request's lookup of the blocks after
//! its local prefix runs on a thread of its own while the request waits
//! (the loop never waits for the store, and a lookup that stalls holds no
//! batch slot; at most `max_batch` are in flight or answered and waiting);
//! waiting requests whose lookup has answered open their sequences on the
//! longest cached prefix, oldest (and preempted) first, and import what
//! the lookup brought.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use kvforge_prefix::ExtraKeys;

use super::{Event, Lookup, Req, Scheduler, Shared, lock};
use crate::error::ApiError;
use crate::metrics::Ended;

impl Scheduler {
    /// Starts the remote lookups of waiting requests not asked yet, oldest
    /// first, while fewer than `max_batch` are in flight or answered and
    /// waiting (what a request fetched is held outside the KV budget until
    /// it is admitted); a request with nothing to ask is ready at once,
    /// whatever the others wait for.
    pub(super) fn start_lookups(&mut self) {
        let cap = self.cfg.max_batch.max(1);
        let mut held = self.waiting.iter().filter(|r| r.lookup.held()).count();
        for i in 0..self.waiting.len() {
            let r = &self.waiting[i];
            let room = held < cap;
            match r.lookup {
                Lookup::New => {}
                Lookup::Pending if room => {}
                _ => continue,
            }
            let extra = ExtraKeys::namespace(&r.job.namespace);
            let lookup = if r.scores_prompt() {
                None
            } else {
                self.engine.cache().remote_lookup(&r.context, &extra)
            };
            let Some(l) = lookup else {
                self.waiting[i].lookup = Lookup::Ready(None);
                continue;
            };
            if !room {
                self.waiting[i].lookup = Lookup::Pending;
                continue;
            }
            self.tickets += 1;
            let (ticket, tx) = (self.tickets, self.fetched_tx.clone());
            // Off the loop: a store that stalls holds this request only. A
            // lookup that panics answers nothing, so its request goes on.
            let spawned = std::thread::Builder::new()
                .name("kvforge-lookup".into())
                .spawn(move || {
                    let f = catch_unwind(AssertUnwindSafe(|| l.fetch())).ok();
                    let _ = tx.send((ticket, f));
                });
            self.waiting[i].lookup = match spawned {
                Ok(_) => {
                    held += 1;
                    Lookup::Asking(ticket)
                }
                Err(_) => Lookup::Ready(None),
            };
        }
    }

    /// Admits waiting requests whose lookup is ready, oldest (and
    /// preempted) first.
    pub(super) fn admit(&mut self) {
        while !self.pressure && self.running.len() < self.cfg.max_batch {
            let ready = |r: &Req| matches!(r.lookup, Lookup::Ready(_));
            let Some(i) = self.waiting.iter().position(ready) else {
                break;
            };
            let Some(mut r) = self.waiting.remove(i) else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let extra = ExtraKeys::namespace(&r.job.namespace);
            let fetched = match std::mem::replace(&mut r.lookup, Lookup::Ready(None)) {
                Lookup::Ready(f) => f,
                _ => None,
            };
            // A prompt to score runs whole: nothing is taken from the cache.
            let reuse = if r.scores_prompt() {
                &[][..]
            } else {
                &r.context
            };
            match self.engine.cache().open_with(reuse, &extra, fetched) {
                Ok(seq) => r.seq = seq,
                Err(e) => {
                    let _ = r
                        .job
                        .events
                        .send(Event::Failed(ApiError::internal(e.to_string())));
                    if r.counts() {
                        lock(&self.shared.metrics).ended(Ended::Failed);
                    }
                    continue;
                }
            }
            Self::count_hit(&self.shared, &mut r);
            self.admissions += 1;
            r.admitted = self.admissions;
            self.running.push(r);
        }
        self.start_lookups();
    }

    /// Nothing runs, and no waiting request is ready: nothing to compute
    /// until a lookup answers.
    pub(super) fn only_lookups(&self) -> bool {
        self.running.is_empty()
            && !self.waiting.is_empty()
            && !self
                .waiting
                .iter()
                .any(|r| matches!(r.lookup, Lookup::Ready(_)))
    }

    /// Keeps what the remote lookups answered with their waiting requests
    /// (a request that has gone meanwhile: nothing to keep).
    pub(super) fn take_fetched(&mut self) {
        while let Ok((ticket, f)) = self.fetched.try_recv() {
            let asked = |r: &&mut Req| matches!(r.lookup, Lookup::Asking(t) if t == ticket);
            if let Some(r) = self.waiting.iter_mut().find(asked) {
                r.lookup = Lookup::Ready(f);
            }
        }
    }

    /// The prompt tokens a request found cached (locally and remotely), at
    /// its first admission.
    fn count_hit(shared: &Shared, r: &mut Req) {
        if r.cached.is_none() {
            let mut m = lock(&shared.metrics);
            m.prefix_queries += r.job.prompt.len() as u64;
            m.prefix_hits += r.seq.len() as u64;
            m.prompt_tokens += r.job.prompt.len() as u64;
            r.cached = Some(r.seq.len());
        }
    }
}
