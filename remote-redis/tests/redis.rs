//! The Redis tier against real `redis-server`s started by the tests on
//! loopback ports: the conformance suite on one node and on a three-node
//! cluster, and every fault a miss — a killed server, a paused one (within
//! the deadline, then recovery), a corrupted, forged or foreign value
//! (deleted, then written again), a tiny `maxmemory` evicting inside a
//! chain or refusing writes, a flushed or restarted store (its blocks
//! offered again, the first call after a restart answered).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvforge_remote::testing::check_remote_tier;
use kvforge_remote::{
    ErrorKind, ExtraKeys, Link, Offer, RemoteCache, RemoteOptions, RemoteTier, Scope, Secret,
};
use kvforge_remote_redis::{RedisCluster, RedisConfig, RedisServer, RedisTier};

fn tier(urls: Vec<String>, cluster: bool, deadline_ms: u64) -> RedisTier {
    RedisTier::new(RedisConfig {
        urls,
        cluster,
        ttl: Some(Duration::from_secs(600)),
        deadline: Duration::from_millis(deadline_ms),
    })
    .unwrap()
}

fn scope() -> Scope {
    Scope {
        seed: 7,
        model: 0xabc,
        layers: 2,
        kv_heads: 2,
        head_dim: 8,
        block_size: 4,
        format: "f16".into(),
        payload_bytes: 2 * 2 * 2 * 8 * 4 * 2,
    }
}

fn secret() -> Secret {
    Secret::new(b"kvforge redis tests: the secret").unwrap()
}

/// A cache of `scope()` blocks on `t` under the tests' secret.
fn cache(t: Arc<RedisTier>, opts: RemoteOptions) -> RemoteCache {
    RemoteCache::new(t, scope(), secret(), opts)
}

fn payload(i: usize) -> Vec<u8> {
    (0..scope().payload_bytes as usize)
        .map(|j| (i * 13 + j) as u8)
        .collect()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| 1000 + t * 3).collect()
}

/// Writes the first `n` blocks of `t` through `c` and waits for them.
fn write(c: &RemoteCache, t: &[u32], n: usize) -> Vec<Link> {
    let links = c.chain(t, &ExtraKeys::default());
    for (i, l) in links.iter().take(n).enumerate() {
        assert_eq!(
            c.offer(*l, &t[i * 4..(i + 1) * 4], &payload(i)),
            Offer::Queued
        );
    }
    assert!(c.flush(Duration::from_secs(10)));
    assert_eq!(c.stats().put_failed, 0);
    links
}

#[test]
fn one_node_passes_the_conformance_suite_and_shares_chains() {
    let r = RedisServer::start(&[]).unwrap();
    let t = Arc::new(tier(vec![r.url()], false, 2000));
    check_remote_tier(&*t, 1).unwrap();
    let a = RemoteCache::new(t.clone(), scope(), secret(), RemoteOptions::default());
    let tok = tokens(32);
    let links = write(&a, &tok, 8);
    let b = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    assert_eq!(
        b.fetch(&links, &tok),
        (0..8).map(payload).collect::<Vec<_>>()
    );
    let ttl = r.command(&["PTTL", &links[0].key.text()]).unwrap();
    assert!(
        matches!(ttl, redis::Value::Int(ms) if ms > 500_000 && ms <= 600_000),
        "{ttl:?}"
    );
    // Another seed or model: no hit.
    for other in [
        Scope { seed: 8, ..scope() },
        Scope {
            model: 1,
            ..scope()
        },
    ] {
        let c = RemoteCache::new(t.clone(), other, secret(), RemoteOptions::default());
        let l = c.chain(&tok, &ExtraKeys::default());
        assert!(c.fetch(&l, &tok).is_empty());
        assert_eq!(c.stats().miss_blocks, 8);
    }
}

