//! [`RemoteCache`]: what an engine holds — the scope, the secret, the
//! store, the write-behind queue, the counters — and the two operations
//! it needs: the verified leading blocks of a chain
//! ([`fetch`](RemoteCache::fetch)), and a block offered for writing
//! ([`offer`](RemoteCache::offer)).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvforge_prefix::ExtraKeys;

use crate::clock::{Clock, SystemClock};
use crate::key::{Link, RemoteKey, Scope};
use crate::known::Known;
use crate::secret::Secret;
use crate::stats::{Counters, RemoteStats, StatsSource};
use crate::writer::{Op, WriteBehind, WriterSetup};
use crate::{RemoteTier, blob};

/// Bounds of a [`RemoteCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Blobs the write-behind queue holds at most.
    pub queue_blocks: usize,
    /// Bytes the write-behind queue holds at most.
    pub queue_bytes: usize,
    /// Blobs per batched write.
    pub batch: usize,
    /// Blocks one lookup asks for at most.
    pub max_lookup_blocks: usize,
    /// Payload bytes one lookup asks for at most (a long prompt's rest is
    /// computed rather than fetched past the deadline).
    pub max_lookup_bytes: u64,
    /// After a lookup that timed out or found no connection, lookups are
    /// skipped (a miss, counted) for this long, so a store that hangs
    /// costs one deadline per back-off, not one per request.
    pub backoff: Duration,
    /// Keys remembered as stored (not offered again), at most.
    pub remember: usize,
    /// How long a key is remembered as stored (the store may expire or
    /// evict it: after this it is written again, set-if-absent).
    pub remember_for: Duration,
    /// How often the writer checks that the store still holds its marker
    /// (a store that forgot everything has every local block offered
    /// again).
    pub probe_every: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            queue_blocks: 1024,
            queue_bytes: 256 << 20,
            batch: 32,
            max_lookup_blocks: 1024,
            max_lookup_bytes: 256 << 20,
            backoff: Duration::from_secs(1),
            remember: 1 << 16,
            remember_for: Duration::from_secs(600),
            probe_every: Duration::from_secs(1),
        }
    }
}

/// What became of an offered block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Queued for writing.
    Queued,
    /// The queue was full: not written (counted).
    Dropped,
    /// Stored (or queued) recently: nothing to do.
    Known,
}

/// A [`RemoteTier`] with its scope: verified reads, write-behind writes,
/// counters. Every failure is a miss.
pub struct RemoteCache {
    store: Arc<dyn RemoteTier>,
    scope: Scope,
    secret: Secret,
    opts: RemoteOptions,
    counters: Arc<Counters>,
    known: Arc<Mutex<Known>>,
    /// Until when lookups are skipped (after a timeout or a lost
    /// connection).
    quiet_until: Mutex<Option<Instant>>,
    clock: Arc<dyn Clock>,
    writer: WriteBehind,
}

impl RemoteCache {
    /// A cache of blocks in `scope` on `store`, sealed and verified under
    /// `secret` (the same on every instance that shares them).
    pub fn new(
        store: Arc<dyn RemoteTier>,
        scope: Scope,
        secret: Secret,
        opts: RemoteOptions,
    ) -> Self {
        Self::with_clock(store, scope, secret, opts, Arc::new(SystemClock))
    }

    /// [`new`](Self::new), its remembering and back-off read from `clock`.
    pub fn with_clock(
        store: Arc<dyn RemoteTier>,
        scope: Scope,
        secret: Secret,
        opts: RemoteOptions,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let counters = Arc::new(Counters::default());
        let known = Arc::new(Mutex::new(Known::new(opts.remember, opts.remember_for)));
        // A key of this cache alone (random), in the blocks' key space.
        let nonce = Secret::random();
        let marker = scope.root(&secret, &ExtraKeys::namespace(nonce.tenant("marker")));
        let writer = WriteBehind::spawn(WriterSetup {
            store: store.clone(),
            counters: counters.clone(),
            known: known.clone(),
            max_blocks: opts.queue_blocks,
            max_bytes: opts.queue_bytes,
            batch: opts.batch,
            marker,
            probe_every: opts.probe_every,
        });
        RemoteCache {
            store,
            scope,
            secret,
            opts,
            counters,
            known,
            quiet_until: Mutex::new(None),
            clock,
            writer,
        }
    }

    /// The scope its keys cover.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The store, described.
    pub fn describe(&self) -> String {
        self.store.describe()
    }

