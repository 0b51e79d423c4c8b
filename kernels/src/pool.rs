//! [`Pool`]: a few worker threads kept for the matmuls of every step.
//!
//! A decode step of a 30-layer model calls about 200 matmuls of a few
//! hundred microseconds each: a thread spawned per call (tens of
//! microseconds) would cost more than it saves. The workers stay, spin a
//! short while after each job (the next one usually follows within
//! microseconds), then sleep on a condition variable.
//!
//! [`Pool::run`] hands part `i` of `parts` to worker `i - 1` and runs part
//! 0 on the calling thread; it returns when every part has ended, so the
//! job may borrow from the caller's stack.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{KernelError, Result};

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

/// A job: part `i` of it. The `'static` is a lie told for one call of
/// [`Pool::run`], which waits for every part before it returns.
type Job = &'static (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped for every job: what idle workers spin on.
    epoch: AtomicU64,
    /// The job's number (as `epoch`), the job and how many parts it has,
    /// read together: a worker runs each job it takes part in once.
    job: Mutex<(u64, Option<(Job, usize)>)>,
    wake: Condvar,
    /// Workers still running the current job.
    busy: AtomicUsize,
    /// A part panicked.
    panicked: AtomicBool,
    stop: AtomicBool,
}

/// Worker threads for data-parallel kernels.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time: a second caller waits.
    running: Mutex<()>,
}

impl Pool {
    /// A pool that runs jobs over `threads` threads: the caller's and
    /// `threads - 1` workers (none for 0 or 1).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new((0, None)),
            wake: Condvar::new(),
            busy: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("kvforge-matmul-{i}"))
                    .spawn(move || work(&s, i))
            })
            .filter_map(std::result::Result::ok)
            .collect();
        Pool {
            shared,
            workers,
            running: Mutex::new(()),
        }
    }

    /// Threads a job runs on (the caller's included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0)` … `f(parts - 1)`, part 0 on this thread and part `i` on
    /// worker `i - 1`; `parts` at most [`threads`](Self::threads). Returns
    /// when all have ended; an error if one panicked.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> Result<()> {
        if parts > self.threads() {
            return Err(KernelError::Shape(format!(
                "{parts} parts for a pool of {} threads",
                self.threads()
            )));
        }
        if parts <= 1 {
            return catch_unwind(AssertUnwindSafe(|| (0..parts).for_each(f)))
                .map_err(|_| panicked());
        }
        let _one = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the reference is used by the workers only between here
        // and the wait below for `busy` to reach zero; `run` does not
        // return (nor unwind: part 0 is caught) before that.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        let s = &self.shared;
        s.panicked.store(false, Ordering::Relaxed);
        s.busy.store(parts - 1, Ordering::Release);
        {
            let mut state = s.job.lock().unwrap_or_else(|e| e.into_inner());
            let epoch = s.epoch.fetch_add(1, Ordering::AcqRel) + 1;
            *state = (epoch, Some((job, parts)));
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        while s.busy.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        s.job.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
        if mine.is_err() || s.panicked.load(Ordering::Relaxed) {
            return Err(panicked());
        }
        Ok(())
    }

    /// The process' pool for the engine's matmuls: as many threads as
    /// [`set_global_threads`] asked for before its first use (else the
    /// CPUs this process may use).
    pub fn global() -> &'static Pool {
        GLOBAL.get_or_init(|| {
            let n = match WANTED.load(Ordering::Relaxed) {
                0 => std::thread::available_parallelism().map_or(1, usize::from),
                n => n,
            };
            Pool::new(n)
        })
    }
}

static GLOBAL: OnceLock<Pool> = OnceLock::new();
static WANTED: AtomicUsize = AtomicUsize::new(0);

/// Sets the thread count of [`Pool::global`]; `false` if it was already
/// built with another.
pub fn set_global_threads(n: usize) -> bool {
    WANTED.store(n.max(1), Ordering::Relaxed);
    GLOBAL.get().is_none_or(|p| p.threads() == n.max(1))
}

fn panicked() -> KernelError {
    KernelError::Unsupported("a matmul worker panicked".into())
}

/// Worker `me`: runs part `me` of every job with at least `me + 1` parts.
fn work(s: &Shared, me: usize) {
    let mut seen = 0u64;
    loop {
        let since = Instant::now();
        while s.epoch.load(Ordering::Acquire) == seen && since.elapsed() < SPIN {
            std::hint::spin_loop();
        }
        let (epoch, job) = {
            let mut state = s.job.lock().unwrap_or_else(|e| e.into_inner());
            while state.0 == seen && !s.stop.load(Ordering::Acquire) {
                state = s.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            *state
        };
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        seen = epoch;
        if let Some((f, parts)) = job
            && me < parts
        {
            if catch_unwind(AssertUnwindSafe(|| f(me))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
            s.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _job = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_part_runs_once_per_job() {
        let pool = Pool::new(3);
        let hits: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        for _ in 0..1000 {
            pool.run(3, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 1000);
        }
        // Fewer parts than threads: the idle worker runs nothing.
        pool.run(2, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(hits[2].load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn a_panicking_part_is_an_error_and_the_pool_goes_on() {
        let pool = Pool::new(2);
        let r = pool.run(2, &|i| assert!(i != 1, "part one fails"));
        assert!(r.is_err());
        let r = pool.run(2, &|i| assert!(i != 0, "part zero fails"));
        assert!(r.is_err());
        let n = AtomicU32::new(0);
        pool.run(2, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn more_parts_than_threads_is_refused() {
        let pool = Pool::new(2);
        assert!(pool.run(3, &|_| {}).is_err());
    }

    #[test]
    fn a_worker_asleep_wakes_for_the_next_job() {
        let pool = Pool::new(2);
        std::thread::sleep(SPIN * 5);
        let n = AtomicU32::new(0);
        pool.run(2, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
