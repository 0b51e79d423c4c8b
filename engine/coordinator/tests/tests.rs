//! `kvforge-coordinator`: plans, commits and aborts of every kind of
//! operation, prefix reuse over hot and cold blocks, turn rollback,
//! lifecycle, bad input, and many threads over one budget. No tensors.
#![allow(clippy::unwrap_used, clippy::single_range_in_vec_init)]

mod events;
mod import;
mod model;
mod regressions;
mod regressions_2;

use std::sync::{Arc, Mutex};

use kvforge_coordinator::{
    COLD, ColdConfig, Content, CoordError, Coordinator, CoordinatorConfig, DedupConfig,
    EvictionConfig, Grain, HOT, IndexKind, Lack, LifecycleConfig, Plan, Planned, PrefixConfig,
    Score, SeqId, SimHashConfig, Slot, TieredPool, Trigger,
};
use kvforge_pool::{BlockAllocator, BlockId, KvLayout, PoolStats, StorageFormat};
use kvforge_prefix::{ExtraKeys, MatchStats};

const BS: u32 = 4;

/// A plan that must fit: panics on an error or a shortfall.
pub(crate) trait Fits {
    fn fits(self) -> Plan;
}

impl Fits for kvforge_coordinator::Result<Planned> {
    #[track_caller]
    fn fits(self) -> Plan {
        match self {
            Ok(Planned::Step(p)) => p,
            Ok(Planned::Full(s)) => panic!("{s}"),
            Err(e) => panic!("{e}"),
        }
    }
}

/// A coordinator that checks every invariant after each public call.
pub(crate) fn checked(cfg: CoordinatorConfig) -> Coordinator {
    let mut c = Coordinator::new(cfg).unwrap();
    c.check_every_call(true);
    c
}

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, BS, StorageFormat::F16).unwrap()
}

fn cold() -> ColdConfig {
    ColdConfig {
        format: StorageFormat::Int4 { group_size: 8 },
        value_format: StorageFormat::Int4 { group_size: 8 },
        window: 8,
        sink: 4,
    }
}

fn config(blocks: usize) -> CoordinatorConfig {
    let mut c = CoordinatorConfig::new(layout(), blocks);
    c.prefix = Some(PrefixConfig {
        seed: Some(7),
        ..PrefixConfig::default()
    });
    c
}

fn all_on(blocks: usize) -> CoordinatorConfig {
    let mut c = config(blocks);
    c.cold = Some(cold());
    c.eviction = Some(EvictionConfig::SinkWindow {
        sink: 4,
        window: 16,
    });
    c.dedup = Some(DedupConfig::Exact);
    c
}

/// Everything an abort must leave as it was.
#[derive(Debug, PartialEq)]
struct State {
    tables: Vec<Vec<(Slot, u64, u32)>>,
    counts: Vec<(BlockId, u32)>,
    tiers: Vec<PoolStats>,
    index: Option<MatchStats>,
    bytes: u64,
}

fn state(c: &Coordinator, seqs: &[SeqId]) -> State {
    let mut counts = Vec::new();
    let tables = seqs
        .iter()
        .map(|&s| {
            let t = c.table(s).unwrap();
            for b in t.held() {
                counts.push((b, c.pools().ref_count(b).unwrap()));
            }
            t.entries()
                .iter()
                .map(|e| (e.slot(), e.first(), e.tokens()))
                .collect()
        })
        .collect();
    State {
        tables,
        counts,
        tiers: c.tier_stats().iter().map(|t| t.pool).collect(),
        index: c.index_stats().map(|mut s| {
            // Lookups count queries; an abort does not look anything up.
            s.queries = 0;
            s
        }),
        bytes: c.bytes_in_use(),
    }
}

fn bytes(b: &[u8]) -> Content {
    Content {
        bytes: b.to_vec(),
        vector: Vec::new(),
    }
}

fn step(c: &mut Coordinator, seq: SeqId, n: usize) -> kvforge_coordinator::Plan {
    let p = c.plan(seq, n).fits();
    c.commit(seq).unwrap();
    p
}

#[test]
fn a_step_allocates_fills_the_open_block_and_commits() {
    let mut c = checked(config(16));
    let s = c.open_empty();
    let p = step(&mut c, s, 6);
    assert_eq!(p.start, 0);
    assert_eq!(p.writes.len(), 2);
    assert_eq!((p.writes[1].offset, p.writes[1].tokens), (0, 2));
    let p = step(&mut c, s, 3);
    assert_eq!(p.start, 6);
    assert_eq!((p.writes[0].offset, p.writes[0].tokens), (2, 2));
    assert_eq!((p.writes[1].offset, p.writes[1].tokens), (0, 1));
    let t = c.table(s).unwrap();
    assert_eq!(t.positions(), 9);
    assert!(t.is_open());
    t.check().unwrap();
    c.close(s).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
}

