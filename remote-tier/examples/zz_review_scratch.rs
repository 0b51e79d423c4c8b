//! TEMPORARY review scratch (to be deleted).
#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvforge_prefix::ExtraKeys;
use kvforge_remote::blob;
use kvforge_remote::{
    ErrorKind, MemoryTier, Offer, RemoteCache, RemoteError, RemoteKey, RemoteOptions, RemoteTier,
    Scope,
};

fn scope() -> Scope {
    Scope {
        seed: 42,
        model: 0xfeed,
        layers: 2,
        kv_heads: 1,
        head_dim: 4,
        block_size: 4,
        format: "f32".into(),
        payload_bytes: 2 * 2 * 4 * 4 * 4,
    }
}
fn payload(s: &Scope, i: usize) -> Vec<u8> {
    (0..s.payload_bytes as usize)
        .map(|j| (i * 31 + j) as u8)
        .collect()
}
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| t * 7 + 1).collect()
}

struct Slow {
    inner: MemoryTier,
    get_delay: Duration,
    put_delay: Duration,
    fail_put: bool,
    calls: AtomicUsize,
}
impl RemoteTier for Slow {
    fn contains(&self, k: &[RemoteKey]) -> Result<Vec<bool>, RemoteError> {
        self.inner.contains(k)
    }
    fn get_many(&self, k: &[RemoteKey]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.get_delay);
        Err(RemoteError::new(ErrorKind::Timeout, "slow")).or_else(|e: RemoteError| {
            if self.get_delay.is_zero() {
                self.inner.get_many(k)
            } else {
                Err(e)
            }
        })
    }
    fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<usize, RemoteError> {
        std::thread::sleep(self.put_delay);
        if self.fail_put {
            return Err(RemoteError::new(ErrorKind::Connection, "down"));
        }
        self.inner.put_many(items)
    }
    fn describe(&self) -> String {
        "slow".into()
    }
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let s = scope();
    let e = ExtraKeys::default();
    match which.as_str() {
        // 1. An expired/evicted head block is never re-offered while "known".
        "known" => {
            let store = Arc::new(MemoryTier::new());
            let a = RemoteCache::new(store.clone(), s.clone(), RemoteOptions::default());
            let b = RemoteCache::new(store.clone(), s.clone(), RemoteOptions::default());
            let t = tokens(12);
            let links = a.chain(&t, &e);
            for i in 0..3 {
                assert_eq!(
                    a.offer(links[i], &t[i * 4..i * 4 + 4], &payload(&s, i)),
                    Offer::Queued
                );
            }
            assert!(a.flush(Duration::from_secs(5)));
            assert_eq!(b.fetch(&links, &t).len(), 3); // B hits: all 3 marked known in B
            store.raw_set(links[0].key, None); // the store expires/evicts the head
            println!(
                "B fetch after head expired: {} blocks",
                b.fetch(&links, &t).len()
            );
            // B recomputes the prompt and registers: export offers the blocks
            let o = b.offer(links[0], &t[..4], &payload(&s, 0));
            let o2 = a.offer(links[0], &t[..4], &payload(&s, 0));
            println!("B re-offer of the missing head: {o:?}; A re-offer: {o2:?}");
            assert!(b.flush(Duration::from_secs(5)) && a.flush(Duration::from_secs(5)));
            println!(
                "store holds head again: {}",
                store.raw_get(links[0].key).is_some()
            );
            println!(
                "B fetch again: {} blocks (stays 0 for remember_for = ttl/2 in the server)",
                b.fetch(&links, &t).len()
            );
        }
        // 2. No back-off: every lookup against a timing-out store pays the full deadline.
        "nobreaker" => {
            let st = Arc::new(Slow {
                inner: MemoryTier::new(),
                get_delay: Duration::from_millis(250),
                put_delay: Duration::ZERO,
                fail_put: false,
                calls: AtomicUsize::new(0),
            });
            let c = RemoteCache::new(st.clone(), s.clone(), RemoteOptions::default());
            let t = tokens(64);
            let links = c.chain(&t, &e);
            let t0 = Instant::now();
            for _ in 0..8 {
                assert!(c.fetch(&links, &t).is_empty());
            }
            println!(
                "8 admissions against a store timing out at 250 ms: {:?}, {} store calls, stats timeouts {}",
                t0.elapsed(),
                st.calls.load(Ordering::SeqCst),
                c.stats().errors_timeout
            );
        }
        // 3. Known::forget is O(remember): a dropped offer scans the whole known list on the caller's thread,
        //    and a failed batch does it per key while the caller waits on the known mutex.
        "forget" => {
            let st = Arc::new(Slow {
                inner: MemoryTier::new(),
                get_delay: Duration::ZERO,
                put_delay: Duration::from_millis(2000),
                fail_put: false,
                calls: AtomicUsize::new(0),
            });
            let opts = RemoteOptions {
                queue_blocks: 1,
                ..RemoteOptions::default()
            };
            let c = RemoteCache::new(st.clone(), s.clone(), opts);
            // fill the known set with 65536 keys via hits
            let n = 1 << 16;
            let t = tokens(4 * n);
            let links = c.chain(&t, &e);
            for (i, l) in links.iter().enumerate() {
                st.inner
                    .put_many(&[(
                        l.key,
                        blob::seal(&s, *l, &t[i * 4..i * 4 + 4], &payload(&s, i)),
                    )])
                    .unwrap();
            }
            let opts2 = RemoteOptions {
                max_lookup_blocks: n,
                ..RemoteOptions::default()
            };
            let _ = opts2;
            for chunk in 0..(n / 1024) {
                let got = c.fetch(&links[chunk * 1024..], &t[chunk * 4096..]);
                assert_eq!(got.len(), 1024);
            }
            let t2 = tokens(4 * 300 + 4000);
            let other: Vec<u32> = t2.iter().map(|x| x + 1_000_000).collect();
            let l2 = c.chain(&other, &e);
            let t0 = Instant::now();
            let mut dropped = 0;
            for i in 0..200 {
                if c.offer(l2[i], &other[i * 4..i * 4 + 4], &payload(&s, i)) == Offer::Dropped {
                    dropped += 1;
                }
            }
            println!(
                "200 offers ({dropped} dropped) with 65536 known keys: {:?} on the caller's thread",
                t0.elapsed()
            );
        }
        // 4. hostile blobs: random truncations / mutations / garbage never panic
        "fuzz" => {
            let t = tokens(4);
            let l = s.chain(&t, &e)[0];
            let good = blob::seal(&s, l, &t, &payload(&s, 0));
            let mut x: u64 = 0x9e3779b97f4a7c15;
            let mut rnd = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut accepted = 0;
            for i in 0..200_000 {
                let mut v = good.clone();
                match i % 4 {
                    0 => v.truncate((rnd() as usize) % (good.len() + 1)),
                    1 => {
                        let k = (rnd() as usize) % v.len();
                        v[k] = rnd() as u8;
                    }
                    2 => {
                        let k = (rnd() as usize) % 120;
                        for j in 0..8 {
                            if k + j < v.len() {
                                v[k + j] = 0xff;
                            }
                        }
                    }
                    _ => {
                        v = (0..(rnd() as usize % 300)).map(|_| rnd() as u8).collect();
                    }
                }
                if let Ok(p) = blob::open(&v, &s, l, &t) {
                    if p == payload(&s, 0).as_slice() {
                        accepted += 1
                    } else {
                        panic!("wrong payload accepted")
                    }
                }
            }
            println!("fuzz ok, {accepted} accepted (all identical to the original)");
        }
        _ => println!("known | nobreaker | forget | fuzz"),
    }
}
