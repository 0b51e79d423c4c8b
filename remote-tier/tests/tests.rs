//! The remote tier's tests: the conformance suite on the in-memory store,
//! the blob's checks one by one, the cache's verified reads and bounded
//! write-behind, every failure a miss.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use kvforge_prefix::ExtraKeys;
use kvforge_remote::blob::{self, BlobError};
use kvforge_remote::testing::check_remote_tier;
use kvforge_remote::{
    ErrorKind, Link, MemoryTier, Offer, RemoteCache, RemoteKey, RemoteOptions, RemoteTier, Scope,
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

/// Block `i`'s payload: its bytes say which block it is.
fn payload(s: &Scope, i: usize) -> Vec<u8> {
    (0..s.payload_bytes as usize)
        .map(|j| (i * 31 + j) as u8)
        .collect()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| t * 7 + 1).collect()
}

#[test]
fn memory_tier_passes_the_conformance_suite() {
    check_remote_tier(&MemoryTier::new(), 1).unwrap();
    check_remote_tier(&MemoryTier::with_capacity(64 << 20), 2).unwrap();
}

#[test]
fn the_suite_catches_a_store_that_overwrites() {
    struct Overwrites(MemoryTier);
    impl RemoteTier for Overwrites {
        fn contains(&self, k: &[RemoteKey]) -> Result<Vec<bool>, kvforge_remote::RemoteError> {
            self.0.contains(k)
        }
        fn get_many(
            &self,
            k: &[RemoteKey],
        ) -> Result<Vec<Option<Vec<u8>>>, kvforge_remote::RemoteError> {
            self.0.get_many(k)
        }
        fn put_many(
            &self,
            items: &[(RemoteKey, Vec<u8>)],
        ) -> Result<usize, kvforge_remote::RemoteError> {
            for (k, v) in items {
                self.0.raw_set(*k, Some(v.clone()));
            }
            Ok(items.len())
        }
        fn describe(&self) -> String {
            "overwrites".into()
        }
    }
    let e = check_remote_tier(&Overwrites(MemoryTier::new()), 3).unwrap_err();
    assert!(e.contains("already held"), "{e}");
}

#[test]
fn keys_cover_every_part_of_the_scope_and_the_prefix() {
    let s = scope();
    let t = tokens(12);
    let base = s.chain(&t, &ExtraKeys::default());
    assert_eq!(base.len(), 3, "only full blocks have links");
    assert_eq!(s.chain(&t[..11], &ExtraKeys::default()).len(), 2);
    assert_eq!(base[1].parent, base[0].key);
    assert_eq!(base[0].parent, s.root(&ExtraKeys::default()));
    assert_eq!(base, s.chain(&t, &ExtraKeys::default()), "deterministic");
    let variants: Vec<Scope> = vec![
        Scope {
            seed: 43,
            ..s.clone()
        },
        Scope {
            model: 1,
            ..s.clone()
        },
        Scope {
            layers: 3,
            ..s.clone()
        },
        Scope {
            kv_heads: 2,
            ..s.clone()
        },
        Scope {
            head_dim: 8,
            ..s.clone()
        },
        Scope {
            format: "f16".into(),
            ..s.clone()
        },
        Scope {
            payload_bytes: 1,
            ..s.clone()
        },
    ];
    for v in &variants {
        let c = v.chain(&t, &ExtraKeys::default());
        assert!(c.iter().zip(&base).all(|(a, b)| a.key != b.key), "{v:?}");
    }
    let ns = s.chain(&t, &ExtraKeys::namespace("tenant"));
    assert!(ns.iter().zip(&base).all(|(a, b)| a.key != b.key));
    let mut other = t.clone();
    other[0] += 1;
    let o = s.chain(&other, &ExtraKeys::default());
    assert!(
        o.iter().zip(&base).all(|(a, b)| a.key != b.key),
        "a change early moves every key after it"
    );
}

