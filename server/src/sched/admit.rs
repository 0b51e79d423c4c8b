//! Admission: waiting requests open their sequences on the longest cached
//! prefix; with a remote tier, the blocks after it are looked up on a
//! thread of the request's own, and imported when the answer comes back —
//! the loop never waits for the store.

use std::sync::atomic::Ordering;

use kvforge_prefix::ExtraKeys;

use super::{Event, Req, Scheduler, Shared, lock};
use crate::error::ApiError;
use crate::metrics::Ended;

impl Scheduler {
    /// Admits waiting requests, oldest (and preempted) first.
    pub(super) fn admit(&mut self) {
        while !self.pressure && self.running.len() < self.cfg.max_batch {
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            let extra = ExtraKeys::namespace(&r.job.namespace);
            let lookup = match self.engine.cache.open_local(&r.context, &extra) {
                Ok((seq, lookup)) => {
                    r.seq = seq;
                    lookup
                }
                Err(e) => {
                    let _ = r
                        .job
                        .events
                        .send(Event::Failed(ApiError::internal(e.to_string())));
                    lock(&self.shared.metrics).ended(Ended::Failed);
                    continue;
                }
            };
            r.lookup = lookup.and_then(|l| {
                self.tickets += 1;
                let (ticket, tx) = (self.tickets, self.fetched_tx.clone());
                // Off the loop: a store that stalls holds this request only.
                std::thread::Builder::new()
                    .name("kvforge-lookup".into())
                    .spawn(move || {
                        let _ = tx.send((ticket, l.fetch()));
                    })
                    .ok()
                    .map(|_| ticket)
            });
            if r.lookup.is_none() {
                Self::count_hit(&self.shared, &mut r);
            }
            self.admissions += 1;
            r.admitted = self.admissions;
            self.running.push(r);
        }
    }

    /// Every running request waits for its remote lookup, and no waiting
    /// one can be admitted: nothing to compute.
    pub(super) fn only_lookups(&self) -> bool {
        let admissible =
            !self.waiting.is_empty() && !self.pressure && self.running.len() < self.cfg.max_batch;
        !admissible && self.running.iter().all(|r| r.lookup.is_some())
    }

    /// Imports what the remote lookups answered into their requests' own
    /// sequences (a request that has ended meanwhile: nothing to import).
    pub(super) fn take_fetched(&mut self) {
        while let Ok((ticket, f)) = self.fetched.try_recv() {
            let Some(r) = self.running.iter_mut().find(|r| r.lookup == Some(ticket)) else {
                continue;
            };
            r.lookup = None;
            let extra = ExtraKeys::namespace(&r.job.namespace);
            self.engine
                .cache
                .import_fetched(&mut r.seq, &r.context, &extra, f);
            Self::count_hit(&self.shared, r);
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
