//! TEMPORARY review scratch (to be deleted).
#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvforge_remote::{ErrorKind, ExtraKeys, Offer, RemoteCache, RemoteKey, RemoteOptions, RemoteTier, Scope, blob};
use kvforge_remote_redis::{RedisConfig, RedisServer, RedisTier};

fn tier(url: String, deadline_ms: u64, ttl: Option<Duration>) -> RedisTier {
    RedisTier::new(RedisConfig { urls: vec![url], cluster: false, ttl, deadline: Duration::from_millis(deadline_ms) }).unwrap()
}
fn scope(payload_bytes: u64) -> Scope {
    Scope { seed: 7, model: 0xabc, layers: 2, kv_heads: 2, head_dim: 8, block_size: 4, format: "f16".into(), payload_bytes }
}
fn tokens(n: usize) -> Vec<u32> { (0..n as u32).map(|t| 1000 + t * 3).collect() }

#[test]
fn r_wrongtype_in_the_middle_loses_the_valid_leading_blocks() {
    let r = RedisServer::start(&[]).unwrap();
    let s = scope(64);
    let c = RemoteCache::new(Arc::new(tier(r.url(), 2000, None)), s.clone(), RemoteOptions::default());
    let t = tokens(16);
    let links = c.chain(&t, &ExtraKeys::default());
    for i in 0..4 { assert_eq!(c.offer(links[i], &t[i*4..i*4+4], &vec![i as u8; 64]), Offer::Queued); }
    assert!(c.flush(Duration::from_secs(5)));
    r.command(&["DEL", &links[3].key.text()]).unwrap();
    r.command(&["LPUSH", &links[3].key.text(), "x"]).unwrap();
    let got = c.fetch(&links, &t);
    eprintln!("blocks 0..3 valid, block 3 a list: fetched {} (want 3); stats {:?}", got.len(), (c.stats().errors_store, c.stats().hit_blocks));
}

#[test]
fn r_connection_establishment_is_bounded() {
    for url in ["redis://10.255.255.1:6379", "redis://192.0.2.1:6379"] {
        let t = tier(url.into(), 200, None);
        let t0 = Instant::now();
        let e = t.get_many(&[RemoteKey(1)]).unwrap_err();
        eprintln!("{url}: first call {:?} {:?}", t0.elapsed(), e.kind);
        let t0 = Instant::now();
        let e = t.get_many(&[RemoteKey(1)]).unwrap_err();
        eprintln!("{url}: second call {:?} {:?}", t0.elapsed(), e.kind);
    }
}

#[test]
fn r_store_down_at_start_then_up() {
    let mut r = RedisServer::start(&[]).unwrap();
    r.kill().unwrap();
    let t = tier(r.url(), 200, None);
    for _ in 0..3 {
        let t0 = Instant::now();
        let e = t.get_many(&[RemoteKey(1)]).unwrap_err();
        eprintln!("down: {:?} {:?}", t0.elapsed(), e.kind);
    }
    r.restart().unwrap();
    let t0 = Instant::now();
    let mut fails = 0;
    loop {
        match t.get_many(&[RemoteKey(1)]) {
            Ok(_) => break,
            Err(e) => { fails += 1; if fails < 5 { eprintln!("after restart: {:?}", e); } }
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no recovery");
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("recovered after {:?}, {fails} failed calls", t0.elapsed());
}

#[test]
fn r_rediss_url() {
    let r = RedisTier::new(RedisConfig { urls: vec!["rediss://127.0.0.1:6379".into()], cluster: false, ttl: None, deadline: Duration::from_millis(100) });
    eprintln!("rediss: {:?}", r.as_ref().err());
}

#[test]
fn r_reads_wait_behind_a_large_write_batch() {
    let r = RedisServer::start(&[]).unwrap();
    let t = Arc::new(tier(r.url(), 1500, None));
    let small = RemoteKey(42);
    t.put_many(&[(small, b"x".to_vec())]).unwrap();
    let mut base = Duration::MAX;
    for _ in 0..5 { let t0 = Instant::now(); t.get_many(&[small]).unwrap(); base = base.min(t0.elapsed()); }
    let items: Vec<(RemoteKey, Vec<u8>)> = (0..32u128).map(|i| (RemoteKey(1000 + i), vec![i as u8; 4 << 20])).collect();
    let t2 = t.clone();
    let w = std::thread::spawn(move || { let t0 = Instant::now(); let r = t2.put_many(&items); (t0.elapsed(), r.map_err(|e| e.kind)) });
    std::thread::sleep(Duration::from_millis(5));
    let t0 = Instant::now();
    let g = t.get_many(&[small]);
    let got = t0.elapsed();
    let (wt, wr) = w.join().unwrap();
    eprintln!("GET alone {base:?}; GET during a 32 x 4 MiB put batch: {got:?} ({:?}); the batch took {wt:?} ({wr:?})", g.map(|v| v.len()).map_err(|e| e.kind));
}

#[test]
fn r_get_does_not_refresh_ttl_and_known_hides_the_expiry() {
    let r = RedisServer::start(&[]).unwrap();
    let ttl = Duration::from_millis(1500);
    let s = scope(64);
    let opts = RemoteOptions { remember_for: ttl / 2, ..RemoteOptions::default() }; // as server::connect does
    let a = RemoteCache::new(Arc::new(tier(r.url(), 2000, Some(ttl))), s.clone(), opts);
    let b = RemoteCache::new(Arc::new(tier(r.url(), 2000, Some(ttl))), s.clone(), opts);
    let t = tokens(8);
    let links = a.chain(&t, &ExtraKeys::default());
    for i in 0..2 { a.offer(links[i], &t[i*4..i*4+4], &vec![i as u8; 64]); }
    assert!(a.flush(Duration::from_secs(5)));
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1200));
    eprintln!("t={:?} B hits {}", t0.elapsed(), b.fetch(&links, &t).len());
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("t={:?} B hits {} (expired although read 0.5 s ago)", t0.elapsed(), b.fetch(&links, &t).len());
    eprintln!("B re-offers block 0 after computing it: {:?}", b.offer(links[0], &t[..4], &vec![0u8; 64]));
    let _ = blob::seal; let _ = ErrorKind::Timeout;
}