#[test]
fn the_abort_of_every_kind_of_operation_leaves_everything_as_it_was() {
    let mut c = checked(all_on(64));
    let e = ExtraKeys::default();
    // A sequence long enough for demotions and drops, registered so that a
    // second one shares (and reuses the cold copies of) its blocks.
    let tokens: Vec<u32> = (0..40).collect();
    let a = c.open(&tokens, &e).unwrap().seq;
    step(&mut c, a, 30);
    step(&mut c, a, 1); // demotes
    c.register(a, &tokens[..31], &e).unwrap();
    let b = c.open(&tokens, &e).unwrap();
    assert!(b.reused > 0);
    let seqs = [a, b.seq];
    for (seq, n) in [(a, 1), (a, 9), (b.seq, 12), (b.seq, 1)] {
        let before = state(&c, &seqs);
        let p = c.plan(seq, n).fits();
        // Alias every freshly quantized block (exact sharing, as if the
        // engine found identical bytes).
        for d in p.demotions.iter().filter(|d| d.quantize) {
            let _ = c
                .share(seq, d.cold, &bytes(&[1, 2, 3]), &mut |_| {
                    Some(bytes(&[1, 2, 3]))
                })
                .unwrap();
        }
        c.abort(seq).unwrap();
        assert_eq!(state(&c, &seqs), before, "abort of {p:?}");
        step(&mut c, seq, n);
    }
    // The plans above covered every kind of operation.
    let mut c2 = checked(all_on(64));
    let s = c2.open_empty();
    step(&mut c2, s, 28);
    let p = c2.plan(s, 1).fits();
    assert!(!p.drops.is_empty() && !p.demotions.is_empty() && !p.writes.is_empty());
    c2.abort(s).unwrap();
    for s in seqs {
        c.close(s).unwrap();
    }
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn demotion_moves_full_blocks_out_of_the_window_and_keeps_the_sink() {
    let mut cfg = config(64);
    cfg.cold = Some(cold());
    let mut c = checked(cfg);
    let s = c.open_empty();
    step(&mut c, s, 22);
    let hot_before = c.tier_stats()[HOT].pool.in_use;
    let p = step(&mut c, s, 1);
    // 22 positions, sink 4 (entry 0), window 8: entries 1..=2 (4..12) go.
    assert_eq!(
        p.demotions.iter().map(|d| d.entry).collect::<Vec<_>>(),
        [1, 2]
    );
    assert!(p.demotions.iter().all(|d| d.quantize));
    let t = c.table(s).unwrap();
    assert!(matches!(t.entries()[0].slot(), Slot::Hot(_)));
    assert!(matches!(t.entries()[1].slot(), Slot::Cold(_)));
    assert_eq!(c.tier_stats()[HOT].pool.in_use, hot_before - 2);
    assert_eq!(c.tier_stats()[COLD].pool.in_use, 2);
    let cold_bytes = c.cold_layout().unwrap().block_bytes();
    assert_eq!(
        c.bytes_in_use(),
        c.tier_stats()[HOT].pool.in_use as u64 * layout().block_bytes() + 2 * cold_bytes
    );
    c.close(s).unwrap();
}

#[test]
fn a_quantized_prefix_is_matched_across_requests_and_counted_once() {
    let mut cfg = config(64);
    cfg.cold = Some(cold());
    let mut c = checked(cfg);
    let e = ExtraKeys::namespace("tenant");
    let tokens: Vec<u32> = (100..130).collect();
    // Request 1 prefills 24, registers, then decodes (its old blocks go cold
    // and the index follows them).
    let r1 = c.open(&tokens, &e).unwrap().seq;
    step(&mut c, r1, 24);
    c.register(r1, &tokens[..24], &e).unwrap();
    let p = step(&mut c, r1, 1);
    assert_eq!(p.demotions.len(), 3);
    let cold_ids: Vec<BlockId> = p.demotions.iter().map(|d| d.cold).collect();
    // Request 2 matches the prefix: the cold blocks themselves, as they are.
    let r2 = c.open(&tokens, &e).unwrap();
    assert_eq!(r2.reused, 24);
    let t2 = c.table(r2.seq).unwrap();
    let got: Vec<Slot> = t2.entries().iter().map(|x| x.slot()).collect();
    assert!(matches!(got[0], Slot::Hot(_)));
    assert_eq!(
        &got[1..4],
        &cold_ids.iter().map(|&b| Slot::Cold(b)).collect::<Vec<_>>()[..]
    );
    for &b in &cold_ids {
        assert_eq!(c.pools().ref_count(b).unwrap(), 2, "shared, not copied");
    }
    assert_eq!(c.tier_stats()[COLD].pool.in_use, 3, "bytes counted once");
    // Request 3 never saw the cold copies: it holds the hot blocks of
    // request 1 that it matched before the demotion, and when it demotes
    // them it reuses request 1's copies instead of quantizing again.
    c.close(r1).unwrap();
    c.close(r2.seq).unwrap();
    assert_eq!(c.tier_stats()[COLD].pool.cached_free, 3, "still matchable");
    let r4 = c.open(&tokens, &e).unwrap();
    assert_eq!(r4.reused, 24);
    c.close(r4.seq).unwrap();
}

#[test]
fn a_second_holder_reuses_the_cold_copy_instead_of_quantizing_again() {
    let mut cfg = config(64);
    cfg.cold = Some(cold());
    let mut c = checked(cfg);
    let e = ExtraKeys::default();
    let tokens: Vec<u32> = (0..40).collect();
    let a = c.open(&tokens, &e).unwrap().seq;
    step(&mut c, a, 16);
    c.register(a, &tokens[..16], &e).unwrap();
    let b = c.open(&tokens[..17], &e).unwrap();
    assert_eq!(b.reused, 16);
    // Both grow past the window; their shared blocks 1 and 2 go cold in
    // whichever sequence gets there first, and the other reuses the copy.
    let mut demotions = Vec::new();
    for (s, n) in [(b.seq, 1), (a, 4), (a, 1), (b.seq, 3), (b.seq, 1)] {
        demotions.extend(step(&mut c, s, n).demotions);
    }
    assert_eq!(demotions.len(), 4);
    for hot in [demotions[0].hot, demotions[1].hot] {
        let of: Vec<_> = demotions.iter().filter(|d| d.hot == hot).collect();
        assert_eq!(of.len(), 2);
        assert_eq!(of[0].cold, of[1].cold, "one cold copy");
        assert_eq!(
            of.iter().filter(|d| d.quantize).count(),
            1,
            "quantized once"
        );
    }
    assert_eq!(c.tier_stats()[COLD].pool.in_use, 2);
    c.close(a).unwrap();
    c.close(b.seq).unwrap();
}

#[test]
fn eviction_drops_entries_and_keeps_positions() {
    let mut cfg = config(64);
    cfg.eviction = Some(EvictionConfig::SinkWindow { sink: 4, window: 8 });
    let mut c = checked(cfg);
    let s = c.open_empty();
    step(&mut c, s, 20);
    let p = step(&mut c, s, 1);
    assert_eq!(p.drops, [1, 2]);
    let t = c.table(s).unwrap();
    assert_eq!(t.positions(), 21);
    assert_eq!(t.live_tokens(), 21 - 8);
    assert_eq!(t.entries()[1].slot(), Slot::Dropped);
    assert_eq!(t.entries()[1].tokens(), 8, "compacted into one entry");
    assert_eq!(t.entries()[2].first(), 12);
    let n = c.counters();
    assert_eq!((n.evicted_entries, n.steps, n.demoted_blocks), (2, 2, 0));
    // Registration stops at the first dropped entry.
    let tokens: Vec<u32> = (0..21).collect();
    assert_eq!(c.register(s, &tokens, &ExtraKeys::default()).unwrap(), 4);
    c.close(s).unwrap();
}

#[test]
fn scored_eviction_keeps_the_entry_attention_favours() {
    let mut cfg = config(64);
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::AttentionEma { decay: 0.5 },
        trigger: Trigger::Tokens(16),
        sink: 4,
        window: 4,
        per_head: false,
        per_token: false,
    });
    let mut c = checked(cfg);
    assert!(c.wants().attention);
    let s = c.open_empty();
    // 24 tokens: entries of 4 at 0, 4, …, 20; entry 2 (8..12) draws the
    // attention of each step. The second step already needs 8 tokens out
    // of 24 but only entry 1 (4..8) is outside the sink and the window.
    for n in [12, 12] {
        c.plan(s, n).fits();
        let k = c.view(s).unwrap().entries().len();
        let mass: Vec<f32> = (0..k).map(|i| if i == 2 { 9.0 } else { 1.0 }).collect();
        c.observe(s, &mass).unwrap();
        c.commit(s).unwrap();
    }
    // The next token makes 20 + 1 > 16: two more entries go, not the
    // heaviest (entry 2); sink (0) and window (5) stay.
    let p = step(&mut c, s, 1);
    assert_eq!(p.drops, [3, 4]);
    assert_eq!(c.counters().evicted_entries, 3);
    let t = c.table(s).unwrap();
    assert_eq!(t.live_tokens(), 13);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn keydiff_eviction_keeps_the_entry_whose_keys_stand_out() {
    let mut cfg = config(64);
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(16),
        sink: 4,
        window: 4,
        per_head: false,
        per_token: false,
    });
    let mut c = checked(cfg);
    assert!(c.wants().keys && !c.wants().attention);
    let s = c.open_empty();
    for n in [12, 12] {
        c.plan(s, n).fits();
        let k = c.view(s).unwrap().entries().len();
        let novelty: Vec<f32> = (0..k).map(|i| if i == 3 { 0.8 } else { 0.1 }).collect();
        // A signal for another number of entries is refused, changing nothing.
        assert!(c.observe_keys(s, &novelty[1..]).is_err());
        c.observe_keys(s, &novelty).unwrap();
        c.commit(s).unwrap();
    }
    // As with attention: two more entries go, not the one that stands out
    // (entry 3); the first step's evictions took entry 1.
    let p = step(&mut c, s, 1);
    assert_eq!(p.drops, [2, 4]);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

/// Per-head KeyDiff over `layout()`'s 4 lanes (2 layers × 2 KV heads),
/// after a first step of `first` tokens whose novelty makes lane `l` keep
/// entry `keeps[l]`.
fn per_head(sink: usize, budget: usize, first: usize, keeps: [usize; 4]) -> (Coordinator, SeqId) {
    per_head_in(config(64), sink, budget, first, keeps)
}

fn per_head_in(
    mut cfg: CoordinatorConfig,
    sink: usize,
    budget: usize,
    first: usize,
    keeps: [usize; 4],
) -> (Coordinator, SeqId) {
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(budget),
        sink,
        window: 4,
        per_head: true,
        per_token: false,
    });
    let mut c = checked(cfg);
    assert!(c.wants().grain == Grain::Lane && c.wants().keys);
    let s = c.open_empty();
    c.plan(s, first).fits();
    lane_novelty(&mut c, s, keeps);
    c.commit(s).unwrap();
    (c, s)
}

