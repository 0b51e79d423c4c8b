//! The exposition `/metrics` answers, on fixed counters: every series
//! announced once with its help and type, counters named `_total`,
//! histogram buckets cumulative up to `+Inf` = `_count`.

use kvforge_coordinator::{Counters, MatchStats, ShareStats, TierStats};
use kvforge_pool::PoolStats;
use kvforge_remote::{Histogram, RemoteStats};

use super::*;

fn sample() -> (ServeMetrics, CacheStats) {
    let mut m = ServeMetrics {
        running: 2,
        waiting: 1,
        prompt_tokens: 120,
        generation_tokens: 40,
        prefix_queries: 120,
        prefix_hits: 64,
        preemptions: 1,
        steps: 50,
        ..ServeMetrics::default()
    };
    for v in [0.003, 0.05, 0.7, 500.0] {
        m.ttft.observe(v);
        m.e2e.observe(v * 2.0);
    }
    m.itl.observe(0.02);
    m.ended(Ended::Stop);
    m.ended(Ended::Length);
    m.ended(Ended::Aborted);
    let pool = |in_use: usize, bytes: u64| PoolStats {
        capacity: 64,
        in_use,
        cached_free: 3,
        in_use_bytes: bytes,
        ..PoolStats::default()
    };
    let cache = CacheStats {
        block_size: 16,
        budget_bytes: 1 << 20,
        bytes_in_use: 300_000,
        tiers: vec![
            TierStats {
                name: "hot",
                pool: pool(5, 250_000),
            },
            TierStats {
                name: "int4",
                pool: pool(7, 50_000),
            },
        ],
        index: Some(MatchStats {
            hit_blocks: 4,
            inserted_blocks: 9,
            ..MatchStats::default()
        }),
        sharing: Some(ShareStats {
            shared: 2,
            ..ShareStats::default()
        }),
        policies: Counters {
            evicted_entries: 6,
            demoted_blocks: 7,
            ..Counters::default()
        },
        remote: Some(RemoteStats {
            lookups: 3,
            hit_blocks: 5,
            errors_timeout: 1,
            get_latency: Histogram {
                bounds_us: vec![100, 1000],
                counts: vec![1, 2, 3],
                sum_us: 5000,
            },
            put_latency: Histogram {
                bounds_us: vec![100, 1000],
                counts: vec![0, 1, 0],
                sum_us: 300,
            },
            ..RemoteStats::default()
        }),
        watermark: None,
    };
    (m, cache)
}

#[test]
fn every_series_is_announced_once_counters_end_in_total_buckets_add_up() {
    let (m, cache) = sample();
    let text = render(&m, &cache, "my \"model\"");
    let mut announced = std::collections::BTreeMap::new();
    let mut lines = text.lines().peekable();
    while let Some(l) = lines.next() {
        if let Some(rest) = l.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default().to_string();
            let ty = lines.next().unwrap_or_default();
            let kind = ty
                .strip_prefix(&format!("# TYPE {name} "))
                .unwrap_or_else(|| panic!("no TYPE after HELP of {name}: {ty}"));
            assert!(
                announced.insert(name.clone(), kind.to_string()).is_none(),
                "{name} twice"
            );
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{name}");
            }
            let mut last = 0.0;
            while let Some(row) = lines.next_if(|r| !r.starts_with('#')) {
                assert!(row.starts_with(&name), "{row} under {name}");
                // Every row names the model first, escaped, then its own.
                let labels = &row[row.find('{').unwrap_or(row.len())..];
                assert!(
                    labels.starts_with("{model_name=\"my \\\"model\\\"\"")
                        && (labels.starts_with("{model_name=\"my \\\"model\\\"\"} ")
                            || labels.contains("\",")),
                    "{row}"
                );
                let v: f64 = row.rsplit(' ').next().unwrap_or_default().parse().unwrap();
                if kind == "histogram" && row.contains("_bucket") {
                    assert!(v >= last, "{row}: buckets are cumulative");
                    last = v;
                }
                if row.starts_with(&format!("{name}_count")) {
                    assert_eq!(v, last, "{name}: +Inf bucket = count");
                }
            }
        } else {
            panic!("a line outside any series: {l}");
        }
    }
    for name in [
        "kvforge:num_requests_running",
        "kvforge:kv_bytes_in_use",
        "kvforge:remote_errors_total",
        "kvforge:time_to_first_token_seconds",
        "kvforge:remote_lookup_seconds",
    ] {
        assert!(announced.contains_key(name), "{name} missing");
    }
    let m = "model_name=\"my \\\"model\\\"\"";
    for row in [
        format!("kvforge:kv_bytes_in_use{{{m},tier=\"int4\"}} 50000\n"),
        format!("kvforge:request_success_total{{{m},finished_reason=\"stop\"}} 1\n"),
        format!("kvforge:time_to_first_token_seconds_bucket{{{m},le=\"+Inf\"}} 4\n"),
        format!("kvforge:time_to_first_token_seconds_count{{{m}}} 4\n"),
        format!("kvforge:remote_lookup_seconds_bucket{{{m},le=\"0.001\"}} 3\n"),
    ] {
        assert!(text.contains(&row), "{row} not in\n{text}");
    }
}