#[test]
fn a_blob_opens_only_as_the_block_it_was_sealed_for() {
    let s = scope();
    let t = tokens(4);
    let link = s.chain(&t, &ExtraKeys::default())[0];
    let p = payload(&s, 0);
    let b = blob::seal(&s, link, &t, &p);
    assert_eq!(blob::open(&b, &s, link, &t), Ok(&p[..]));
    let other_link = Link {
        key: RemoteKey(link.key.0 ^ 1),
        ..link
    };
    assert_eq!(blob::open(&b, &s, other_link, &t), Err(BlobError::Foreign));
    let other_parent = Link {
        parent: RemoteKey(7),
        ..link
    };
    assert_eq!(
        blob::open(&b, &s, other_parent, &t),
        Err(BlobError::Foreign)
    );
    let s2 = Scope {
        model: 9,
        ..s.clone()
    };
    assert_eq!(blob::open(&b, &s2, link, &t), Err(BlobError::Scope));
    let mut t2 = t.clone();
    t2[3] = 99;
    assert_eq!(blob::open(&b, &s, link, &t2), Err(BlobError::Tokens));
    assert_eq!(
        blob::open(&b[..b.len() - 1], &s, link, &t),
        Err(BlobError::Truncated)
    );
    assert_eq!(
        blob::open(&b[..20], &s, link, &t),
        Err(BlobError::Truncated)
    );
    assert_eq!(blob::open(b"", &s, link, &t), Err(BlobError::Truncated));
    assert_eq!(
        blob::open(b"GARBAGE-GARBAGE", &s, link, &t),
        Err(BlobError::Magic)
    );
    let mut flipped = b.clone();
    *flipped.last_mut().unwrap() ^= 0x40;
    assert_eq!(blob::open(&flipped, &s, link, &t), Err(BlobError::Payload));
    let mut header = b.clone();
    header[10] ^= 1;
    assert_eq!(blob::open(&header, &s, link, &t), Err(BlobError::Header));
    let mut longer = b.clone();
    longer.push(0);
    assert_eq!(blob::open(&longer, &s, link, &t), Err(BlobError::Payload));
    // Every single-byte change anywhere is caught.
    for i in 0..b.len() {
        let mut x = b.clone();
        x[i] = x[i].wrapping_add(1);
        assert!(blob::open(&x, &s, link, &t).is_err(), "byte {i}");
    }
}

fn cache(store: Arc<MemoryTier>, opts: RemoteOptions) -> RemoteCache {
    RemoteCache::new(store, scope(), opts)
}

fn write_chain(c: &RemoteCache, t: &[u32], blocks: usize) -> Vec<Link> {
    let links = c.chain(t, &ExtraKeys::default());
    for (i, l) in links.iter().enumerate().take(blocks) {
        assert_eq!(
            c.offer(*l, &t[i * 4..i * 4 + 4], &payload(c.scope(), i)),
            Offer::Queued
        );
    }
    assert!(c.flush(Duration::from_secs(10)));
    links
}

#[test]
fn a_second_cache_reads_what_the_first_wrote() {
    let store = Arc::new(MemoryTier::new());
    let a = cache(store.clone(), RemoteOptions::default());
    let t = tokens(16);
    let links = write_chain(&a, &t, 4);
    assert_eq!(
        a.offer(links[0], &t[..4], &payload(a.scope(), 0)),
        Offer::Known
    );
    let st = a.stats();
    assert_eq!((st.put_blocks, st.put_dropped, st.put_failed), (4, 0, 0));
    assert!(st.bytes_out > 4 * scope().payload_bytes);
    let b = cache(store.clone(), RemoteOptions::default());
    let got = b.fetch(&links[1..], &t[4..]);
    assert_eq!(
        got,
        (1..4).map(|i| payload(b.scope(), i)).collect::<Vec<_>>()
    );
    let st = b.stats();
    assert_eq!(
        (st.lookups, st.hit_blocks, st.hit_tokens, st.miss_blocks),
        (1, 3, 12, 0)
    );
    assert!(!b.wants(links[2].key), "a block read is known to be stored");
}