#[test]
fn a_three_node_cluster_passes_the_conformance_suite_and_shares_chains() {
    let cl = RedisCluster::start().unwrap();
    let t = Arc::new(tier(cl.urls(), true, 3000));
    check_remote_tier(&*t, 2).unwrap();
    let a = RemoteCache::new(t.clone(), scope(), secret(), RemoteOptions::default());
    let tok = tokens(64);
    let links = write(&a, &tok, 16);
    let b = RemoteCache::new(
        Arc::new(tier(cl.urls()[1..].to_vec(), true, 3000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    assert_eq!(b.fetch(&links, &tok).len(), 16);
    // The blocks are spread over the nodes.
    let held: Vec<i64> = cl
        .nodes
        .iter()
        .map(|n| match n.command(&["DBSIZE"]) {
            Ok(redis::Value::Int(k)) => k,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(held.iter().filter(|&&k| k > 0).count() >= 2, "{held:?}");
}

#[test]
fn a_killed_server_leaves_every_key_absent_or_verifying() {
    // Persisted on every write, so the restarted server holds what the
    // killed one had written, up to the kill.
    let mut r = RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always"]).unwrap();
    let t = Arc::new(tier(vec![r.url()], false, 500));
    let c = RemoteCache::new(
        t.clone(),
        scope(),
        secret(),
        RemoteOptions {
            batch: 8,
            ..RemoteOptions::default()
        },
    );
    let tok = tokens(4 * 200);
    let links = c.chain(&tok, &ExtraKeys::default());
    for (i, l) in links.iter().enumerate() {
        c.offer(*l, &tok[i * 4..(i + 1) * 4], &payload(i));
        if i == 60 {
            // Mid-stream, once something was written: the writer is still
            // busy with the queue.
            let t0 = Instant::now();
            while c.stats().put_blocks == 0 && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            r.kill().unwrap();
        }
    }
    c.flush(Duration::from_secs(30));
    let st = c.stats();
    assert!(st.put_failed > 0, "{st:?}");
    // Lookups against the dead server: misses within the deadline.
    let t0 = Instant::now();
    assert!(c.fetch(&links, &tok).is_empty());
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(c.stats().errors_connection + c.stats().errors_timeout > 0);
    r.restart().unwrap();
    let fresh = tier(vec![r.url()], false, 2000);
    let keys: Vec<_> = links.iter().map(|l| l.key).collect();
    let values = fresh.get_many(&keys).unwrap();
    let mut held = 0;
    for (i, v) in values.iter().enumerate() {
        if let Some(v) = v {
            let p = kvforge_remote::blob::open(
                v,
                &secret(),
                &scope(),
                links[i],
                &tok[i * 4..(i + 1) * 4],
            );
            assert_eq!(p, Ok(&payload(i)[..]), "block {i}");
            held += 1;
        }
    }
    assert!(
        held > 0 && held < links.len(),
        "{held} of {} blocks survived",
        links.len()
    );
}

#[test]
fn a_paused_server_times_out_within_the_deadline_then_recovers() {
    let r = RedisServer::start(&[]).unwrap();
    let t = Arc::new(tier(vec![r.url()], false, 300));
    let c = RemoteCache::new(t.clone(), scope(), secret(), RemoteOptions::default());
    let tok = tokens(16);
    let links = write(&c, &tok, 4);
    r.pause().unwrap();
    let t0 = Instant::now();
    assert!(c.fetch(&links, &tok).is_empty());
    let waited = t0.elapsed();
    // The call is capped at the deadline (300 ms) plus 50; five times the
    // deadline leaves room for a busy machine's late wake-ups.
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    assert_eq!(
        t.get_many(&[links[0].key]).unwrap_err().kind,
        ErrorKind::Timeout
    );
    r.resume().unwrap();
    let t0 = Instant::now();
    loop {
        if c.fetch(&links, &tok).len() == 4 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no recovery: {:?}",
            c.stats()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn corrupt_truncated_and_foreign_values_are_misses() {
    let r = RedisServer::start(&[]).unwrap();
    let c = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    let tok = tokens(20);
    let links = write(&c, &tok, 5);
    // SETRANGE one byte of block 3's payload.
    let k3 = links[3].key.text();
    r.command(&["SETRANGE", &k3, "200", "X"]).unwrap();
    assert_eq!(c.fetch(&links, &tok).len(), 3);
    // Truncate block 2 (rewrite it shorter).
    let v = match r.command(&["GET", &links[2].key.text()]).unwrap() {
        redis::Value::BulkString(b) => b,
        other => panic!("{other:?}"),
    };
    r.command_bytes(&[b"SET", links[2].key.text().as_bytes(), &v[..v.len() / 2]])
        .unwrap();
    assert_eq!(c.fetch(&links, &tok).len(), 2);
    // Block 1 holds block 4's blob (a value written under another key).
    let v4 = match r.command(&["GET", &links[4].key.text()]).unwrap() {
        redis::Value::BulkString(b) => b,
        other => panic!("{other:?}"),
    };
    r.command_bytes(&[b"SET", links[1].key.text().as_bytes(), &v4])
        .unwrap();
    assert_eq!(c.fetch(&links, &tok).len(), 1);
    // Not a string at all.
    r.command(&["DEL", &links[0].key.text()]).unwrap();
    r.command(&["LPUSH", &links[0].key.text(), "x"]).unwrap();
    assert!(c.fetch(&links, &tok).is_empty());
    let st = c.stats();
    assert_eq!(st.invalid_blocks, 4, "{st:?}");
    assert_eq!(st.errors_store, 0, "{st:?}");
}

#[test]
fn a_value_of_another_type_refuses_its_key_only() {
    let r = RedisServer::start(&[]).unwrap();
    let c = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    let tok = tokens(20);
    let links = write(&c, &tok, 4);
    r.command(&["LPUSH", &links[4].key.text(), "x"]).unwrap();
    assert_eq!(
        c.fetch(&links, &tok).len(),
        4,
        "the blocks before it are used"
    );
    assert_eq!(c.stats().invalid_blocks, 1);
}

#[test]
fn a_read_keeps_a_block_alive_for_another_ttl() {
    let r = RedisServer::start(&[]).unwrap();
    let t = RedisTier::new(RedisConfig {
        urls: vec![r.url()],
        cluster: false,
        ttl: Some(Duration::from_millis(1500)),
        deadline: Duration::from_secs(2),
    })
    .unwrap();
    let c = RemoteCache::new(Arc::new(t), scope(), secret(), RemoteOptions::default());
    let tok = tokens(8);
    let links = write(&c, &tok, 2);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1000));
        assert_eq!(
            c.fetch(&links, &tok).len(),
            2,
            "read within its TTL: renewed"
        );
        // The renewal goes behind, on the writer's connection.
        assert!(c.flush(Duration::from_secs(5)));
    }
    std::thread::sleep(Duration::from_millis(1700));
    assert!(
        c.fetch(&links, &tok).is_empty(),
        "unread for longer than its TTL: gone"
    );
}

#[test]
fn a_tiny_maxmemory_evicting_inside_a_chain_gives_only_the_leading_blocks() {
    let r =
        RedisServer::start(&["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"]).unwrap();
    let big = Scope {
        payload_bytes: 64 << 10,
        ..scope()
    };
    let c2 = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        big.clone(),
        secret(),
        RemoteOptions::default(),
    );
    let tok = tokens(4 * 60);
    let links = c2.chain(&tok, &ExtraKeys::default());
    let p = vec![7u8; big.payload_bytes as usize];
    for (i, l) in links.iter().enumerate() {
        c2.offer(*l, &tok[i * 4..(i + 1) * 4], &p);
        // One at a time, so the store evicts between writes.
        assert!(c2.flush(Duration::from_secs(10)));
    }
    let got = c2.fetch(&links, &tok);
    let keys: Vec<_> = links.iter().map(|l| l.key).collect();
    let present = tier(vec![r.url()], false, 2000).contains(&keys).unwrap();
    assert!(present.iter().any(|p| !p), "maxmemory evicted nothing");
    let lead = present.iter().take_while(|p| **p).count();
    assert_eq!(got.len(), lead, "{present:?}");
    assert!(got.iter().all(|g| *g == p));
}

#[test]
fn a_store_that_is_down_at_start_is_a_miss_per_call_within_the_deadline() {
    // A port nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Arc::new(tier(vec![format!("redis://127.0.0.1:{port}")], false, 300));
    let c = RemoteCache::new(t.clone(), scope(), secret(), RemoteOptions::default());
    let tok = tokens(8);
    let links = c.chain(&tok, &ExtraKeys::default());
    let t0 = Instant::now();
    assert!(c.fetch(&links, &tok).is_empty());
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    let e = t.get_many(&[links[0].key]).unwrap_err();
    assert!(
        matches!(e.kind, ErrorKind::Connection | ErrorKind::Timeout),
        "{e}"
    );
    let bad = |urls: Vec<&str>, cluster: bool, ms: u64| {
        RedisTier::new(RedisConfig {
            urls: urls.into_iter().map(String::from).collect(),
            cluster,
            ttl: None,
            deadline: Duration::from_millis(ms),
        })
        .err()
        .unwrap_or_default()
    };
    assert!(!bad(vec!["not a url"], false, 10).is_empty());
    assert!(bad(vec![], false, 10).contains("no url"));
    assert!(bad(vec!["redis://a:1"], false, 0).contains("deadline_ms"));
    assert!(bad(vec!["redis://a:1", "redis://b:2"], false, 10).contains("cluster"));
}

fn get(r: &RedisServer, key: &str) -> Option<Vec<u8>> {
    match r.command(&["GET", key]).unwrap() {
        redis::Value::BulkString(b) => Some(b),
        redis::Value::Nil => None,
        other => panic!("{other:?}"),
    }
}

fn pttl(r: &RedisServer, key: &str) -> i64 {
    match r.command(&["PTTL", key]).unwrap() {
        redis::Value::Int(ms) => ms,
        other => panic!("{other:?}"),
    }
}

/// S2 and S3 of the review of `d047843`, against a real store: someone
/// with write access replaces a block's payload and reseals it under
/// every key they could guess; a fresh instance takes none of it, deletes
/// the value (a `SET NX` could not replace it), and the block is whole
/// again once an instance that recomputed it writes it. A read renews
/// only what verified: not a fragment after a missing head.
#[test]
fn a_forged_blob_is_refused_deleted_and_written_again() {
    let r = RedisServer::start(&[]).unwrap();
    let t = || Arc::new(tier(vec![r.url()], false, 2000));
    let a = cache(t(), RemoteOptions::default());
    let tok = tokens(16);
    let links = write(&a, &tok, 4);
    let k1 = links[1].key.text();
    let real = get(&r, &k1).unwrap();
    // The forger knows the scope (seed, model, layout) and the tokens.
    let guess = Secret::new(format!("{:032}", scope().seed).as_bytes()).unwrap();
    let zeros = vec![0u8; scope().payload_bytes as usize];
    let forged = kvforge_remote::blob::seal(&guess, &scope(), links[1], &tok[4..8], &zeros);
    r.command_bytes(&[b"SET", k1.as_bytes(), &forged, b"KEEPTTL"])
        .unwrap();
    r.command(&["PEXPIRE", &k1, "60000"]).unwrap();
    let b = cache(t(), RemoteOptions::default());
    let got = b.fetch(&links, &tok);
    assert_eq!(
        got,
        vec![payload(0)],
        "the forged block and those after it are not used"
    );
    assert!(b.flush(Duration::from_secs(5)));
    assert_eq!(get(&r, &k1), None, "deleted, not renewed");
    assert_eq!(b.stats().removed_invalid, 1);
    // The instance that found it invalid recomputes and offers it.
    assert!(b.wants(links[1].key));
    assert_eq!(b.offer(links[1], &tok[4..8], &payload(1)), Offer::Queued);
    assert!(b.flush(Duration::from_secs(5)));
    assert_eq!(get(&r, &k1).as_deref(), Some(&real[..]), "the same blob");
    let c = cache(t(), RemoteOptions::default());
    assert_eq!(
        c.fetch(&links, &tok),
        (0..4).map(payload).collect::<Vec<_>>()
    );
    // That read renews all four behind: let it land before the expiry
    // below is set, or it would renew the block after the fact.
    assert!(c.flush(Duration::from_secs(5)));
    // A missing head: the blocks after it are neither used nor renewed.
    r.command(&["DEL", &links[0].key.text()]).unwrap();
    r.command(&["PEXPIRE", &links[2].key.text(), "5000"])
        .unwrap();
    assert!(c.fetch(&links, &tok).is_empty());
    assert!(c.flush(Duration::from_secs(5)));
    let left = pttl(&r, &links[2].key.text());
    assert!(
        (0..=5000).contains(&left),
        "renewed after a missing head: {left}"
    );
}

/// S5: after `FLUSHALL` the instance notices (its marker is gone) and
/// offers the blocks it holds again at their next registration: a fresh
/// instance then finds the whole chain.
#[test]
fn after_flushall_the_blocks_held_locally_are_offered_again() {
    let r = RedisServer::start(&[]).unwrap();
    let opts = RemoteOptions {
        probe_every: Duration::from_millis(100),
        ..RemoteOptions::default()
    };
    let a = cache(Arc::new(tier(vec![r.url()], false, 2000)), opts);
    let tok = tokens(16);
    let links = write(&a, &tok, 4);
    assert!(!a.wants(links[0].key));
    r.command(&["FLUSHALL"]).unwrap();
    let t0 = Instant::now();
    while a.stats().store_resets == 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", a.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        links.iter().all(|l| a.wants(l.key)),
        "every block offered again"
    );
    write(&a, &tok, 4);
    let b = cache(
        Arc::new(tier(vec![r.url()], false, 2000)),
        RemoteOptions::default(),
    );
    assert_eq!(b.fetch(&links, &tok).len(), 4);
}

/// S6: a store out of memory refuses writes; they are failed writes (and
/// offered again later), never blocks "already held".
#[test]
fn writes_refused_under_maxmemory_are_failed_not_held() {
    let r =
        RedisServer::start(&["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]).unwrap();
    let big = Scope {
        payload_bytes: 256 << 10,
        ..scope()
    };
    let c = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        big.clone(),
        secret(),
        RemoteOptions::default(),
    );
    let tok = tokens(4 * 12);
    let links = c.chain(&tok, &ExtraKeys::default());
    let p = vec![3u8; big.payload_bytes as usize];
    for (i, l) in links.iter().enumerate() {
        c.offer(*l, &tok[i * 4..(i + 1) * 4], &p);
    }
    assert!(c.flush(Duration::from_secs(10)));
    let st = c.stats();
    assert!(st.put_failed > 0, "{st:?}");
    assert_eq!(st.put_existing, 0, "{st:?}");
    assert_eq!(st.put_blocks + st.put_failed, 12, "{st:?}");
    let refused: Vec<_> = links.iter().filter(|l| c.wants(l.key)).collect();
    assert_eq!(
        refused.len() as u64,
        st.put_failed,
        "refused blocks are offered again"
    );
}

/// S7: the first call after the store restarted meets a dropped
/// connection and is answered on a fresh one.
#[test]
fn the_first_lookup_after_a_restart_is_answered() {
    let mut r = RedisServer::start(&["--appendonly", "yes", "--appendfsync", "always"]).unwrap();
    let c = cache(
        Arc::new(tier(vec![r.url()], false, 2000)),
        RemoteOptions::default(),
    );
    let tok = tokens(8);
    let links = write(&c, &tok, 2);
    assert_eq!(c.fetch(&links, &tok).len(), 2);
    r.kill().unwrap();
    r.restart().unwrap();
    assert_eq!(c.fetch(&links, &tok).len(), 2, "{:?}", c.stats());
}

fn exists(r: &RedisServer, key: &str) -> bool {
    matches!(r.command(&["EXISTS", key]).unwrap(), redis::Value::Int(1))
}

/// A store restarted from its last snapshot (RDB, a stock redis.conf's
/// persistence) holds the marker but not the blocks written since: the
/// dropped connection (retried, so no call failed) makes the instance
/// forget what it believed stored, and those blocks are offered again
/// (the review of issue 42's fixes, R4).
#[test]
fn blocks_lost_in_a_restart_from_a_snapshot_are_offered_again() {
    let mut r = RedisServer::start(&[]).unwrap();
    let opts = RemoteOptions {
        probe_every: Duration::from_millis(50),
        ..RemoteOptions::default()
    };
    let a = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        opts,
    );
    let tok = tokens(16);
    let links = a.chain(&tok, &ExtraKeys::default());
    let offer = |i: usize| a.offer(links[i], &tok[i * 4..(i + 1) * 4], &payload(i));
    assert_eq!(offer(0), Offer::Queued);
    assert!(a.flush(Duration::from_secs(5)));
    std::thread::sleep(Duration::from_millis(200)); // the marker is written
    r.command(&["SAVE"]).unwrap(); // the snapshot: marker and block 0
    for i in 1..4 {
        assert_eq!(offer(i), Offer::Queued);
    }
    assert!(a.flush(Duration::from_secs(5)));
    assert!(exists(&r, &links[3].key.text()));
    r.kill().unwrap();
    r.restart().unwrap(); // loads the snapshot
    assert!(exists(&r, &links[0].key.text()));
    assert!(!exists(&r, &links[3].key.text()), "lost in the restart");
    // Let the writer meet the dropped connection and probe a few times.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(600) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = a.stats();
    assert!(
        (1..4).all(|i| a.wants(links[i].key)),
        "blocks the restarted store lost are still believed stored (not offered again): store_resets {}, errors_connection {}",
        st.store_resets,
        st.errors_connection
    );
}

/// A store-wide transient error answered per command (`-BUSY` while a
/// script runs past `busy-reply-threshold`; likewise `-LOADING`,
/// `-MASTERDOWN`) says nothing about the key: a miss and a store error,
/// never an invalid block, and no `DEL` of the valid blob (R3).
#[test]
fn a_transient_store_error_on_get_is_not_an_invalid_block() {
    let r = RedisServer::start(&[]).unwrap();
    let a = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    let tok = tokens(8);
    let links = a.chain(&tok, &ExtraKeys::default());
    for i in 0..2 {
        assert_eq!(
            a.offer(links[i], &tok[i * 4..(i + 1) * 4], &payload(i)),
            Offer::Queued
        );
    }
    assert!(a.flush(Duration::from_secs(5)));
    r.command(&["CONFIG", "SET", "busy-reply-threshold", "100"])
        .unwrap();
    let url = r.url();
    let script = std::thread::spawn(move || {
        let client = redis::Client::open(url).unwrap();
        let mut c = client.get_connection().unwrap();
        let _ = redis::cmd("EVAL")
            .arg("local i = 0 while true do i = i + 1 end")
            .arg(0)
            .query::<redis::Value>(&mut c);
    });
    std::thread::sleep(Duration::from_millis(400));
    let b = RemoteCache::new(
        Arc::new(tier(vec![r.url()], false, 2000)),
        scope(),
        secret(),
        RemoteOptions::default(),
    );
    let got = b.fetch(&links, &tok);
    let st = b.stats();
    // End the script.
    let t0 = Instant::now();
    while r.command(&["SCRIPT", "KILL"]).is_err() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    script.join().unwrap();
    assert!(b.flush(Duration::from_secs(5)));
    let dels = match r.command(&["INFO", "commandstats"]).unwrap() {
        redis::Value::BulkString(b) => String::from_utf8_lossy(&b)
            .lines()
            .find(|l| l.starts_with("cmdstat_del:"))
            .unwrap_or("")
            .to_string(),
        redis::Value::VerbatimString { text, .. } => text
            .lines()
            .find(|l| l.starts_with("cmdstat_del:"))
            .unwrap_or("")
            .to_string(),
        other => format!("{other:?}"),
    };
    assert!(
        got.is_empty(),
        "the store answered nothing during the script"
    );
    assert!(
        st.invalid_blocks == 0 && dels.is_empty(),
        "a valid block counted invalid during -BUSY (invalid_blocks {}, errors_store {}), and a DEL of it sent: {dels:?}",
        st.invalid_blocks,
        st.errors_store
    );
}