/// Feeds novelty per entry and lane: lane `l` finds entry `keeps[l]` the
/// most distinctive.
fn lane_novelty(c: &mut Coordinator, s: SeqId, keeps: [usize; 4]) {
    let k = c.view(s).unwrap().entries().len();
    let nv: Vec<f32> = (0..k * 4)
        .map(|x| if keeps[x % 4] == x / 4 { 0.9 } else { 0.1 })
        .collect();
    // One value per entry is not enough for a per-lane policy.
    assert!(c.observe_keys(s, &nv[..k]).is_err());
    c.observe_keys(s, &nv).unwrap();
}

/// 24 positions after two steps, entry 1 (4..8) evicted by every lane: 20
/// live. The next token needs 5 more out: 2 pages per lane among entries
/// 2, 3, 4 (whose blocks are returned); lane l keeps entry `[2, 3, 4, 2][l]`.
fn packing_case(cfg: CoordinatorConfig) -> (Coordinator, SeqId, Vec<BlockId>) {
    let (mut c, s) = per_head_in(cfg, 4, 16, 12, [0; 4]);
    c.plan(s, 12).fits();
    lane_novelty(&mut c, s, [2, 3, 4, 2]);
    c.commit(s).unwrap();
    let blocks: Vec<BlockId> = (2..5)
        .map(|i| c.table(s).unwrap().entries()[i].slot().block().unwrap())
        .collect();
    (c, s, blocks)
}

#[test]
fn per_head_eviction_packs_the_pages_each_lane_keeps_into_fewer_blocks() {
    let (mut c, s, blocks) = packing_case(config(64));
    let in_use = c.pools().stats().in_use;
    let before = state(&c, &[s]);
    c.plan(s, 1).fits();
    c.abort(s).unwrap();
    assert_eq!(state(&c, &[s]), before, "an aborted pack changes nothing");
    c.reset_step_peak();
    let p = c.plan(s, 1).fits();
    // Inside the step the old blocks are still held beside the packed one
    // and the new token's.
    let bb = layout().block_bytes();
    assert_eq!(c.step_peak_bytes(), (in_use as u64 + 2) * bb);
    let pack = p.pack.clone().unwrap();
    // One packed block: lane l reads the page of the entry it kept.
    assert_eq!(pack.lanes, 4);
    assert_eq!(pack.dst.len(), 1);
    assert_eq!(pack.src, [blocks[0], blocks[1], blocks[2], blocks[0]]);
    assert_eq!(p.drops, [3, 4]);
    c.commit(s).unwrap();
    let t = c.table(s).unwrap();
    t.check().unwrap();
    let e = t.entries()[2];
    assert!(e.is_packed() && e.slot() == Slot::Hot(pack.dst[0]));
    assert_eq!((e.first(), t.positions()), (8, 25));
    assert_eq!(t.live_tokens(), 13);
    // Three blocks went, one came, one opened for the new token.
    assert_eq!(c.pools().stats().in_use, in_use - 3 + 1 + 1);
    assert_eq!(c.bytes_in_use(), (in_use as u64 - 1) * bb);
    assert_eq!(
        c.step_peak_bytes(),
        (in_use as u64 + 2) * bb,
        "kept until reset"
    );
    assert_eq!(c.counters().packed_blocks, 1);
    for b in blocks {
        assert!(c.pools().ref_count(b).unwrap_or(0) == 0, "released");
    }
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

/// Without a prefix index and with no other holder, the union's own
/// blocks are permuted lane by lane: nothing is allocated, the dropped
/// pages end in the blocks that go.
#[test]
fn per_head_eviction_packs_in_place_when_no_one_else_sees_the_blocks() {
    let (mut c, s, blocks) = packing_case(CoordinatorConfig::new(layout(), 64));
    let (b2, b3, b4) = (blocks[0], blocks[1], blocks[2]);
    let in_use = c.pools().stats().in_use;
    let bb = layout().block_bytes();
    c.reset_step_peak();
    let p = c.plan(s, 1).fits();
    assert_eq!(
        c.step_peak_bytes(),
        (in_use as u64 + 1) * bb,
        "only the new token's block"
    );
    let pack = p.pack.clone().unwrap();
    assert!(pack.in_place);
    assert_eq!(pack.dst, blocks);
    // Lane l: its kept page first, then its dropped ones in order.
    #[rustfmt::skip]
    let want = [
        b2, b3, b4, b2,
        b3, b2, b2, b3,
        b4, b4, b3, b4,
    ];
    assert_eq!(pack.src, want);
    assert_eq!(p.drops, [3, 4]);
    c.commit(s).unwrap();
    let t = c.table(s).unwrap();
    t.check().unwrap();
    assert!(t.entries()[2].is_packed() && t.entries()[2].slot() == Slot::Hot(b2));
    assert_eq!(c.pools().stats().in_use, in_use - 2 + 1);
    assert_eq!(c.pools().ref_count(b2).unwrap(), 1);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn a_packed_block_is_never_registered_as_a_prefix() {
    // No sink: entry 0 is packed (lane 0 keeps it, the others entry 1).
    let (mut c, s) = per_head(0, 9, 12, [0, 1, 1, 1]);
    let p = c.plan(s, 1).fits();
    assert_eq!(p.drops, [1]);
    assert_eq!(p.pack.unwrap().dst.len(), 1);
    c.commit(s).unwrap();
    assert!(c.table(s).unwrap().entries()[0].is_packed());
    let tokens: Vec<u32> = (0..13).collect();
    assert_eq!(c.register(s, &tokens, &ExtraKeys::default()).unwrap(), 0);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn a_per_lane_answer_that_breaks_the_contract_is_refused_and_changes_nothing() {
    struct Bad(Vec<usize>);
    impl kvforge_evict::EvictionPolicy for Bad {
        fn name(&self) -> String {
            "bad".into()
        }
        fn per_lane(&self) -> bool {
            true
        }
        fn lane_victims(
            &mut self,
            _: u64,
            _: &kvforge_pool::BlockTable,
            _: kvforge_evict::Pressure,
            _: usize,
            out: &mut Vec<usize>,
        ) {
            out.extend_from_slice(&self.0);
        }
        fn victims(
            &mut self,
            _: u64,
            _: &kvforge_pool::BlockTable,
            _: kvforge_evict::Pressure,
            _: &mut Vec<usize>,
        ) {
        }
    }
    for (answer, msg) in [
        (vec![1, 2, 3], "not a multiple of 4 lanes"),
        (vec![1, 2, 2, 1, 1, 2, 1, 2], "out of order"),
        (vec![3, 3, 3, 3], "not a full, closed hot block"),
        (vec![9, 9, 9, 9], "not a full, closed hot block"),
    ] {
        let mut c = checked(config(64));
        let s = c.open_empty();
        step(&mut c, s, 14);
        c.set_eviction_policy(Some(Box::new(Bad(answer))));
        let before = state(&c, &[s]);
        let e = c.plan(s, 1).unwrap_err().to_string();
        assert!(e.contains(msg), "{e}");
        assert_eq!(state(&c, &[s]), before);
        c.close(s).unwrap();
    }
    let mut cfg = all_on(64);
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(64),
        sink: 4,
        window: 16,
        per_head: true,
        per_token: false,
    });
    let e = Coordinator::new(cfg).unwrap_err().to_string();
    assert!(e.contains("does not combine with a cold tier"), "{e}");
}

/// Token-level KeyDiff (sink 4, window 4, budget 18) after one step of
/// 24 tokens (entries 0..=5 of 4) whose novelty per row makes rows 0..=2
/// of entry 1, 1 and 3 of entry 2, 0 of entry 3 and 2 of entry 4 the
/// least distinctive: the next token needs 7 rows out.
fn token_case(mut cfg: CoordinatorConfig) -> (Coordinator, SeqId, Vec<BlockId>) {
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(18),
        sink: 4,
        window: 4,
        per_head: false,
        per_token: true,
    });
    let mut c = checked(cfg);
    assert!(c.wants().grain == Grain::Row && c.wants().keys);
    let s = c.open_empty();
    c.plan(s, 24).fits();
    let low = [(1, 0), (1, 1), (1, 2), (2, 1), (2, 3), (3, 0), (4, 2)];
    let nv: Vec<f32> = (0..6 * 4)
        .map(|x| {
            if low.contains(&(x / 4, x % 4)) {
                0.01 * x as f32
            } else {
                0.9
            }
        })
        .collect();
    // One value per entry is not enough for a token-level policy.
    assert!(c.observe_keys(s, &nv[..6]).is_err());
    c.observe_keys(s, &nv).unwrap();
    c.commit(s).unwrap();
    let blocks: Vec<BlockId> = (1..5)
        .map(|i| c.table(s).unwrap().entries()[i].slot().block().unwrap())
        .collect();
    (c, s, blocks)
}

