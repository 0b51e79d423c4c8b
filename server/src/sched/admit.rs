//! Admission: with a remote tier, a request's lookup of the blocks after
//! its local prefix runs on a thread of its own while the request waits
//! (the loop never waits for the store, and a lookup that stalls holds no
//! batch slot); waiting requests whose lookup has answered open their
//! sequences on the longest cached prefix, oldest (and preempted) first,
//! and import what the lookup brought.

use std::sync::atomic::Ordering;

use kvforge_prefix::ExtraKeys;

use super::{Event, Req, Scheduler, Shared, lock};
use crate::error::ApiError;
use crate::metrics::Ended;

impl Scheduler {
    /// Starts the remote lookup of `r`, about to wait for admission (no
    /// remote tier, or nothing after the local prefix: nothing to ask).
    pub(super) fn prefetch(&mut self, r: &mut Req) {
        let extra = ExtraKeys::namespace(&r.job.namespace);
        let Some(l) = self.engine.cache.remote_lookup(&r.context, &extra) else {
            return;
        };
        self.tickets += 1;
        let (ticket, tx) = (self.tickets, self.fetched_tx.clone());
        // Off the loop: a store that stalls holds this request only.
        r.lookup = std::thread::Builder::new()
            .name("kvforge-lookup".into())
            .spawn(move || {
                let _ = tx.send((ticket, l.fetch()));
            })
            .ok()
            .map(|_| ticket);
    }

    /// Admits waiting requests whose lookup has answered, oldest (and
    /// preempted) first.
    pub(super) fn admit(&mut self) {
        while !self.pressure && self.running.len() < self.cfg.max_batch {
            let Some(i) = self.waiting.iter().position(|r| r.lookup.is_none()) else {
                break;
            };
            let Some(mut r) = self.waiting.remove(i) else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let extra = ExtraKeys::namespace(&r.job.namespace);
            match self
                .engine
                .cache
                .open_with(&r.context, &extra, r.fetched.take())
            {
                Ok(seq) => r.seq = seq,
                Err(e) => {
                    let _ = r
                        .job
                        .events
                        .send(Event::Failed(ApiError::internal(e.to_string())));
                    lock(&self.shared.metrics).ended(Ended::Failed);
                    continue;
                }
            }
            Self::count_hit(&self.shared, &mut r);
            self.admissions += 1;
            r.admitted = self.admissions;
            self.running.push(r);
        }
    }

    /// Nothing runs, and every waiting request waits for its remote
    /// lookup: nothing to compute.
    pub(super) fn only_lookups(&self) -> bool {
        self.running.is_empty()
            && !self.waiting.is_empty()
            && self.waiting.iter().all(|r| r.lookup.is_some())
    }

    /// Keeps what the remote lookups answered with their waiting requests
    /// (a request that has gone meanwhile: nothing to keep).
    pub(super) fn take_fetched(&mut self) {
        while let Ok((ticket, f)) = self.fetched.try_recv() {
            if let Some(r) = self.waiting.iter_mut().find(|r| r.lookup == Some(ticket)) {
                r.lookup = None;
                r.fetched = Some(f);
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
