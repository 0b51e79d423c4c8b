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
    ErrorKind, Link, ManualClock, MemoryTier, Offer, Put, RemoteCache, RemoteError, RemoteKey,
    RemoteOptions, RemoteTier, Scope, Secret, SecretError,
};

/// The cluster's secret in these tests.
fn secret() -> Secret {
    Secret::new(b"kvforge tests: the cluster secret").unwrap()
}

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
        fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
            for (k, v) in items {
                self.0.raw_set(*k, Some(v.clone()));
            }
            Ok(vec![Put::Written; items.len()])
        }
        fn remove_many(&self, k: &[RemoteKey]) -> Result<usize, RemoteError> {
            self.0.remove_many(k)
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
    let base = s.chain(&secret(), &t, &ExtraKeys::default());
    assert_eq!(base.len(), 3, "only full blocks have links");
    assert_eq!(s.chain(&secret(), &t[..11], &ExtraKeys::default()).len(), 2);
    assert_eq!(base[1].parent, base[0].key);
    assert_eq!(base[0].parent, s.root(&secret(), &ExtraKeys::default()));
    let other_secret = Secret::new(b"another cluster's secret").unwrap();
    let o = s.chain(&other_secret, &t, &ExtraKeys::default());
    assert!(
        o.iter().zip(&base).all(|(a, b)| a.key != b.key),
        "another secret, another key space"
    );
    assert_eq!(
        base,
        s.chain(&secret(), &t, &ExtraKeys::default()),
        "deterministic"
    );
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
        let c = v.chain(&secret(), &t, &ExtraKeys::default());
        assert!(c.iter().zip(&base).all(|(a, b)| a.key != b.key), "{v:?}");
    }
    let ns = s.chain(&secret(), &t, &ExtraKeys::namespace("tenant"));
    assert!(ns.iter().zip(&base).all(|(a, b)| a.key != b.key));
    let mut other = t.clone();
    other[0] += 1;
    let o = s.chain(&secret(), &other, &ExtraKeys::default());
    assert!(
        o.iter().zip(&base).all(|(a, b)| a.key != b.key),
        "a change early moves every key after it"
    );
}

#[test]
fn a_blob_opens_only_as_the_block_it_was_sealed_for() {
    let (s, k) = (scope(), secret());
    let t = tokens(4);
    let link = s.chain(&k, &t, &ExtraKeys::default())[0];
    let p = payload(&s, 0);
    let b = blob::seal(&k, &s, link, &t, &p);
    assert_eq!(blob::open(&b, &k, &s, link, &t), Ok(&p[..]));
    // What docs/remote.md sizes a store by: 118 bytes of header and MAC,
    // 4 per token, the format's name.
    assert_eq!(b.len(), 118 + s.format.len() + 4 * t.len() + p.len());
    let other_link = Link {
        key: RemoteKey(link.key.0 ^ 1),
        ..link
    };
    assert_eq!(
        blob::open(&b, &k, &s, other_link, &t),
        Err(BlobError::Foreign)
    );
    let other_parent = Link {
        parent: RemoteKey(7),
        ..link
    };
    assert_eq!(
        blob::open(&b, &k, &s, other_parent, &t),
        Err(BlobError::Foreign)
    );
    let s2 = Scope {
        model: 9,
        ..s.clone()
    };
    assert_eq!(blob::open(&b, &k, &s2, link, &t), Err(BlobError::Scope));
    let mut t2 = t.clone();
    t2[3] = 99;
    assert_eq!(blob::open(&b, &k, &s, link, &t2), Err(BlobError::Tokens));
    let other = Secret::new(b"another cluster's secret").unwrap();
    assert_eq!(blob::open(&b, &other, &s, link, &t), Err(BlobError::Mac));
    assert_eq!(
        blob::open(&b[..b.len() - 1], &k, &s, link, &t),
        Err(BlobError::Mac)
    );
    assert_eq!(
        blob::open(&b[..20], &k, &s, link, &t),
        Err(BlobError::Truncated)
    );
    assert_eq!(
        blob::open(b"KVFB\x02\x00", &k, &s, link, &t),
        Err(BlobError::Truncated)
    );
    assert_eq!(blob::open(b"", &k, &s, link, &t), Err(BlobError::Magic));
    assert_eq!(
        blob::open(b"GARBAGE-GARBAGE", &k, &s, link, &t),
        Err(BlobError::Magic)
    );
    // A payload of another length, sealed properly (another layout).
    let short = blob::seal(&k, &s, link, &t, &p[1..]);
    assert_eq!(
        blob::open(&short, &k, &s, link, &t),
        Err(BlobError::Payload)
    );
    // Every single-byte change anywhere is caught.
    for i in 0..b.len() {
        let mut x = b.clone();
        x[i] = x[i].wrapping_add(1);
        assert!(blob::open(&x, &k, &s, link, &t).is_err(), "byte {i}");
    }
}