#[test]
fn only_the_verified_leading_blocks_are_used() {
    let store = Arc::new(MemoryTier::new());
    let c = cache(store.clone(), RemoteOptions::default());
    let t = tokens(20);
    let links = write_chain(&c, &t, 5);
    // Block 2 corrupted (one byte), block 3 a foreign value (block 4's blob).
    let mut v = store.raw_get(links[2].key).unwrap();
    let n = v.len();
    v[n - 3] ^= 0xff;
    store.raw_set(links[2].key, Some(v));
    let got = c.fetch(&links, &t);
    assert_eq!(got.len(), 2);
    let st = c.stats();
    assert_eq!((st.invalid_blocks, st.miss_blocks), (1, 3));
    let foreign = store.raw_get(links[4].key).unwrap();
    store.raw_set(links[1].key, Some(foreign));
    assert_eq!(
        c.fetch(&links, &t).len(),
        1,
        "a value under another key is a miss"
    );
    store.raw_set(links[0].key, None);
    assert!(
        c.fetch(&links, &t).is_empty(),
        "an evicted first block: nothing"
    );
    // A lookup with other tokens under the same keys (a collision) misses.
    let mut other = t.clone();
    other[17] = 5;
    assert_eq!(c.fetch(&links[4..], &other[16..]).len(), 0);
}

#[test]
fn a_failing_store_is_a_miss_and_a_counter() {
    let store = Arc::new(MemoryTier::new());
    let no_backoff = RemoteOptions {
        backoff: Duration::ZERO,
        ..RemoteOptions::default()
    };
    let c = cache(store.clone(), no_backoff);
    let t = tokens(8);
    let links = write_chain(&c, &t, 2);
    for kind in [ErrorKind::Timeout, ErrorKind::Connection, ErrorKind::Store] {
        store.fail_with(Some(kind));
        assert!(c.fetch(&links, &t).is_empty());
    }
    let st = c.stats();
    assert_eq!(
        (st.errors_timeout, st.errors_connection, st.errors_store),
        (1, 1, 1)
    );
    // Writes fail too, and a failed block is offered again later.
    let t2 = tokens(12);
    let l2 = c.chain(&t2, &ExtraKeys::default());
    assert_eq!(
        c.offer(l2[2], &t2[8..], &payload(c.scope(), 2)),
        Offer::Queued
    );
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.stats().put_failed, 1);
    assert!(c.wants(l2[2].key));
    store.fail_with(None);
    assert_eq!(c.fetch(&links, &t).len(), 2, "the tier recovers");
}

#[test]
fn a_full_queue_drops_and_counts_without_blocking() {
    struct Slow(MemoryTier);
    impl RemoteTier for Slow {
        fn contains(&self, k: &[RemoteKey]) -> Result<Vec<bool>, kvforge_remote::RemoteError> {
            self.0.contains(k)
        }
        fn get_many(
            &self,
            k: &[RemoteKey],
        ) -> Result<Vec<Option<Vec<u8>>>, kvforge_remote::RemoteError> {
            self.0.get_many(k)
        }
        fn put_many(
            &self,
            items: &[(RemoteKey, Vec<u8>)],
        ) -> Result<usize, kvforge_remote::RemoteError> {
            std::thread::sleep(Duration::from_millis(200));
            self.0.put_many(items)
        }
        fn describe(&self) -> String {
            "slow".into()
        }
    }
    let opts = RemoteOptions {
        queue_blocks: 2,
        batch: 1,
        ..RemoteOptions::default()
    };
    let c = RemoteCache::new(Arc::new(Slow(MemoryTier::new())), scope(), opts);
    let t = tokens(40);
    let links = c.chain(&t, &ExtraKeys::default());
    let t0 = std::time::Instant::now();
    let offers: Vec<Offer> = (0..10)
        .map(|i| c.offer(links[i], &t[i * 4..i * 4 + 4], &payload(c.scope(), i)))
        .collect();
    assert!(
        t0.elapsed() < Duration::from_millis(150),
        "offering never waits"
    );
    let dropped = offers.iter().filter(|o| **o == Offer::Dropped).count();
    assert!((7..=8).contains(&dropped), "{offers:?}");
    assert_eq!(c.stats().put_dropped, dropped as u64);
    assert!(
        c.wants(links[9].key),
        "a dropped block may be offered again"
    );
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.stats().put_blocks, 10 - dropped as u64);
}

