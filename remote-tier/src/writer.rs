//! [`WriteBehind`]: a bounded queue of store operations — blobs to write,
//! verified keys to renew, invalid values to delete — and one thread that
//! carries them out in batches. Offering never blocks: a full queue drops
//! the operation and counts it.
//!
//! The thread also watches for a store that forgot everything (flushed,
//! restarted without persistence): it keeps a marker key of its own and
//! renews it every `probe_every`; when the marker is gone, or a connection
//! was lost, the keys remembered as stored are forgotten, so every block
//! held locally is offered again at its next registration.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::key::RemoteKey;
use crate::known::Known;
use crate::stats::Counters;
use crate::{ErrorKind, Put, RemoteError, RemoteTier};

/// One operation on the store.
pub(crate) enum Op {
    /// Write a blob (set-if-absent).
    Put(RemoteKey, Vec<u8>),
    /// Renew a verified key's expiry.
    Touch(RemoteKey),
    /// Delete a value that did not verify.
    Remove(RemoteKey),
}

impl Op {
    fn bytes(&self) -> usize {
        match self {
            Op::Put(_, b) => b.len(),
            Op::Touch(_) | Op::Remove(_) => 0,
        }
    }
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Op>,
    bytes: usize,
    /// The writer holds a batch it took off the queue.
    busy: bool,
    stop: bool,
}

struct Shared {
    q: Mutex<Queue>,
    /// Signalled when items arrive or the queue is told to stop.
    work: Condvar,
    /// Signalled when the writer finished a batch.
    done: Condvar,
    max_blocks: usize,
    max_bytes: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How the writer thread is set up.
pub(crate) struct WriterSetup {
    pub(crate) store: Arc<dyn RemoteTier>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) known: Arc<Mutex<Known>>,
    pub(crate) max_blocks: usize,
    pub(crate) max_bytes: usize,
    pub(crate) batch: usize,
    /// The marker key and how often it is renewed.
    pub(crate) marker: RemoteKey,
    pub(crate) probe_every: Duration,
}

/// A bounded write-behind queue in front of a [`RemoteTier`].
pub struct WriteBehind {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl WriteBehind {
    /// A queue of at most `max_blocks` operations and `max_bytes` bytes,
    /// carried out `batch` at a time by a thread of its own.
    pub(crate) fn spawn(w: WriterSetup) -> Self {
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            max_blocks: w.max_blocks,
            max_bytes: w.max_bytes,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvforge-remote-writer".into())
            .spawn(move || run(&s, &w))
            .ok();
        WriteBehind { shared, thread }
    }

    /// Queues `op`; `false` (and nothing queued) when the queue is full or
    /// has no writer.
    pub(crate) fn offer(&self, op: Op) -> bool {
        if self.thread.is_none() {
            return false;
        }
        let mut q = self.shared.lock();
        let fits = q.items.len() < self.shared.max_blocks
            && q.bytes.saturating_add(op.bytes()) <= self.shared.max_bytes;
        if !fits || q.stop {
            return false;
        }
        q.bytes += op.bytes();
        q.items.push_back(op);
        drop(q);
        self.shared.work.notify_one();
        true
    }

    /// Operations waiting (the batch being carried out included).
    pub fn pending(&self) -> usize {
        let q = self.shared.lock();
        q.items.len() + usize::from(q.busy)
    }