/// The forgery of the review of `d047843` (S2): someone who can write the
/// store but does not hold the secret replaces a blob's payload and
/// recomputes everything they can — with the version-1 format's unkeyed
/// checksums, the whole of it. Every variant is refused: a MAC under a
/// key they guess (the seed, the scope's digest, the model's
/// fingerprint, all of which they may know), the old MAC kept, and a
/// valid blob moved under another key (another tenant's, another block's).
#[test]
fn a_forged_blob_is_refused() {
    let (s, k) = (scope(), secret());
    let t = tokens(8);
    let links = s.chain(&k, &t, &ExtraKeys::namespace("tenant-a"));
    let p = payload(&s, 0);
    let b = blob::seal(&k, &s, links[0], &t[..4], &p);
    let zeros = vec![0u8; p.len()];
    // Payload replaced, the MAC kept.
    let body = b.len() - 32 - p.len();
    let mut kept = b.clone();
    kept[body..body + p.len()].copy_from_slice(&zeros);
    assert_eq!(
        blob::open(&kept, &k, &s, links[0], &t[..4]),
        Err(BlobError::Mac)
    );
    // Resealed under every key the attacker can guess.
    for guess in [
        format!("{:032}", s.seed),
        format!("{:032x}", s.digest()),
        format!("{:032x}", s.model),
    ] {
        let g = Secret::new(guess.as_bytes()).unwrap();
        let forged = blob::seal(&g, &s, links[0], &t[..4], &zeros);
        assert_eq!(
            blob::open(&forged, &k, &s, links[0], &t[..4]),
            Err(BlobError::Mac)
        );
    }
    // A valid blob copied under another tenant's key, or another block's.
    let b_links = s.chain(&k, &t, &ExtraKeys::namespace("tenant-b"));
    assert_eq!(
        blob::open(&b, &k, &s, b_links[0], &t[..4]),
        Err(BlobError::Foreign)
    );
    assert_eq!(
        blob::open(&b, &k, &s, links[1], &t[4..]),
        Err(BlobError::Foreign)
    );
    // End to end: a reader of the store takes none of them, deletes what it
    // found invalid, and takes the block once it is written again.
    let store = Arc::new(MemoryTier::new());
    let c = cache(store.clone(), RemoteOptions::default());
    for forged in [
        kept,
        blob::seal(
            &Secret::new(b"guessed secret, 16+").unwrap(),
            &s,
            links[0],
            &t[..4],
            &zeros,
        ),
    ] {
        store.raw_set(links[0].key, Some(forged));
        assert!(c.fetch(&links[..1], &t[..4]).is_empty());
        assert!(c.flush(Duration::from_secs(10)));
        assert_eq!(store.raw_get(links[0].key), None, "deleted");
    }
    assert_eq!(c.stats().invalid_blocks, 2);
    assert_eq!(c.stats().removed_invalid, 2);
    assert_eq!(c.offer(links[0], &t[..4], &p), Offer::Queued);
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.fetch(&links[..1], &t[..4]), vec![p]);
}

