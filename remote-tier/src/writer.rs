//! [`WriteBehind`]: a bounded queue of blobs and one thread that writes
//! them to the store in batches. Offering never blocks: a full queue
//! drops the blob and counts it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cache::Known;
use crate::stats::Counters;
use crate::{RemoteKey, RemoteTier};

#[derive(Default)]
struct Queue {
    items: VecDeque<(RemoteKey, Vec<u8>)>,
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

/// A bounded write-behind queue in front of a [`RemoteTier`].
pub struct WriteBehind {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl WriteBehind {
    /// A queue of at most `max_blocks` blobs and `max_bytes` bytes, written
    /// `batch` at a time by a thread of its own.
    pub(crate) fn spawn(
        store: Arc<dyn RemoteTier>,
        counters: Arc<Counters>,
        known: Arc<Mutex<Known>>,
        max_blocks: usize,
        max_bytes: usize,
        batch: usize,
    ) -> Self {
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            max_blocks,
            max_bytes,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvforge-remote-writer".into())
            .spawn(move || run(&s, &*store, &counters, &known, batch.max(1)))
            .ok();
        WriteBehind { shared, thread }
    }

    /// Queues `blob` under `key`; `false` (and nothing queued) when the
    /// queue is full or has no writer.
    pub(crate) fn offer(&self, key: RemoteKey, blob: Vec<u8>) -> bool {
        if self.thread.is_none() {
            return false;
        }
        let mut q = self.shared.lock();
        let fits = q.items.len() < self.shared.max_blocks
            && q.bytes.saturating_add(blob.len()) <= self.shared.max_bytes;
        if !fits || q.stop {
            return false;
        }
        q.bytes += blob.len();
        q.items.push_back((key, blob));
        drop(q);
        self.shared.work.notify_one();
        true
    }

    /// Blobs waiting (the batch being written included).
    pub fn pending(&self) -> usize {
        let q = self.shared.lock();
        q.items.len() + usize::from(q.busy)
    }

    /// Waits until every queued blob was written (or failed), at most
    /// `timeout`; whether the queue is empty.
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

fn run(s: &Shared, store: &dyn RemoteTier, c: &Counters, known: &Mutex<Known>, batch: usize) {
    loop {
        let items: Vec<(RemoteKey, Vec<u8>)> = {
            let mut q = s.lock();
            while q.items.is_empty() && !q.stop {
                q = s.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.stop {
                let left = q.items.len();
                Counters::add(&c.put_dropped, left);
                q.items.clear();
                q.bytes = 0;
                drop(q);
                s.done.notify_all();
                return;
            }
            let n = q.items.len().min(batch);
            let items: Vec<_> = q.items.drain(..n).collect();
            q.bytes -= items.iter().map(|(_, b)| b.len()).sum::<usize>();
            q.busy = true;
            items
        };
        let t0 = Instant::now();
        // A store that panics fails its batch, not the writer.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.put_many(&items)))
            .unwrap_or_else(|_| {
                Err(crate::RemoteError::new(
                    crate::ErrorKind::Store,
                    "the store panicked",
                ))
            });
        c.put_latency.record(t0.elapsed());
        match r {
            Ok(written) => {
                let bytes: usize = items.iter().map(|(_, b)| b.len()).sum();
                Counters::add(&c.bytes_out, bytes);
                Counters::add(&c.put_blocks, written);
                Counters::add(&c.put_existing, items.len().saturating_sub(written));
            }
            Err(e) => {
                c.error(e.kind);
                Counters::add(&c.put_failed, items.len());
                let mut k = known.lock().unwrap_or_else(|e| e.into_inner());
                for (key, _) in &items {
                    k.forget(*key);
                }
            }
        }
        s.lock().busy = false;
        s.done.notify_all();
    }
}
