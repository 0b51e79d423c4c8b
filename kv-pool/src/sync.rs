//! Atomics, the growth lock and the free queue, swapped for loom's models
//! under `cfg(loom)`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;

/// Lets another thread make progress while we wait for it to finish a step
/// (a queue entry being pushed, a revival being committed, a growth batch
/// being published).
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// A multi-producer multi-consumer FIFO of block indices.
///
/// Lock-free (crossbeam's `SegQueue`) in normal builds; a mutex-guarded deque
/// under loom, whose scheduler cannot see inside crossbeam.
pub(crate) struct FreeQueue {
    #[cfg(not(loom))]
    inner: crossbeam_queue::SegQueue<u32>,
    #[cfg(loom)]
    inner: loom::sync::Mutex<std::collections::VecDeque<u32>>,
}

impl FreeQueue {
    pub(crate) fn new() -> Self {
        FreeQueue {
            inner: Default::default(),
        }
    }

    #[cfg(not(loom))]
    pub(crate) fn push(&self, index: u32) {
        self.inner.push(index);
    }

    #[cfg(not(loom))]
    pub(crate) fn pop(&self) -> Option<u32> {
        self.inner.pop()
    }

    #[cfg(loom)]
    pub(crate) fn push(&self, index: u32) {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(index);
    }

    #[cfg(loom)]
    pub(crate) fn pop(&self) -> Option<u32> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }
}