#[test]
fn a_secret_comes_from_a_file_or_the_environment_and_is_long_enough() {
    assert!(matches!(
        Secret::new(b"short"),
        Err(SecretError::Short { len: 5, .. })
    ));
    assert!(
        matches!(
            Secret::new(b"   fifteen bytes!!\n"),
            Err(SecretError::Short { len: 15, .. })
        ),
        "surrounding whitespace is not part of it"
    );
    assert!(Secret::new(b"sixteen bytes!!!").is_ok());
    let dir = std::env::temp_dir().join(format!("kvforge-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("secret");
    std::fs::write(&f, b"a secret of some length\n").unwrap();
    let from_file = Secret::from_file_or_env(Some(&f)).unwrap();
    assert_eq!(from_file, Secret::new(b"a secret of some length").unwrap());
    assert_ne!(from_file, secret());
    let missing = Secret::from_file_or_env(Some(&dir.join("absent"))).unwrap_err();
    assert!(matches!(missing, SecretError::File { .. }), "{missing}");
    assert!(!missing.to_string().contains('\n'));
    std::fs::write(&f, b"tiny\n").unwrap();
    let e = Secret::from_file_or_env(Some(&f)).unwrap_err();
    assert!(e.to_string().contains("at least 16"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    // The secret never shows in a debug print; tenants differ by credential.
    assert!(!format!("{from_file:?}").contains("secret of"));
    let k = secret();
    assert_eq!(k.tenant("sk-alice"), secret().tenant("sk-alice"));
    assert_ne!(k.tenant("sk-alice"), k.tenant("sk-bob"));
    assert_ne!(k.tenant("sk-alice"), from_file.tenant("sk-alice"));
    assert!(!k.tenant("sk-alice").contains("alice"));
}

fn cache(store: Arc<MemoryTier>, opts: RemoteOptions) -> RemoteCache {
    RemoteCache::new(store, scope(), secret(), opts)
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
        fn put_many(&self, items: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
            // Long beside the offers (microseconds), so the writer is
            // still busy with its marker when they come on a busy machine.
            std::thread::sleep(Duration::from_millis(1000));
            self.0.put_many(items)
        }
        fn remove_many(&self, k: &[RemoteKey]) -> Result<usize, RemoteError> {
            self.0.remove_many(k)
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
    let c = RemoteCache::new(Arc::new(Slow(MemoryTier::new())), scope(), secret(), opts);
    // The writer's first act is its marker (one write of its own).
    std::thread::sleep(Duration::from_millis(300));
    let t = tokens(40);
    let links = c.chain(&t, &ExtraKeys::default());
    let t0 = std::time::Instant::now();
    let offers: Vec<Offer> = (0..10)
        .map(|i| c.offer(links[i], &t[i * 4..i * 4 + 4], &payload(c.scope(), i)))
        .collect();
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "offering never waits for the store's 1 s write: {:?}",
        t0.elapsed()
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
        let l = s.chain(&secret(), &t, &ExtraKeys::default())[0];
        blob::seal(&secret(), &s, l, &t, &payload(&s, 0)).len()
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

/// A key stored is not offered again for `remember_for`, then it is (the
/// store may have expired or evicted it; the write is set-if-absent).
#[test]
fn a_stored_key_is_remembered_for_its_time_then_offered_again() {
    let store = Arc::new(MemoryTier::new());
    let opts = RemoteOptions {
        remember_for: Duration::from_secs(600),
        ..RemoteOptions::default()
    };
    let clock = Arc::new(ManualClock::new());
    let c = RemoteCache::with_clock(store.clone(), scope(), secret(), opts, clock.clone());
    let t = tokens(4);
    let links = write_chain(&c, &t, 1);
    let again = || c.offer(links[0], &t, &payload(c.scope(), 0));
    assert_eq!(again(), Offer::Known);
    clock.advance(Duration::from_secs(599));
    assert!(!c.wants(links[0].key));
    assert_eq!(again(), Offer::Known);
    clock.advance(Duration::from_secs(1));
    assert!(c.wants(links[0].key));
    assert_eq!(again(), Offer::Queued);
    assert!(c.flush(Duration::from_secs(10)));
    // A read renews what it remembers.
    clock.advance(Duration::from_secs(599));
    assert_eq!(c.fetch(&links, &t).len(), 1);
    clock.advance(Duration::from_secs(599));
    assert_eq!(again(), Offer::Known);
}

#[test]
fn after_a_timeout_lookups_back_off_then_resume() {
    let store = Arc::new(MemoryTier::new());
    let opts = RemoteOptions {
        backoff: Duration::from_secs(30),
        ..RemoteOptions::default()
    };
    let clock = Arc::new(ManualClock::new());
    let c = RemoteCache::with_clock(store.clone(), scope(), secret(), opts, clock.clone());
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
    clock.advance(Duration::from_secs(29));
    assert!(c.fetch(&links, &t).is_empty(), "still backing off");
    clock.advance(Duration::from_secs(1));
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
    // Corrupt values are forgotten too, and deleted, so the block can be
    // written again (set-if-absent would keep the junk).
    store.raw_set(links[1].key, Some(b"junk".to_vec()));
    assert_eq!(b.fetch(&links, &t).len(), 1);
    assert!(b.wants(links[1].key));
    assert!(b.flush(Duration::from_secs(10)));
    assert_eq!(store.raw_get(links[1].key), None);
    assert_eq!(
        b.offer(links[1], &t[4..], &payload(b.scope(), 1)),
        Offer::Queued
    );
    assert!(b.flush(Duration::from_secs(10)));
    assert_eq!(a.fetch(&links, &t).len(), 2, "whole again");
}

/// S3: a lookup renews the expiry of the blocks that verified, and of no
/// other (not an invalid one, nor the blocks after a missing head).
#[test]
fn only_verified_blocks_are_renewed() {
    let store = Arc::new(MemoryTier::new());
    let c = cache(store.clone(), RemoteOptions::default());
    let t = tokens(20);
    let links = write_chain(&c, &t, 5);
    let before = store.touched();
    let mut v = store.raw_get(links[2].key).unwrap();
    v[40] ^= 1;
    store.raw_set(links[2].key, Some(v));
    assert_eq!(c.fetch(&links, &t).len(), 2);
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(store.touched() - before, 2, "blocks 0 and 1");
    assert_eq!(c.stats().renewed_blocks, 2);
    store.raw_set(links[0].key, None);
    let before = store.touched();
    assert!(c.fetch(&links, &t).is_empty());
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(store.touched(), before, "nothing after a missing head");
}

/// S5: a store that forgot everything (flushed, restarted) is noticed by
/// the writer's marker within `probe_every`: every block is offered again.
#[test]
fn after_the_store_forgets_everything_blocks_are_offered_again() {
    let store = Arc::new(MemoryTier::new());
    let opts = RemoteOptions {
        probe_every: Duration::from_millis(30),
        ..RemoteOptions::default()
    };
    let c = cache(store.clone(), opts);
    let t = tokens(8);
    let links = write_chain(&c, &t, 2);
    assert!(!c.wants(links[0].key));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.stats().store_resets, 0, "the marker is there");
    store.clear();
    let mut waited = 0;
    while c.stats().store_resets == 0 && waited < 200 {
        std::thread::sleep(Duration::from_millis(10));
        waited += 1;
    }
    assert_eq!(c.stats().store_resets, 1);
    assert!(c.wants(links[0].key) && c.wants(links[1].key));
    write_chain(&c, &t, 2);
    assert_eq!(c.fetch(&links, &t).len(), 2);
}

/// S6 and S7: a key the store refuses (out of memory) is a failed write,
/// not one it held; a write that timed out is unconfirmed (it may have
/// landed), not failed; either is offered again.
#[test]
fn refused_and_timed_out_writes_are_counted_as_what_they_are() {
    let s = scope();
    let blob_len = {
        let t = tokens(4);
        let l = s.chain(&secret(), &t, &ExtraKeys::default())[0];
        blob::seal(&secret(), &s, l, &t, &payload(&s, 0)).len()
    };
    let store = Arc::new(MemoryTier::with_capacity(blob_len - 1));
    let c = cache(store.clone(), RemoteOptions::default());
    let t = tokens(8);
    let links = c.chain(&t, &ExtraKeys::default());
    for i in 0..2 {
        c.offer(links[i], &t[i * 4..i * 4 + 4], &payload(c.scope(), i));
    }
    assert!(c.flush(Duration::from_secs(10)));
    let st = c.stats();
    assert_eq!((st.put_failed, st.put_existing, st.put_blocks), (2, 0, 0));
    assert!(c.wants(links[0].key) && c.wants(links[1].key));
    let store = Arc::new(MemoryTier::new());
    let c = cache(store.clone(), RemoteOptions::default());
    store.fail_with(Some(ErrorKind::Timeout));
    c.offer(links[0], &t[..4], &payload(c.scope(), 0));
    assert!(c.flush(Duration::from_secs(10)));
    let st = c.stats();
    assert_eq!((st.put_unconfirmed, st.put_failed), (1, 0));
    assert!(c.wants(links[0].key));
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
        fn put_many(&self, _: &[(RemoteKey, Vec<u8>)]) -> Result<Vec<Put>, RemoteError> {
            panic!("a store bug")
        }
        fn remove_many(&self, _: &[RemoteKey]) -> Result<usize, RemoteError> {
            panic!("a store bug")
        }
        fn describe(&self) -> String {
            "panics".into()
        }
    }
    let c = RemoteCache::new(
        Arc::new(Panics),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
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

/// A store that refuses the marker's write (out of memory under
/// `maxmemory` + `noeviction`: `Put::Refused`) has not forgotten anything
/// when the marker is absent: no reset is counted, nothing forgotten (the
/// review of issue 42's fixes, R5: 19 resets in 0.4 s).
#[test]
fn a_store_that_refuses_the_marker_is_not_a_store_that_forgot_everything() {
    // Holds no value at all: every write is refused, nothing is evicted.
    let store = Arc::new(MemoryTier::with_capacity(8));
    let opts = RemoteOptions {
        probe_every: Duration::from_millis(20),
        ..RemoteOptions::default()
    };
    let c = RemoteCache::new(store.clone(), scope(), secret(), opts);
    std::thread::sleep(Duration::from_millis(400));
    let st = c.stats();
    assert!(store.is_empty());
    assert_eq!(
        st.store_resets, 0,
        "a store that never held the marker reported as flushed {} times in 0.4 s: {st:?}",
        st.store_resets
    );
}
