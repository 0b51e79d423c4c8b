//! Block pool: allocate + release pairs, one and two threads.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use kvforge_bench::smollm2_layout;
use kvforge_pool::{Allocation, BlockAllocator, BlockPool, PoolConfig};

fn pool() -> BlockPool {
    BlockPool::new(smollm2_layout(16), PoolConfig::fixed(4096)).unwrap()
}

fn alloc_release(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu_pool");
    g.throughput(Throughput::Elements(1));
    let p = pool();
    let mut out = Allocation::default();
    g.bench_function("alloc_release_pair/1_thread", |b| {
        b.iter(|| {
            out.clear();
            assert!(p.allocate_into(1, &mut out));
            p.release(black_box(out.blocks[0])).unwrap();
        })
    });
    g.throughput(Throughput::Elements(64));
    g.bench_function("alloc_release_batch64/1_thread", |b| {
        b.iter(|| {
            out.clear();
            assert!(p.allocate_into(64, &mut out));
            for &id in out.blocks.iter().rev() {
                p.release(black_box(id)).unwrap();
            }
        })
    });
    // Two threads hammer one pool; the reported time is wall time per pair
    // in aggregate (wall / (2 x iters)), so lower is better as usual.
    g.throughput(Throughput::Elements(1));
    g.bench_function("alloc_release_pair/2_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| {
                        let mut out = Allocation::default();
                        for _ in 0..iters {
                            out.clear();
                            assert!(p.allocate_into(1, &mut out));
                            p.release(out.blocks[0]).unwrap();
                        }
                    });
                }
            });
            start.elapsed() / 2
        })
    });
    g.bench_function("retain_release_shared/2_threads", |b| {
        let shared = p.allocate(1).unwrap().blocks[0];
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| {
                        for _ in 0..iters {
                            let _ = p.retain(shared).unwrap();
                            p.release(shared).unwrap();
                        }
                    });
                }
            });
            start.elapsed() / 2
        });
        p.release(shared).unwrap();
    });
    g.finish();
}

criterion::criterion_group! {
    name = benches;
    config = super::config();
    targets = alloc_release
}
