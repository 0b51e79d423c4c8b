//! `n` > 1: the other choices of a request, made once its prompt has run.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvforge_engine::Sampler;

use super::step::sample;
use super::{End, Req, Scheduler, lock};
use crate::error::ApiError;

impl Scheduler {
    /// The other choices of each request whose prompt ended in this step
    /// (`n` > 1): each a fork of its sequence (the prompt's blocks shared,
    /// nothing copied or recomputed) that samples its first token from
    /// the same logits with a sampler of its own, then runs on its own.
    pub(super) fn fork_choices(&mut self) {
        let engine = Arc::clone(&self.engine);
        let (mut forks, mut waits) = (Vec::new(), Vec::new());
        let cap = self.cfg.max_batch.max(1);
        let (running, pressure) = (self.running.len(), self.pressure);
        for r in &mut self.running {
            let Some(logits) = r.fork_logits.take() else {
                continue;
            };
            for index in 1..r.job.n {
                let mut job = r.job.clone();
                job.index = index;
                job.params.seed = mix(job.params.seed ^ mix(index as u64));
                let Ok(sampler) = Sampler::new(job.params.clone()) else {
                    r.end = Some(End::Failed(ApiError::internal(
                        "a choice's sampler could not be made",
                    )));
                    break;
                };
                let mut c = Req::new(job, sampler);
                c.cached = r.cached;
                // Inside the batch and without memory pressure a choice
                // shares the prompt's blocks; beyond, it samples its first
                // token now and waits, admitted later as a preempted
                // request is (its prompt found through the prefix cache).
                let shares = !pressure && running + forks.len() < cap;
                if shares {
                    let Ok(seq) = engine.cache().fork(&r.seq) else {
                        r.end = Some(End::Failed(ApiError::internal(
                            "forking a choice's sequence failed",
                        )));
                        break;
                    };
                    lock(&self.shared.metrics).forked_tokens += seq.len() as u64;
                    c.seq = seq;
                    self.admissions += 1;
                    c.admitted = self.admissions;
                }
                sample(&engine, &self.shared, self.fault.as_ref(), &mut c, &logits);
                // A choice that ended at its first token is swept now.
                if shares || c.end.is_some() {
                    forks.push(c);
                } else {
                    waits.push(c);
                }
            }
        }
        self.running.extend(forks);
        if !waits.is_empty() {
            for c in waits.into_iter().rev() {
                self.shared.queued.fetch_add(1, Ordering::SeqCst);
                self.waiting.push_front(c);
            }
            self.start_lookups();
        }
    }
}

/// SplitMix64's finalizer: a choice's seed is its request's mixed with its
/// index, so no two choices' random streams are shifts of one another (the
/// sampler's own stream steps by the same constant).
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