/// Without an index, the holed blocks' rows are permuted where they are:
/// the 9 live rows of entries 1..=4 fill entries 1, 2 and 3 (the last with
/// 3 holes), entry 4 is dropped and its block comes back to the pool.
#[test]
fn token_level_eviction_marks_rows_and_compacts_them_into_fewer_blocks() {
    let (mut c, s, blocks) = token_case(CoordinatorConfig::new(layout(), 64));
    let (b1, b2, b3, b4) = (blocks[0], blocks[1], blocks[2], blocks[3]);
    let in_use = c.pools().stats().in_use;
    let before = state(&c, &[s]);
    c.plan(s, 1).fits();
    c.abort(s).unwrap();
    assert_eq!(
        state(&c, &[s]),
        before,
        "an aborted compaction changes nothing"
    );
    let p = c.plan(s, 1).fits();
    let rows = p.rows.clone().unwrap();
    assert!(rows.in_place && p.pack.is_none());
    assert_eq!(rows.dst, blocks);
    #[rustfmt::skip]
    let want = [
        (b1, 3), (b2, 0), (b2, 2), (b3, 1),
        (b3, 2), (b3, 3), (b4, 0), (b4, 1),
        (b4, 3), (b1, 0), (b1, 1), (b1, 2),
        (b2, 1), (b2, 3), (b3, 0), (b4, 2),
    ];
    assert_eq!(rows.src, want);
    assert_eq!(p.drops, [4]);
    c.commit(s).unwrap();
    let t = c.table(s).unwrap();
    t.check().unwrap();
    let e = t.entries();
    assert!(e[1].is_packed() && e[2].is_packed() && e[3].is_packed());
    assert_eq!((e[1].holes(), e[2].holes(), e[3].holes()), (0, 0, 0b1110));
    assert_eq!(e[4].slot(), Slot::Dropped);
    assert_eq!((t.live_tokens(), t.positions()), (18, 25));
    // One block back to the pool, one taken for the new token.
    assert_eq!(c.pools().stats().in_use, in_use);
    assert_eq!(c.pools().ref_count(b4).unwrap_or(0), 0, "released");
    let n = c.counters();
    assert_eq!((n.evicted_tokens, n.compacted_blocks), (7, 1));
    // A compacted block is never registered as a prefix.
    let tokens: Vec<u32> = (0..25).collect();
    assert_eq!(c.register(s, &tokens, &ExtraKeys::default()).unwrap(), 0);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

/// With a prefix index the rows are copied into fresh blocks, the holed
/// ones released.
#[test]
fn token_level_compaction_copies_when_an_index_could_see_the_blocks() {
    let (mut c, s, blocks) = token_case(config(64));
    let in_use = c.pools().stats().in_use;
    let p = c.plan(s, 1).fits();
    let rows = p.rows.clone().unwrap();
    assert!(!rows.in_place);
    assert_eq!(rows.dst.len(), 3);
    assert!(rows.dst.iter().all(|b| !blocks.contains(b)));
    assert_eq!(rows.src.len(), 12);
    assert_eq!(rows.src[..2], [(blocks[0], 3), (blocks[1], 0)]);
    c.commit(s).unwrap();
    c.table(s).unwrap().check().unwrap();
    // Four holed blocks went, three compacted ones and the new token's came.
    assert_eq!(c.pools().stats().in_use, in_use - 4 + 3 + 1);
    for b in blocks {
        assert_eq!(c.pools().ref_count(b).unwrap_or(0), 0);
    }
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn a_token_level_answer_that_breaks_the_contract_is_refused_and_changes_nothing() {
    struct Bad(Vec<(usize, u32)>);
    impl kvforge_evict::EvictionPolicy for Bad {
        fn name(&self) -> String {
            "bad".into()
        }
        fn token_level(&self) -> bool {
            true
        }
        fn token_victims(
            &mut self,
            _: u64,
            _: &kvforge_pool::BlockTable,
            _: kvforge_evict::Pressure,
            out: &mut Vec<(usize, u32)>,
        ) {
            out.extend_from_slice(&self.0);
        }
        fn victims(
            &mut self,
            _: u64,
            _: &kvforge_pool::BlockTable,
            _: kvforge_evict::Pressure,
            _: &mut Vec<usize>,
        ) {
        }
    }
    for (answer, msg) in [
        (vec![(2, 1), (1, 0)], "out of order"),
        (vec![(1, 0), (1, 0)], "out of order"),
        (vec![(1, 4)], "named row 4 of entry 1"),
        (vec![(3, 0)], "not a full, closed hot block"),
        (vec![(9, 0)], "entry 9 does not exist"),
    ] {
        let mut c = checked(config(64));
        let s = c.open_empty();
        step(&mut c, s, 14);
        c.set_eviction_policy(Some(Box::new(Bad(answer))));
        let before = state(&c, &[s]);
        let e = c.plan(s, 1).unwrap_err().to_string();
        assert!(e.contains(msg), "{e}");
        assert_eq!(state(&c, &[s]), before);
        c.close(s).unwrap();
    }
    // Every row of an entry: it is dropped, not holed.
    let mut c = checked(config(64));
    let s = c.open_empty();
    step(&mut c, s, 14);
    let all: Vec<(usize, u32)> = (0..4).map(|r| (1, r)).collect();
    c.set_eviction_policy(Some(Box::new(Bad(all))));
    assert_eq!(step(&mut c, s, 1).drops, [1]);
    c.close(s).unwrap();
    // The configurations token-level eviction refuses: the next test.
}

/// Each combination rule is one function: the configured policy is refused
/// in the words [`rules`] gives for the policy object, so a mechanisms
/// file, a CLI flag and a policy from Python all read the same.
#[test]
fn every_combination_rule_is_one_function_and_the_config_path_says_its_words() {
    use kvforge_coordinator::rules;
    let scored = |per_head, per_token| {
        let s = kvforge_evict::Scored::new(Score::KeyDiff, Trigger::Tokens(64), 4, 16).unwrap();
        rules::scored(s, per_head, per_token)
    };
    let with = |per_head, per_token, mut cfg: CoordinatorConfig| {
        cfg.dedup = None;
        cfg.eviction = Some(EvictionConfig::Scored {
            score: Score::KeyDiff,
            trigger: Trigger::Tokens(64),
            sink: 4,
            window: 16,
            per_head,
            per_token,
        });
        Coordinator::new(cfg).unwrap_err().to_string()
    };
    // 1: packing hot blocks beside a cold tier, per head and per token.
    for (h, t) in [(true, false), (false, true)] {
        let p = scored(h, t).unwrap();
        let want = rules::eviction_fits(p.as_ref(), 4, true).unwrap_err();
        assert!(want.contains("does not combine with a cold tier"), "{want}");
        assert!(with(h, t, all_on(64)).ends_with(&want), "{h} {t}");
        assert!(rules::eviction_fits(p.as_ref(), 4, false).is_ok());
    }
    // 2: token-level eviction over blocks too long to mark.
    let p = scored(false, true).unwrap();
    let bs = kvforge_pool::MAX_HOLED_BLOCK;
    assert!(rules::eviction_fits(p.as_ref(), bs, false).is_ok());
    let long = rules::eviction_fits(p.as_ref(), bs + 1, false).unwrap_err();
    assert!(
        long.contains(&format!("at most {bs} tokens, not {}", bs + 1)),
        "{long}"
    );
    let page = scored(false, false).unwrap();
    assert!(rules::eviction_fits(page.as_ref(), bs + 1, true).is_ok());
    // 3: per head and per token at once.
    let both = scored(true, true).err().unwrap();
    assert!(with(true, true, config(64)).ends_with(&both), "{both}");
    // 4: sharing without a cold tier, from the config and the setter.
    let want = rules::needs_cold_tier("sharing duplicate blocks", false).unwrap_err();
    let mut dedup = config(64);
    dedup.dedup = Some(DedupConfig::Exact);
    assert!(
        Coordinator::new(dedup)
            .unwrap_err()
            .to_string()
            .ends_with(&want)
    );
    let mut c = Coordinator::new(config(64)).unwrap();
    let d = Some(Box::new(kvforge_lsh::ExactDedup::new()) as Box<dyn kvforge_lsh::Deduplicator>);
    assert!(
        c.set_deduplicator(d)
            .unwrap_err()
            .to_string()
            .ends_with(&want)
    );
    assert!(rules::needs_cold_tier("sharing duplicate blocks", true).is_ok());
    // 5: an eviction window inside the cold tier's hot window.
    let want = rules::window_fits(4, cold().window).unwrap_err();
    let mut window = all_on(64);
    window.eviction = Some(EvictionConfig::SinkWindow { sink: 4, window: 4 });
    assert!(
        Coordinator::new(window)
            .unwrap_err()
            .to_string()
            .ends_with(&want)
    );
    assert!(rules::window_fits(cold().window, cold().window).is_ok());
}

#[test]
fn a_failed_turn_rolls_back_exactly_after_demotions_and_drops() {
    let mut c = checked(all_on(64));
    let s = c.open_empty();
    step(&mut c, s, 10);
    c.begin_turn(s).unwrap();
    step(&mut c, s, 2);
    c.end_turn(s).unwrap();
    let before = state(&c, &[s]);
    c.begin_turn(s).unwrap();
    for _ in 0..20 {
        step(&mut c, s, 1);
    }
    let t = c.table(s).unwrap();
    assert!(t.entries().iter().any(|e| e.slot() == Slot::Dropped));
    assert!(
        t.entries()
            .iter()
            .any(|e| matches!(e.slot(), Slot::Cold(_)))
    );
    assert!(c.counters().demoted_blocks > 0 && c.counters().evicted_entries > 0);
    c.plan(s, 1).fits(); // a step in flight when the turn fails
    c.rollback_turn(s).unwrap();
    assert_eq!(state(&c, &[s]), before);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn lifecycle_drops_old_turns_at_turn_end() {
    let mut cfg = config(64);
    cfg.lifecycle = Some(LifecycleConfig::RecentTurns { keep: 1 });
    let mut c = checked(cfg);
    let s = c.open_empty();
    for n in [8, 8, 8] {
        c.begin_turn(s).unwrap();
        step(&mut c, s, n);
        c.end_turn(s).unwrap();
    }
    let t = c.table(s).unwrap();
    // Turn 0 (0..8) and turn 2 (16..24) stay, turn 1 is dropped.
    let slots: Vec<(bool, u64)> = t
        .entries()
        .iter()
        .map(|e| (e.slot().is_live(), e.first()))
        .collect();
    assert_eq!(
        slots,
        [(true, 0), (true, 4), (false, 8), (true, 16), (true, 20)]
    );
    assert_eq!(c.counters().lifecycle_dropped_entries, 2);
    assert_eq!(c.counters().evicted_entries, 0);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

fn live_from(c: &Coordinator, s: SeqId) -> Vec<u64> {
    let t = c.table(s).unwrap();
    t.entries()
        .iter()
        .filter(|e| e.slot().is_live())
        .map(|e| e.first())
        .collect()
}

#[test]
fn model_labels_queue_revive_and_free_segments_and_compression_replaces_one() {
    use kvforge_coordinator::{Label, LabelSource, TurnInput};
    let mut cfg = config(64);
    cfg.lifecycle = Some(LifecycleConfig::Labels {
        source: LabelSource::Constrained,
        protect: 1,
        delay: 1,
        min_match: 3,
        compress_min: Some(4),
    });
    let mut c = checked(cfg);
    assert_eq!(c.lifecycle_source(), Some(LabelSource::Constrained));
    let s = c.open_empty();
    let tokens: Vec<u32> = (0..200).map(|i| 1000 + i).collect();
    // Turn 0 (0..8): the system prompt. Turn 1: 8..16 | 16..24 | 24..28
    // labelled drop / drop / compress.
    let turns: [(usize, Vec<u64>, Vec<Label>); 4] = [
        (8, vec![], vec![Label::Keep]),
        (
            20,
            vec![16, 24],
            vec![Label::Drop, Label::Drop, Label::Compress],
        ),
        (8, vec![], vec![Label::Keep]),
        (8, vec![], vec![Label::Keep]),
    ];
    let mut reports = Vec::new();
    for (n, cuts, model) in turns {
        c.begin_turn(s).unwrap();
        step(&mut c, s, n);
        let segs = c.turn_segments(s, &cuts).unwrap();
        assert_eq!(segs.len(), model.len());
        let t = TurnInput {
            cuts,
            tokens: tokens.clone(),
            stop: vec![],
            refer: None,
            model: Some(model),
        };
        reports.push(c.end_turn_labelled(s, &t).unwrap());
    }
    // Turn 1 left the protected round when turn 2 ended: 8..16 and 16..24
    // were queued, 24..28 handed out for summarising; K = 1 round later
    // turn 3's end frees the two.
    let o2 = &reports[2].outcome;
    assert_eq!((o2.queued, o2.revived, o2.reclaimed), (2, 0, 0));
    assert_eq!(o2.compress.len(), 1);
    assert_eq!(o2.compress[0].range, 24..28);
    let o3 = &reports[3].outcome;
    assert_eq!(o3.reclaim, vec![8..24]);
    assert_eq!(reports[3].dropped_entries, 4, "blocks 8, 12, 16, 20");
    assert_eq!(live_from(&c, s), [0, 4, 24, 28, 32, 36, 40]);
    let dropped = c.compressed(s, o2.compress[0].clone(), true).unwrap();
    assert_eq!(dropped, 1);
    assert_eq!(live_from(&c, s), [0, 4, 28, 32, 36, 40]);
    let k = c.counters();
    assert_eq!(
        (
            k.lifecycle_queued,
            k.lifecycle_reclaimed,
            k.lifecycle_compressed
        ),
        (2, 2, 1)
    );
    assert_eq!(k.lifecycle_dropped_entries, 5);
    assert_eq!(k.lifecycle_fallbacks, 0);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn a_pending_segment_a_later_turn_quotes_is_kept() {
    use kvforge_coordinator::{LabelSource, TurnInput};
    let mut cfg = config(64);
    cfg.lifecycle = Some(LifecycleConfig::Labels {
        source: LabelSource::Rule,
        protect: 1,
        delay: 2,
        min_match: 3,
        compress_min: None,
    });
    let mut c = checked(cfg);
    let s = c.open_empty();
    let mut tokens: Vec<u32> = (0..200).map(|i| 1000 + i).collect();
    // Turn 3 (positions 24..32) repeats positions 9..12 of turn 1.
    tokens[26..29].copy_from_slice(&[1009, 1010, 1011]);
    let mut revived = 0;
    for _ in 0..7 {
        c.begin_turn(s).unwrap();
        step(&mut c, s, 8);
        let t = TurnInput {
            tokens: tokens.clone(),
            stop: vec![7],
            ..TurnInput::default()
        };
        revived += c.end_turn_labelled(s, &t).unwrap().outcome.revived;
    }
    assert_eq!(revived, 1);
    // Turns 2 (16..24) and 3 (24..32) are freed two rounds after they were
    // dropped; turn 1 (8..16), revived, stays.
    assert_eq!(live_from(&c, s), [0, 4, 8, 12, 32, 36, 40, 44, 48, 52]);
    c.close(s).unwrap();
}

#[test]
fn a_block_between_two_turns_freed_at_different_ends_is_dropped() {
    let mut cfg = config(64);
    cfg.lifecycle = Some(LifecycleConfig::RecentTurns { keep: 1 });
    let mut c = checked(cfg);
    let s = c.open_empty();
    // Turns of 6 tokens over 4-token blocks: block 16..20 holds the end of
    // turn 2 and the start of turn 3, freed one turn end apart.
    for _ in 0..5 {
        c.begin_turn(s).unwrap();
        step(&mut c, s, 6);
        c.end_turn(s).unwrap();
    }
    // Turns 1..=3 (6..24) are gone: every block wholly inside, 16..20
    // included; 4..8 holds turn 0's end, 24..28 turn 4's start.
    assert_eq!(live_from(&c, s), [0, 4, 24, 28]);
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn a_fork_reads_the_same_blocks_and_writes_its_own() {
    let mut c = checked(config(64));
    let s = c.open_empty();
    step(&mut c, s, 10); // blocks 0..4, 4..8, 8..10 (open)
    let before = c.pools().stats().in_use;
    let f = c.fork(s).unwrap();
    assert_eq!(c.pools().stats().in_use, before, "nothing copied");
    let (ts, tf) = (c.table(s).unwrap().clone(), c.table(f).unwrap().clone());
    let blocks = |t: &kvforge_pool::BlockTable| t.held().collect::<Vec<_>>();
    assert_eq!(blocks(&ts), blocks(&tf));
    // The fork's first step copies the shared partial block.
    let p = step(&mut c, f, 3);
    assert!(!p.copies.is_empty(), "{p:?}");
    let tf = c.table(f).unwrap();
    assert_eq!(tf.positions(), 13);
    assert_ne!(tf.entries()[2].slot(), ts.entries()[2].slot());
    assert_eq!(tf.entries()[..2], ts.entries()[..2]);
    // The original goes on writing into its own open block.
    step(&mut c, s, 1);
    assert_eq!(c.table(s).unwrap().held().collect::<Vec<_>>(), blocks(&ts));
    c.plan(s, 1).fits();
    let e = c.fork(s).unwrap_err().to_string();
    assert!(e.contains("during a step"), "{e}");
    c.abort(s).unwrap();
    c.close(f).unwrap();
    c.close(s).unwrap();
    assert_eq!(c.pools().stats().in_use, 0);
}

#[test]
fn bad_configurations_and_calls_are_clear_errors_that_change_nothing() {
    let err = |cfg: CoordinatorConfig| Coordinator::new(cfg).unwrap_err().to_string();
    let mut tiny = config(64);
    tiny.budget_bytes = layout().block_bytes() - 1;
    assert!(err(tiny).contains("smaller than one block"), "budget");
    for (protect, compress_min, msg) in [(0, None, "protect"), (2, Some(0), "at least 1 token")] {
        let mut lc = config(64);
        lc.lifecycle = Some(LifecycleConfig::Labels {
            source: kvforge_coordinator::LabelSource::Free,
            protect,
            delay: 2,
            min_match: 6,
            compress_min,
        });
        assert!(err(lc).contains(msg), "lifecycle {msg}");
    }
    let mut dedup = config(64);
    dedup.dedup = Some(DedupConfig::Exact);
    assert!(err(dedup).contains("needs a cold tier"));
    let mut window = all_on(64);
    window.eviction = Some(EvictionConfig::SinkWindow { sink: 4, window: 4 });
    assert!(err(window).contains("at least as long"));
    let mut f16 = config(64);
    f16.cold = Some(ColdConfig {
        format: StorageFormat::F16,
        ..cold()
    });
    assert!(err(f16).contains("quantized format"));
    let mut uneven = config(64);
    uneven.cold = Some(ColdConfig {
        window: 6,
        ..cold()
    });
    assert!(err(uneven).contains("window"));
    assert!(err(CoordinatorConfig::new(layout(), 0)).contains("at least one block"));
    assert!("btree".parse::<IndexKind>().is_err());

    let mut c = checked(all_on(8));
    let s = c.open_empty();
    step(&mut c, s, 5);
    let before = state(&c, &[s]);
    for e in [
        c.plan(99, 1).unwrap_err(),
        c.commit(99).unwrap_err(),
        c.abort(99).unwrap_err(),
        c.close(99).unwrap_err(),
        c.commit(s).unwrap_err(),
        c.abort(s).unwrap_err(),
        c.rollback_turn(s).unwrap_err(),
        c.plan(s, 0).unwrap_err(),
    ] {
        assert!(!e.to_string().contains('\n'), "{e}");
    }
    assert!(matches!(c.plan(99, 1), Err(CoordError::UnknownSeq(99))));
    // Running out is an outcome, in numbers, and changes nothing either.
    match c.plan(s, 1000).unwrap() {
        Planned::Full(short) => {
            assert_eq!((short.seq, short.tokens), (s, 1000));
            assert!(matches!(short.lack, Lack::Bytes { need, budget } if need > budget));
            assert!(!short.to_string().contains('\n'), "{short}");
        }
        Planned::Step(p) => panic!("1000 tokens fit in 8 blocks: {p:?}"),
    }
    assert_eq!(state(&c, &[s]), before);
    c.plan(s, 1).fits();
    assert!(matches!(c.plan(s, 1), Err(CoordError::Order { .. })));
    assert!(
        c.share(s, BlockId::new(3, 1), &bytes(&[0]), &mut |_| Some(bytes(
            &[0]
        )))
        .is_err()
    );
    c.abort(s).unwrap();
    assert_eq!(state(&c, &[s]), before);
    c.close(s).unwrap();
}

#[test]
fn the_budget_covers_every_tier() {
    // Budget of 6 hot blocks, 64 hot blocks of tensors: the budget binds.
    let mut cfg = config(64);
    cfg.cold = Some(cold());
    cfg.budget_bytes = 6 * layout().block_bytes();
    let mut c = checked(cfg);
    let s = c.open_empty();
    step(&mut c, s, 20);
    let mut steps = 0;
    // Demotion frees hot bytes for cold ones (a quarter the size), so
    // the sequence runs past the 24 tokens six hot blocks hold.
    while let Planned::Step(_) = c.plan(s, 1).unwrap() {
        c.commit(s).unwrap();
        steps += 1;
        assert!(c.bytes_in_use() <= c.budget());
    }
    assert!(c.table(s).unwrap().positions() > 24, "{steps} steps");
    c.close(s).unwrap();
}

#[test]
fn many_threads_share_prefixes_over_one_budget_and_leak_nothing() {
    let c = Arc::new(Mutex::new(checked(all_on(256))));
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                let mut rng = t as u64 * 0x9E37_79B9 + 1;
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                for r in 0..150u32 {
                    let e = ExtraKeys::namespace(format!("ns{}", t % 2));
                    // A shared system prompt, then a private tail.
                    let mut tokens: Vec<u32> = (0..24).collect();
                    tokens.extend((0..(next() % 20) as u32).map(|i| 1000 * t + r + i));
                    let opened = c.lock().unwrap().open(&tokens, &e);
                    let Ok(o) = opened else { continue };
                    let mut held = o.reused;
                    let mut ok = true;
                    c.lock().unwrap().begin_turn(o.seq).unwrap();
                    while held < tokens.len() + 8 {
                        let n = if held < tokens.len() {
                            tokens.len() - held
                        } else {
                            1
                        };
                        let mut g = c.lock().unwrap();
                        match g.plan(o.seq, n) {
                            Ok(Planned::Step(p)) => {
                                for d in p.demotions.iter().filter(|d| d.quantize) {
                                    let b = bytes(&[d.hot.index() as u8; 4]);
                                    g.share(o.seq, d.cold, &b, &mut |_| {
                                        (next() % 2 == 0).then(|| b.clone())
                                    })
                                    .unwrap();
                                }
                                if next() % 10 == 0 {
                                    g.abort(o.seq).unwrap();
                                } else {
                                    g.commit(o.seq).unwrap();
                                    held += n;
                                }
                            }
                            Ok(Planned::Full(_)) => {
                                ok = false;
                                break;
                            }
                            Err(e) => panic!("{e}"),
                        }
                        drop(g);
                        // Bad requests between steps change nothing.
                        let mut g = c.lock().unwrap();
                        assert!(g.commit(o.seq).is_err());
                        assert!(g.plan(u64::MAX, 1).is_err());
                    }
                    let mut g = c.lock().unwrap();
                    if ok && next() % 3 != 0 {
                        g.end_turn(o.seq).unwrap();
                        let held_tokens: Vec<u32> = tokens.iter().copied().chain(0..8).collect();
                        g.register(o.seq, &held_tokens, &e).unwrap();
                    } else {
                        g.rollback_turn(o.seq).unwrap();
                    }
                    g.close(o.seq).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = c.lock().unwrap();
    assert_eq!(c.sequences(), 0);
    assert_eq!(c.pools().stats().in_use, 0, "leaked blocks");
    assert_eq!(c.bytes_in_use(), 0);
    assert!(
        c.index_stats().unwrap().hit_tokens > 0,
        "prefixes were shared"
    );
    let _ = TieredPool::tier_of(BlockId::new(0, 0));
}

#[test]
fn a_continued_partial_block_is_copied_not_sealed() {
    let mut c = checked(config(64));
    let e = ExtraKeys::default();
    let tokens: Vec<u32> = (0..40).collect();
    // A holds 10 tokens: two full blocks and an open one of 2.
    let a = c.open(&tokens[..10], &e).unwrap().seq;
    step(&mut c, a, 10);
    assert_eq!(c.register(a, &tokens[..10], &e).unwrap(), 10);
    assert!(c.table(a).unwrap().is_open(), "registered, not sealed");
    let a_tail = c.table(a).unwrap().held().last().unwrap();
    // B continues A's 10 tokens: it reuses all of them and copies the
    // partial block into a block of its own, which takes the new tokens.
    let b = c.open(&tokens[..14], &e).unwrap();
    assert_eq!(b.reused, 10);
    let before = state(&c, &[a, b.seq]);
    let p = c.plan(b.seq, 3).fits();
    assert_eq!(p.copies.len(), 1);
    let cp = p.copies[0];
    assert_eq!((cp.src, cp.tokens), (a_tail, 2));
    assert_eq!(p.writes[0].block, cp.dst);
    assert_eq!((p.writes[0].offset, p.writes[0].tokens), (2, 2));
    assert_eq!(p.writes[1].tokens, 1);
    c.abort(b.seq).unwrap();
    assert_eq!(state(&c, &[a, b.seq]), before, "abort of a copy");
    step(&mut c, b.seq, 3);
    let tb = c.table(b.seq).unwrap();
    assert!(!tb.held().any(|x| x == a_tail), "B let go of A's block");
    assert_eq!(tb.positions(), 13);
    assert_eq!(c.pools().ref_count(a_tail).unwrap(), 1, "A's own again");
    // A goes on filling its block and registers it again, longer: the
    // shorter entry gives way.
    step(&mut c, a, 4);
    assert_eq!(c.register(a, &tokens[..14], &e).unwrap(), 14);
    let m = c.open(&tokens[..15], &e).unwrap();
    assert_eq!(m.reused, 14);
    let tm = c.table(m.seq).unwrap();
    assert_eq!(tm.held().nth(2), Some(a_tail), "A's block, now full");
    for s in [a, b.seq, m.seq] {
        c.close(s).unwrap();
    }
    assert_eq!(c.pools().stats().in_use, 0);
    // With sealing instead, the partial block stays partial in A's table.
    let mut cfg = config(64);
    cfg.prefix.as_mut().unwrap().tail = kvforge_coordinator::TurnTail::Seal;
    let mut c = checked(cfg);
    let a = c.open_empty();
    step(&mut c, a, 10);
    c.register(a, &tokens[..10], &e).unwrap();
    let p = step(&mut c, a, 1);
    assert_eq!(p.writes[0].offset, 0, "a new block after the sealed one");
    c.close(a).unwrap();
}

#[test]
fn registering_a_turn_costs_its_new_tokens_not_the_conversation() {
    for index in [IndexKind::HashChain, IndexKind::Radix] {
        for tail in [
            kvforge_coordinator::TurnTail::Copy,
            kvforge_coordinator::TurnTail::Seal,
        ] {
            let mut cfg = config(1024);
            cfg.prefix = Some(PrefixConfig {
                index,
                seed: Some(1),
                tail,
            });
            cfg.cold = Some(cold());
            let mut c = checked(cfg);
            let e = ExtraKeys::default();
            let s = c.open_empty();
            let mut tokens: Vec<u32> = Vec::new();
            let mut costs = Vec::new();
            for turn in 0..30u32 {
                let n = 5 + (turn % 4) as usize;
                tokens.extend((0..n as u32).map(|i| turn * 100 + i));
                c.begin_turn(s).unwrap();
                step(&mut c, s, n);
                let before = c.index_stats().unwrap().insert_tokens;
                c.register(s, &tokens, &e).unwrap();
                c.end_turn(s).unwrap();
                costs.push(c.index_stats().unwrap().insert_tokens - before);
            }
            // Each turn costs its new tokens plus at most the partial block
            // registered again (under a block), however long the history.
            for (t, &cost) in costs.iter().enumerate().skip(1) {
                assert!(
                    cost <= 8 + BS as u64,
                    "{index:?} {tail:?} turn {t}: {cost} tokens"
                );
            }
            // And the index holds the whole conversation: a new request
            // reuses all of it (hot and cold blocks).
            let o = c.open(&[tokens.clone(), vec![1]].concat(), &e).unwrap();
            assert_eq!(o.reused, tokens.len(), "{index:?} {tail:?}");
            c.close(o.seq).unwrap();
            c.close(s).unwrap();
        }
    }
}

#[test]
fn a_policy_that_breaks_its_contract_is_an_error_that_changes_nothing() {
    use kvforge_evict::{EvictionPolicy, Pressure};
    use kvforge_pool::BlockTable;
    use kvforge_quant::TierPolicy;
    /// Names the open last entry (never demotable).
    struct OpenTail;
    impl TierPolicy for OpenTail {
        fn demote(&self, t: &BlockTable, out: &mut Vec<usize>) {
            out.push(t.entries().len() - 1);
        }
    }
    /// Names an entry that does not exist.
    struct Beyond;
    impl EvictionPolicy for Beyond {
        fn name(&self) -> String {
            "beyond".into()
        }
        fn victims(&mut self, _: u64, t: &BlockTable, _: Pressure, out: &mut Vec<usize>) {
            out.push(t.entries().len() + 3);
        }
    }
    let mut cfg = config(64);
    cfg.cold = Some(cold());
    let mut c = checked(cfg);
    let s = c.open_empty();
    step(&mut c, s, 30);
    let before = state(&c, &[s]);
    c.set_tier_policy(Box::new(OpenTail)).unwrap();
    let e = c.plan(s, 1).unwrap_err();
    assert!(matches!(e, CoordError::Policy(_)), "{e}");
    assert!(
        e.to_string().contains("not a full, closed hot block"),
        "{e}"
    );
    assert_eq!(state(&c, &[s]), before);
    c.set_tier_policy(Box::new(
        kvforge_quant::TierPlan::new(BS as usize, 8).unwrap(),
    ))
    .unwrap();
    c.set_eviction_policy(Some(Box::new(Beyond)));
    let e = c.plan(s, 1).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("policy: the eviction policy named entry"),
        "{e}"
    );
    assert_eq!(state(&c, &[s]), before);
    // A policy that could not answer (its Python code raised) names a
    // victim it means nothing by: the step fails with its words, the
    // victim unapplied.
    struct Raised;
    impl EvictionPolicy for Raised {
        fn name(&self) -> String {
            "raised".into()
        }
        fn victims(&mut self, _: u64, _: &BlockTable, _: Pressure, out: &mut Vec<usize>) {
            out.push(0);
        }
        fn take_error(&mut self) -> Option<String> {
            Some("ValueError: no".into())
        }
    }
    c.set_eviction_policy(Some(Box::new(Raised)));
    let e = c.plan(s, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "policy: the eviction policy raised failed: ValueError: no"
    );
    assert_eq!(state(&c, &[s]), before);
    c.set_eviction_policy(None);
    // The same for a tier policy that could not answer.
    struct Failed;
    impl TierPolicy for Failed {
        fn demote(&self, t: &BlockTable, out: &mut Vec<usize>) {
            out.push(t.entries().len() - 2);
        }
        fn take_error(&self) -> Option<String> {
            Some("TypeError: no".into())
        }
    }
    c.set_tier_policy(Box::new(Failed)).unwrap();
    let e = c.plan(s, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "policy: the tier policy failed: TypeError: no"
    );
    assert_eq!(state(&c, &[s]), before);
    c.set_tier_policy(Box::new(
        kvforge_quant::TierPlan::new(BS as usize, 8).unwrap(),
    ))
    .unwrap();
    step(&mut c, s, 1);
    c.close(s).unwrap();
    // No cold tier, no tier policy to set.
    let mut plain = checked(config(8));
    assert!(plain.set_tier_policy(Box::new(OpenTail)).is_err());
}

#[test]
fn near_duplicate_aliasing_racing_eviction_on_eight_threads_never_reads_a_freed_block() {
    let mut cfg = all_on(192);
    cfg.dedup = Some(DedupConfig::SimHash(SimHashConfig {
        threshold: 0.9,
        bits: 8,
        tables: 2,
        seed: 1,
    }));
    let c = Arc::new(Mutex::new(checked(cfg)));
    // Cold blocks' stored content, as the engine's cold tier keeps it: put
    // when a block is quantized, removed when the coordinator frees it.
    let store = Arc::new(Mutex::new(
        std::collections::BTreeMap::<BlockId, Content>::new(),
    ));
    let aliased = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let (c, store, aliased) = (Arc::clone(&c), Arc::clone(&store), Arc::clone(&aliased));
            std::thread::spawn(move || {
                let mut rng = u64::from(t) * 0x9E37_79B9 + 7;
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                for r in 0..40u32 {
                    let tokens: Vec<u32> = (0..8).map(|i| 10_000 * t + 100 * r + i).collect();
                    let o = c
                        .lock()
                        .unwrap()
                        .open(&tokens, &ExtraKeys::default())
                        .unwrap();
                    let mut held = o.reused;
                    while held < tokens.len() + 60 {
                        let n = if held < tokens.len() {
                            tokens.len() - held
                        } else {
                            1 + (next() % 4) as usize
                        };
                        let mut g = c.lock().unwrap();
                        let p = match g.plan(o.seq, n) {
                            Ok(Planned::Step(p)) => p,
                            Ok(Planned::Full(_)) => break,
                            Err(e) => panic!("{e}"),
                        };
                        for d in p.demotions.iter().filter(|d| d.quantize) {
                            // Four families of nearly equal vectors.
                            let family = next() % 4;
                            let vector: Vec<f32> = (0..64u64)
                                .map(|i| {
                                    let base = if (i * 7 + family * 13) % 5 < 2 {
                                        1.0
                                    } else {
                                        -1.0
                                    };
                                    base + (next() % 100) as f32 / 1000.0
                                })
                                .collect();
                            let content = Content {
                                bytes: Vec::new(),
                                vector,
                            };
                            let mut s = store.lock().unwrap();
                            let got = g
                                .share(o.seq, d.cold, &content, &mut |b| s.get(&b).cloned())
                                .unwrap();
                            match got {
                                Some(_) => {
                                    aliased.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                None => {
                                    s.insert(d.cold, content);
                                }
                            }
                        }
                        if next() % 8 == 0 {
                            g.abort(o.seq).unwrap();
                        } else {
                            g.commit(o.seq).unwrap();
                            held += n;
                        }
                        let mut s = store.lock().unwrap();
                        for b in g.take_freed_cold() {
                            s.remove(&b);
                        }
                        // Every alias of every live sequence reads a block
                        // that is held and still stored.
                        for e in g.table(o.seq).unwrap().entries() {
                            if let Slot::Alias { canonical } = e.slot() {
                                assert!(g.pools().ref_count(canonical).unwrap() > 0);
                                assert!(s.contains_key(&canonical), "{canonical:?} was freed");
                            }
                        }
                    }
                    let mut g = c.lock().unwrap();
                    g.close(o.seq).unwrap();
                    let mut s = store.lock().unwrap();
                    for b in g.take_freed_cold() {
                        s.remove(&b);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = c.lock().unwrap();
    assert_eq!(c.sequences(), 0);
    assert_eq!(c.pools().stats().in_use, 0, "leaked blocks");
    assert!(
        aliased.load(std::sync::atomic::Ordering::Relaxed) > 50,
        "near-duplicates were aliased"
    );
    let s = c.share_stats().unwrap();
    assert!(s.rejected > 0 || s.shared > 0, "{s:?}");
}

/// A step that does not fit the budget takes entries from idle sequences,
/// least recently stepped first; without an eviction policy it is refused.
#[test]
fn a_full_budget_takes_entries_from_idle_sequences() {
    let bb = layout().block_bytes();
    let build = |eviction: Option<EvictionConfig>| {
        let mut cfg = CoordinatorConfig::new(layout(), 64);
        cfg.budget_bytes = 10 * bb;
        cfg.eviction = eviction;
        checked(cfg)
    };
    let mut c = build(Some(EvictionConfig::Scored {
        score: Score::Lfu,
        trigger: Trigger::Watermark {
            high: 0.9,
            low: 0.5,
        },
        sink: 4,
        window: 4,
        per_head: false,
        per_token: false,
    }));
    let (a, idle, b) = (c.open_empty(), c.open_empty(), c.open_empty());
    step(&mut c, idle, 4); // stepped first: the least recent, but nothing to give
    step(&mut c, a, 28);
    assert_eq!(c.bytes_in_use(), 8 * bb);
    // b needs 4 blocks: 12 > 10. a (7 entries) gives up all it can outside
    // its sink and window: entries 1..=5.
    step(&mut c, b, 16);
    let t = c.table(a).unwrap();
    t.check().unwrap();
    assert_eq!(t.positions(), 28, "positions stay");
    assert_eq!(t.live_tokens(), 8);
    assert_eq!(c.counters().evicted_idle_entries, 5);
    assert_eq!(c.table(idle).unwrap().live_tokens(), 4);
    assert_eq!(c.bytes_in_use(), 7 * bb);
    for s in [a, idle, b] {
        c.close(s).unwrap();
    }
    assert_eq!(c.pools().stats().in_use, 0);

    // A policy that names an entry an idle table cannot drop: the step is
    // refused and the idle sequence is as it was.
    struct BadFor(u64);
    impl kvforge_evict::EvictionPolicy for BadFor {
        fn name(&self) -> String {
            "bad-for".into()
        }
        fn victims(
            &mut self,
            seq: u64,
            _: &kvforge_pool::BlockTable,
            _: kvforge_evict::Pressure,
            out: &mut Vec<usize>,
        ) {
            if seq == self.0 {
                out.extend([1, 99]);
            }
        }
    }
    let mut c = build(None);
    let (a, b) = (c.open_empty(), c.open_empty());
    step(&mut c, a, 28);
    c.set_eviction_policy(Some(Box::new(BadFor(a))));
    let before = state(&c, &[a, b]);
    let e = c.plan(b, 16).unwrap_err().to_string();
    assert!(e.contains("named entry 99"), "{e}");
    assert_eq!(state(&c, &[a, b]), before);

    // Without a policy the step is refused and nothing changes.
    let mut c = build(None);
    let (a, b) = (c.open_empty(), c.open_empty());
    step(&mut c, a, 28);
    let before = state(&c, &[a, b]);
    let Planned::Full(short) = c.plan(b, 16).unwrap() else {
        panic!("16 tokens fit beside 28 in 8 blocks");
    };
    assert!(short.to_string().contains("over the budget"), "{short}");
    assert_eq!(state(&c, &[a, b]), before);
}