    /// The links of every full block of `tokens`.
    pub fn chain(&self, tokens: &[u32], extra: &ExtraKeys) -> Vec<Link> {
        self.scope.chain(&self.secret, tokens, extra)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The payloads of the leading blocks of `links` that the store holds
    /// and that verify, in one round; `tokens` are the blocks' tokens
    /// (`links.len()` whole blocks, or fewer: then only as many links are
    /// asked for). At most [`RemoteOptions::max_lookup_blocks`] and
    /// [`RemoteOptions::max_lookup_bytes`]. Stops at the first block absent
    /// or invalid (the keys of those are forgotten as stored, so they are
    /// written again; an invalid value is deleted first, behind); the
    /// verified ones have their expiry renewed, behind. A store error is a
    /// miss of all, and a timeout or a lost connection skips lookups for
    /// [`RemoteOptions::backoff`]. Blocks the calling thread for at most
    /// the store's deadline: call it where nothing else waits on it.
    pub fn fetch(&self, links: &[Link], tokens: &[u32]) -> Vec<Vec<u8>> {
        let bs = self.scope.block_size as usize;
        let by_bytes = self.opts.max_lookup_bytes / self.scope.payload_bytes.max(1);
        let n = links
            .len()
            .min(tokens.len() / bs.max(1))
            .min(self.opts.max_lookup_blocks)
            .min(usize::try_from(by_bytes).unwrap_or(usize::MAX));
        if n == 0 {
            return Vec::new();
        }
        let c = &*self.counters;
        if self.quiet() {
            Counters::add(&c.lookups_skipped, 1);
            Counters::add(&c.miss_blocks, n);
            return Vec::new();
        }
        Counters::add(&c.lookups, 1);
        Counters::add(&c.lookup_blocks, n);
        let keys: Vec<RemoteKey> = links[..n].iter().map(|l| l.key).collect();
        let t0 = Instant::now();
        let got = self.store.get_many(&keys);
        c.get_latency.record(t0.elapsed());
        let values = match got {
            Ok(v) => v,
            Err(e) => {
                c.error(e.kind);
                if e.kind != crate::ErrorKind::Store {
                    *self.lock_quiet() = Some(self.clock.now() + self.opts.backoff);
                }
                Counters::add(&c.miss_blocks, n);
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        let mut bad = Vec::new();
        for (i, v) in values.iter().enumerate().take(n) {
            let Some(v) = v else {
                bad.extend(
                    values[i..]
                        .iter()
                        .zip(&links[i..n])
                        .filter(|(v, _)| v.is_none())
                        .map(|(_, l)| l.key),
                );
                break;
            };
            Counters::add(&c.bytes_in, v.len());
            let toks = &tokens[i * bs..(i + 1) * bs];
            match blob::open(v, &self.secret, &self.scope, links[i], toks) {
                Ok(p) => out.push(p.to_vec()),
                Err(_) => {
                    Counters::add(&c.invalid_blocks, 1);
                    bad.push(links[i].key);
                    // Deleted, so that a valid block can be written there.
                    self.writer.offer(Op::Remove(links[i].key));
                    break;
                }
            }
        }
        Counters::add(&c.hit_blocks, out.len());
        Counters::add(&c.hit_tokens, out.len() * bs);
        Counters::add(&c.miss_blocks, n - out.len());
        let now = self.clock.now();
        let mut k = self.known();
        for l in &links[..out.len()] {
            k.insert(l.key, now);
        }
        for key in bad {
            k.forget(key);
        }
        drop(k);
        for l in &links[..out.len()] {
            self.writer.offer(Op::Touch(l.key));
        }
        out
    }

    fn lock_quiet(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.quiet_until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether lookups are in their back-off.
    fn quiet(&self) -> bool {
        let mut q = self.lock_quiet();
        match *q {
            Some(t) if self.clock.now() < t => true,
            Some(_) => {
                *q = None;
                false
            }
            None => false,
        }
    }

    /// Whether a block at `key` should be offered (it was not stored or
    /// queued recently): ask before copying its content out.
    pub fn wants(&self, key: RemoteKey) -> bool {
        !self.known().fresh(key, self.clock.now())
    }

    /// Offers the block at `link` holding `tokens`, whose KV is `payload`
    /// (in the scope's format), for writing behind.
    pub fn offer(&self, link: Link, tokens: &[u32], payload: &[u8]) -> Offer {
        if !self.wants(link.key) {
            return Offer::Known;
        }
        let blob = blob::seal(&self.secret, &self.scope, link, tokens, payload);
        // Known before it is queued: the writer forgets it if the write fails.
        self.known().insert(link.key, self.clock.now());
        if self.writer.offer(Op::Put(link.key, blob)) {
            Offer::Queued
        } else {
            self.known().forget(link.key);
            Counters::add(&self.counters.put_dropped, 1);
            Offer::Dropped
        }
    }

    /// Waits, at most `timeout`, until everything queued was written;
    /// whether it was.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.writer.flush(timeout)
    }

    /// Blobs waiting to be written.
    pub fn pending(&self) -> usize {
        self.writer.pending()
    }

    /// The counters now.
    pub fn stats(&self) -> RemoteStats {
        self.counters.read()
    }

    /// A handle on the live counters, for another thread.
    pub fn stats_source(&self) -> StatsSource {
        StatsSource(vec![self.counters.clone()])
    }
}