#[test]
fn an_evicting_store_gives_only_the_leading_blocks_it_kept() {
    let s = scope();
    let blob_len = {
        let t = tokens(4);
        let l = s.chain(&t, &ExtraKeys::default())[0];
        blob::seal(&s, l, &t, &payload(&s, 0)).len()
    };
    // Room for 3 blobs: writing 5 evicts the first two.
    let store = Arc::new(MemoryTier::with_capacity(3 * blob_len));
    let c = cache(store.clone(), RemoteOptions::default());
    let t = tokens(20);
    let links = write_chain(&c, &t, 5);
    assert_eq!(store.len(), 3);
    assert!(c.fetch(&links, &t).is_empty(), "the chain's head is gone");
    assert_eq!(c.fetch(&links[2..], &t[8..]).len(), 3);
}

#[test]
fn after_a_timeout_lookups_back_off_then_resume() {
    let store = Arc::new(MemoryTier::new());
    let opts = RemoteOptions {
        backoff: Duration::from_millis(300),
        ..RemoteOptions::default()
    };
    let c = cache(store.clone(), opts);
    let t = tokens(8);
    let links = write_chain(&c, &t, 2);
    store.fail_with(Some(ErrorKind::Timeout));
    assert!(c.fetch(&links, &t).is_empty());
    store.fail_with(None);
    // In the back-off: not asked (the store would answer now).
    for _ in 0..5 {
        assert!(c.fetch(&links, &t).is_empty());
    }
    let st = c.stats();
    assert_eq!(
        (st.lookups, st.lookups_skipped, st.errors_timeout),
        (1, 5, 1)
    );
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(c.fetch(&links, &t).len(), 2);
    // A store error (the store answered) does not back off.
    store.fail_with(Some(ErrorKind::Store));
    assert!(c.fetch(&links, &t).is_empty());
    store.fail_with(None);
    assert_eq!(c.fetch(&links, &t).len(), 2);
}

#[test]
fn a_block_found_missing_is_written_again_by_whoever_recomputes_it() {
    let store = Arc::new(MemoryTier::new());
    let a = cache(store.clone(), RemoteOptions::default());
    let b = cache(store.clone(), RemoteOptions::default());
    let t = tokens(8);
    let links = write_chain(&a, &t, 2);
    assert_eq!(b.fetch(&links, &t).len(), 2);
    assert!(!b.wants(links[0].key), "read: known stored");
    // The store lets the head go (expiry, eviction).
    store.raw_set(links[0].key, None);
    assert!(b.fetch(&links, &t).is_empty());
    assert!(b.wants(links[0].key), "found missing: offered again");
    assert!(!b.wants(links[1].key), "still there");
    assert_eq!(
        b.offer(links[0], &t[..4], &payload(b.scope(), 0)),
        Offer::Queued
    );
    assert!(b.flush(Duration::from_secs(10)));
    assert_eq!(a.fetch(&links, &t).len(), 2, "the chain is whole again");
    // Corrupt values are forgotten too.
    store.raw_set(links[1].key, Some(b"junk".to_vec()));
    assert_eq!(b.fetch(&links, &t).len(), 1);
    assert!(b.wants(links[1].key));
}

#[test]
fn a_panicking_store_fails_its_batch_not_the_writer() {
    struct Panics;
    impl RemoteTier for Panics {
        fn contains(&self, _: &[RemoteKey]) -> Result<Vec<bool>, kvforge_remote::RemoteError> {
            Ok(vec![])
        }
        fn get_many(
            &self,
            _: &[RemoteKey],
        ) -> Result<Vec<Option<Vec<u8>>>, kvforge_remote::RemoteError> {
            Ok(vec![])
        }
        fn put_many(
            &self,
            _: &[(RemoteKey, Vec<u8>)],
        ) -> Result<usize, kvforge_remote::RemoteError> {
            panic!("a store bug")
        }
        fn describe(&self) -> String {
            "panics".into()
        }
    }
    let c = RemoteCache::new(Arc::new(Panics), scope(), RemoteOptions::default());
    let t = tokens(8);
    let links = c.chain(&t, &ExtraKeys::default());
    for i in 0..2 {
        assert_eq!(
            c.offer(links[i], &t[i * 4..i * 4 + 4], &payload(c.scope(), i)),
            Offer::Queued
        );
        assert!(c.flush(Duration::from_secs(10)), "the writer lives on");
    }
    assert_eq!(c.stats().put_failed, 2);
}