    /// Waits until every queued operation was carried out (or failed), at
    /// most `timeout`; whether the queue is empty.
    pub fn flush(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut q = self.shared.lock();
        while !q.items.is_empty() || q.busy {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() || self.thread.is_none() {
                return false;
            }
            q = self
                .shared
                .done
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

impl Drop for WriteBehind {
    /// Stops the writer after the batch in flight; what is still queued is
    /// dropped (a cache, not a log).
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Calls `f` on `store`, a panic of the store being its error.
fn guarded<T>(f: impl FnOnce() -> Result<T, RemoteError>) -> Result<T, RemoteError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(RemoteError::new(ErrorKind::Store, "the store panicked")))
}

fn run(s: &Shared, w: &WriterSetup) {
    let c = &*w.counters;
    let forget_all = || w.known.lock().unwrap_or_else(|e| e.into_inner()).clear();
    let mut marker_set = false;
    let mut reconnects = w.store.reconnects();
    let mut next_probe = Instant::now();
    loop {
        let ops: Vec<Op> = {
            let mut q = s.lock();
            loop {
                if q.stop {
                    let left = q.items.iter().filter(|o| matches!(o, Op::Put(..))).count();
                    Counters::add(&c.put_dropped, left);
                    q.items.clear();
                    q.bytes = 0;
                    drop(q);
                    s.done.notify_all();
                    return;
                }
                if !q.items.is_empty() || Instant::now() >= next_probe {
                    break;
                }
                let wait = next_probe.saturating_duration_since(Instant::now());
                q = s
                    .work
                    .wait_timeout(q, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let n = q.items.len().min(w.batch.max(1));
            let ops: Vec<_> = q.items.drain(..n).collect();
            q.bytes -= ops.iter().map(Op::bytes).sum::<usize>();
            q.busy = true;
            ops
        };
        if Instant::now() >= next_probe {
            next_probe = Instant::now() + w.probe_every;
            probe(w, &mut marker_set, &mut reconnects, &forget_all);
        }
        carry_out(w, ops, &forget_all);
        s.lock().busy = false;
        s.done.notify_all();
    }
}

/// Renews the marker; a marker that is gone, or a connection lost since
/// the last probe (a restart may have lost what was written after the
/// store's last snapshot), means the store may have forgotten: every key
/// remembered as stored is forgotten.
fn probe(w: &WriterSetup, marker_set: &mut bool, reconnects: &mut u64, forget_all: &dyn Fn()) {
    let now = w.store.reconnects();
    if now != *reconnects {
        *reconnects = now;
        Counters::add(&w.counters.store_resets, 1);
        forget_all();
    }
    if *marker_set {
        match guarded(|| w.store.touch_many(&[w.marker])) {
            Ok(held) if held.first() == Some(&true) => return,
            Ok(_) => {
                Counters::add(&w.counters.store_resets, 1);
                forget_all();
            }
            Err(_) => return,
        }
    }
    let value = b"kvforge marker: its absence means the store forgot everything".to_vec();
    // Set only if the store holds it now: a store that refuses writes (out
    // of memory) has not forgotten anything when the marker is absent.
    *marker_set = matches!(
        guarded(|| w.store.put_many(&[(w.marker, value)])).as_deref(),
        Ok([Put::Written | Put::Held])
    );
}

/// One batch: deletions first (a value found invalid can then be written
/// again), then writes, then renewals.
fn carry_out(w: &WriterSetup, ops: Vec<Op>, forget_all: &dyn Fn()) {
    let c = &*w.counters;
    let (mut removes, mut puts, mut touches) = (Vec::new(), Vec::new(), Vec::new());
    for op in ops {
        match op {
            Op::Remove(k) => removes.push(k),
            Op::Put(k, b) => puts.push((k, b)),
            Op::Touch(k) => touches.push(k),
        }
    }
    let failed = |e: &RemoteError| {
        c.error(e.kind);
        if e.kind == ErrorKind::Connection {
            // A lost connection may be a restarted store: offer again.
            Counters::add(&c.store_resets, 1);
            forget_all();
        }
    };
    if !removes.is_empty() {
        match guarded(|| w.store.remove_many(&removes)) {
            Ok(n) => Counters::add(&c.removed_invalid, n),
            Err(e) => failed(&e),
        }
    }
    if !puts.is_empty() {
        let t0 = Instant::now();
        let r = guarded(|| w.store.put_many(&puts));
        c.put_latency.record(t0.elapsed());
        let mut k = w.known.lock().unwrap_or_else(|e| e.into_inner());
        match r {
            Ok(answers) => {
                for ((key, blob), a) in puts.iter().zip(&answers) {
                    match a {
                        Put::Written => {
                            Counters::add(&c.put_blocks, 1);
                            Counters::add(&c.bytes_out, blob.len());
                        }
                        Put::Held => Counters::add(&c.put_existing, 1),
                        Put::Refused => {
                            Counters::add(&c.put_failed, 1);
                            k.forget(*key);
                        }
                    }
                }
                // A store that answered fewer items than it was given.
                for (key, _) in puts.iter().skip(answers.len()) {
                    Counters::add(&c.put_failed, 1);
                    k.forget(*key);
                }
            }
            Err(e) => {
                let counter = if e.kind == ErrorKind::Timeout {
                    &c.put_unconfirmed
                } else {
                    &c.put_failed
                };
                Counters::add(counter, puts.len());
                for (key, _) in &puts {
                    k.forget(*key);
                }
                drop(k);
                failed(&e);
            }
        }
    }
    if !touches.is_empty() {
        match guarded(|| w.store.touch_many(&touches)) {
            Ok(held) => Counters::add(&c.renewed_blocks, held.iter().filter(|h| **h).count()),
            Err(e) => failed(&e),
        }
    }
}
