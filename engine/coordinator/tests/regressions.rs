//! One minimal reproduction per defect the adversarial review of
//! `004489b` demonstrated (issue 28), each asserting the correct
//! behaviour: a prefix hit never hands out another position's KV, no step
//! writes rows another holder reads, a reused cold copy holds the hot
//! block's content, the budget holds between steps, and every refused call
//! changes nothing.

use kvforge_coordinator::{
    COLD, ColdConfig, CoordError, Coordinator, CoordinatorConfig, EvictionConfig, HOT, Planned,
    PrefixConfig, Score, Slot, Trigger, TurnTail,
};
use kvforge_evict::Scored;
use kvforge_pool::{BlockAllocator, BlockTable, KvLayout, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_quant::TierPolicy;

use crate::{Fits, checked};

pub(crate) const BS: u32 = 4;

pub(crate) fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, BS, StorageFormat::F16).unwrap()
}

pub(crate) fn int4() -> StorageFormat {
    StorageFormat::Int4 { group_size: 8 }
}

pub(crate) fn cold(window: usize, sink: usize) -> ColdConfig {
    ColdConfig {
        format: int4(),
        value_format: int4(),
        window,
        sink,
    }
}

fn prefix(tail: TurnTail) -> PrefixConfig {
    PrefixConfig {
        seed: Some(7),
        tail,
        ..PrefixConfig::default()
    }
}

fn in_use(c: &Coordinator, tier: usize) -> usize {
    c.tier_stats()[tier].pool.in_use
}

/// A: a huge step size is a clean error, not a panic.
#[test]
fn a_plan_of_usize_max_tokens() {
    let mut c = Coordinator::new(CoordinatorConfig::new(layout(), 16)).unwrap();
    let s = c.open_empty();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.plan(s, usize::MAX)));
    match r {
        Ok(res) => println!("plan(usize::MAX) = {res:?}"),
        Err(_) => panic!("plan(seq, usize::MAX) panicked"),
    }
}

/// B: a prefix hit on cached cold blocks revives them without any budget
/// check: between steps, bytes in use exceed the budget.
#[test]
fn a_prefix_hit_on_cached_cold_blocks_goes_over_the_budget() {
    let mut cfg = CoordinatorConfig::new(layout(), 8);
    cfg.prefix = Some(prefix(TurnTail::Skip));
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let budget = c.budget();
    let hot_bytes = layout().block_bytes();
    // A: 6 full blocks + 1 token; 5 of them go cold after one more step.
    let prompt: Vec<u32> = (0..24).collect();
    let a = c.open(&prompt, &ExtraKeys::default()).unwrap().seq;
    c.plan(a, 24).fits();
    c.commit(a).unwrap();
    c.plan(a, 1).fits();
    c.commit(a).unwrap();
    assert!(in_use(&c, COLD) > 0);
    c.register(
        a,
        &[prompt.clone(), vec![99]].concat(),
        &ExtraKeys::default(),
    )
    .unwrap();
    c.close(a).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
    // B fills the whole hot tier: exactly the budget.
    let b = c.open_empty();
    c.plan(b, 8 * BS as usize).fits();
    c.commit(b).unwrap();
    assert_eq!(c.bytes_in_use(), budget);
    assert_eq!(c.bytes_in_use(), 8 * hot_bytes);
    // C opens with A's prompt: its cold blocks are revived.
    let o = c.open(&prompt, &ExtraKeys::default()).unwrap();
    println!(
        "reused {} tokens; bytes in use {} > budget {}",
        o.reused,
        c.bytes_in_use(),
        budget
    );
    assert!(
        c.bytes_in_use() <= budget,
        "between steps, bytes in use {} exceed the budget {budget}",
        c.bytes_in_use()
    );
}

/// C: a tier policy that names one entry twice is not refused: the hot
/// block is released twice at commit and one cold block leaks.
struct Twice;
impl TierPolicy for Twice {
    fn demote(&self, table: &BlockTable, out: &mut Vec<usize>) {
        if table.entries().len() >= 2 && !table.is_open() {
            out.push(0);
            out.push(0);
        }
    }
}

#[test]
fn a_tier_policy_naming_an_entry_twice_is_refused() {
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    c.set_tier_policy(Box::new(Twice)).unwrap();
    let a = c.open_empty();
    c.plan(a, 8).fits();
    c.commit(a).unwrap();
    // A fork holds entry 0's hot block too.
    let f = c.fork(a).unwrap();
    let h = c.table(a).unwrap().entries()[0].slot().block().unwrap();
    assert_eq!(c.pools().ref_count(h).unwrap(), 2);
    let r = c.plan(a, 4);
    println!("plan with a duplicate demotion: {r:?}");
    if !matches!(r, Ok(Planned::Step(_))) {
        return; // refused: fine
    }
    c.commit(a).unwrap();
    // The fork still lists h as its entry 0.
    assert_eq!(c.table(f).unwrap().entries()[0].slot(), Slot::Hot(h));
    let rc = c.pools().ref_count(h);
    println!("fork's block after the commit: ref count {rc:?}");
    let (ra, rf) = (c.close(a), c.close(f));
    println!(
        "close a: {ra:?}; close fork: {rf:?}; bytes in use after both closed: {} (cold in use {})",
        c.bytes_in_use(),
        in_use(&c, COLD)
    );
    assert_eq!(
        rc,
        Ok(1),
        "the fork's block was released by the other sequence"
    );
}

/// D: a token-level policy beside a cold tier (both public setters): a
/// holed entry the tier policy names passes the check, the plan allocates
/// the cold block, then fails at set_slot and leaks what it took.
#[test]
fn a_holed_entry_named_for_demotion_leaks_the_blocks_the_plan_took() {
    let mut cfg = CoordinatorConfig::new(layout(), 32);
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let p = Scored::new(Score::KeyDiff, Trigger::Tokens(18), 4, 8)
        .unwrap()
        .per_token()
        .unwrap();
    c.set_eviction_policy(Some(Box::new(p)));
    let s = c.open_empty();
    // 24 tokens: entries 0..6. Novelty low on a few rows of entries 1..4.
    c.plan(s, 24).fits();
    let low = [(1, 0), (2, 1), (3, 0), (3, 2)];
    let nv: Vec<f32> = (0..6 * 4)
        .map(|x| {
            if low.contains(&(x / 4, x % 4)) {
                0.01
            } else {
                0.9
            }
        })
        .collect();
    c.observe_keys(s, &nv).unwrap();
    c.commit(s).unwrap();
    let before_hot = in_use(&c, HOT);
    let before_cold = in_use(&c, COLD);
    let r = c.plan(s, 1);
    println!("plan: {r:?}");
    match r {
        Ok(Planned::Step(p)) => {
            println!("rows {:?} demotions {:?}", p.rows, p.demotions);
            c.abort(s).unwrap();
        }
        refused => {
            println!("refused: {refused:?}");
            let after = (in_use(&c, HOT), in_use(&c, COLD));
            c.close(s).unwrap();
            println!(
                "in use (hot, cold) before the plan {:?}, after the failed plan {after:?}; after close: {} bytes",
                (before_hot, before_cold),
                c.bytes_in_use()
            );
            assert_eq!(
                after,
                (before_hot, before_cold),
                "a failed plan leaked blocks"
            );
            return;
        }
    }
    let t = c.table(s).unwrap().clone();
    println!("table: {:?}", t.entries());
    c.close(s).unwrap();
    assert_eq!(
        c.bytes_in_use(),
        0,
        "blocks in use after every sequence closed"
    );
}

/// F: a plan refused (the cache full) after taking entries from idle
/// sequences leaves them dropped ("on error nothing changed").
#[test]
fn a_failed_plan_leaves_idle_sequences_evicted() {
    let mut cfg = CoordinatorConfig::new(layout(), 8);
    cfg.eviction = Some(EvictionConfig::SinkWindow { sink: 0, window: 4 });
    let mut c = checked(cfg);
    // Idle sequence i: 3 blocks (12 tokens), the first 2 outside its window
    // (SinkWindow drops them at its next step, or when another needs room).
    let i = c.open_empty();
    c.plan(i, 8).fits();
    c.commit(i).unwrap();
    let idle_before = c.table(i).unwrap().clone();
    // The stepping sequence asks for far more than the budget holds.
    let s = c.open_empty();
    let r = c.plan(s, 40);
    println!("plan: {r:?}");
    assert!(matches!(r, Ok(Planned::Full(_))));
    assert_eq!(
        c.table(i).unwrap(),
        &idle_before,
        "a failed plan dropped entries of an idle sequence"
    );
}

/// F2: a step that took entries from idle sequences to fit, then is
/// aborted, does not give them back (documented in `plan` and in
/// docs/architecture.md: the idle sequence's entries are gone, the
/// counters say so, and nothing leaks).
#[test]
fn an_aborted_plan_leaves_idle_sequences_evicted_as_documented() {
    let mut cfg = CoordinatorConfig::new(layout(), 8);
    cfg.eviction = Some(EvictionConfig::SinkWindow { sink: 0, window: 4 });
    let mut c = checked(cfg);
    let i = c.open_empty();
    c.plan(i, 16).fits();
    c.commit(i).unwrap();
    let idle_before = c.table(i).unwrap().clone();
    let s = c.open_empty();
    c.plan(s, 5 * BS as usize).fits();
    c.abort(s).unwrap();
    assert_ne!(c.table(i).unwrap(), &idle_before);
    assert!(c.counters().evicted_idle_entries > 0);
    c.table(i).unwrap().check().unwrap();
    c.close(i).unwrap();
    c.close(s).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
}

/// G: register with too few tokens under TurnTail::Seal is an error, but
/// it sealed the table first.
#[test]
fn a_refused_register_under_seal_changes_nothing() {
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.prefix = Some(prefix(TurnTail::Seal));
    let mut c = checked(cfg);
    let s = c.open_empty();
    c.plan(s, 6).fits();
    c.commit(s).unwrap();
    assert!(c.table(s).unwrap().is_open());
    let r = c.register(s, &[1, 2], &ExtraKeys::default());
    assert!(r.is_err());
    assert!(
        c.table(s).unwrap().is_open(),
        "the refused register sealed the table"
    );
}

/// E: the demotion map (hot block -> its cold copy) outlives a rolled-back
/// turn; the rolled-back open block is refilled with other tokens, and its
/// next demotion "reuses" the cold copy of the old content
/// (quantize: false).
#[test]
fn a_rolled_back_block_refilled_reuses_the_cold_copy_of_its_old_content() {
    let mut cfg = CoordinatorConfig::new(layout(), 32);
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let s = c.open_empty();
    c.plan(s, 2).fits(); // P: rows 0..2, open
    c.commit(s).unwrap();
    let p = c.table(s).unwrap().entries()[0].slot().block().unwrap();
    c.begin_turn(s).unwrap();
    c.plan(s, 6).fits(); // P rows 2..4 written with the turn's tokens
    c.commit(s).unwrap();
    let plan = c.plan(s, 1).fits(); // P leaves the window: quantized
    assert_eq!(plan.demotions.len(), 1);
    let d = plan.demotions[0];
    assert!(d.hot == p && d.quantize);
    let stale = d.cold;
    c.commit(s).unwrap();
    let f = c.fork(s).unwrap(); // keeps the cold copy alive (e.g. a labelling fork)
    c.rollback_turn(s).unwrap();
    assert_eq!(c.table(s).unwrap().entries()[0].slot(), Slot::Hot(p));
    assert_eq!(c.table(s).unwrap().entries()[0].tokens(), 2);
    // The next turn writes other tokens into rows 2..4 of P.
    c.plan(s, 6).fits();
    c.commit(s).unwrap();
    let plan = c.plan(s, 1).fits();
    let d = plan.demotions[0];
    println!("second demotion of P: {d:?} (stale cold copy {stale:?})");
    assert!(
        d.quantize || d.cold != stale,
        "P's new content is 'demoted' to the cold copy of its rolled-back content"
    );
    c.commit(s).unwrap();
    c.close(f).unwrap();
    c.close(s).unwrap();
}

/// H: near-duplicate sharing (SimHash) leaks into the prefix index: an
/// index entry of a demoted hot block is relocated to the *canonical* block
/// of another sequence's content, so a prefix hit hands out KV of other
/// tokens; a second holder of the hot block gets the canonical as a plain
/// Cold entry (not an Alias), which registration does not stop at.
#[test]
fn a_near_duplicate_canonical_is_handed_out_as_a_prefix_hit() {
    use kvforge_coordinator::{Content, DedupConfig, SimHashConfig};
    let mut cfg = CoordinatorConfig::new(layout(), 64);
    cfg.prefix = Some(prefix(TurnTail::Skip));
    cfg.cold = Some(cold(4, 0));
    cfg.dedup = Some(DedupConfig::SimHash(SimHashConfig {
        threshold: 0.9,
        ..SimHashConfig::default()
    }));
    let mut c = checked(cfg);
    let ns = ExtraKeys::default();
    let vec_of = |seed: f32| Content {
        bytes: vec![seed as u8],
        vector: (0..64)
            .map(|i| 1.0 + 0.01 * seed * (i as f32).sin())
            .collect(),
    };
    let mut stored: std::collections::HashMap<kvforge_pool::BlockId, Content> =
        std::collections::HashMap::new();
    // Z: tokens 1000.. ; its block 0 goes cold and becomes a candidate.
    let z_tokens: Vec<u32> = (1000..1009).collect();
    let z = c.open(&z_tokens, &ns).unwrap().seq;
    c.plan(z, 9).fits();
    c.commit(z).unwrap();
    let plan = c.plan(z, 1).fits();
    let cz = plan.demotions[0].cold;
    stored.insert(cz, vec_of(1.0));
    let got = c
        .share(z, cz, &vec_of(1.0), &mut |b| stored.get(&b).cloned())
        .unwrap();
    assert_eq!(got, None);
    c.commit(z).unwrap();
    // X: tokens 0..9, registered while hot; Y opens with X's prefix (holds H0).
    let x_tokens: Vec<u32> = (0..9).collect();
    let x = c.open(&x_tokens, &ns).unwrap().seq;
    c.plan(x, 9).fits();
    c.commit(x).unwrap();
    c.register(x, &x_tokens, &ns).unwrap();
    let h0 = c.table(x).unwrap().entries()[0].slot().block().unwrap();
    let y = c.open(&x_tokens, &ns).unwrap();
    assert_eq!(c.table(y.seq).unwrap().entries()[0].slot(), Slot::Hot(h0));
    // X's block 0 goes cold; its content is close to Z's: aliased to cz.
    let plan = c.plan(x, 1).fits();
    let cx = plan.demotions[0].cold;
    stored.insert(cx, vec_of(2.0));
    let got = c
        .share(x, cx, &vec_of(2.0), &mut |b| stored.get(&b).cloned())
        .unwrap();
    assert_eq!(got, Some(cz));
    c.commit(x).unwrap();
    assert_eq!(
        c.table(x).unwrap().entries()[0].slot(),
        Slot::Alias { canonical: cz }
    );
    // W asks for X's tokens: what does the index hand out for positions 0..4?
    let w = c.open(&x_tokens, &ns).unwrap();
    let first = c.table(w.seq).unwrap().entries()[0].slot();
    println!(
        "W reused {} tokens, entry 0 = {first:?}; Z's block = {cz:?}",
        w.reused
    );
    // Y's own demotion of H0 (the shared hot block).
    c.plan(y.seq, 9 - y.reused).fits();
    c.commit(y.seq).unwrap();
    let plan = c.plan(y.seq, 1).fits();
    println!("Y's demotions: {:?}", plan.demotions);
    c.commit(y.seq).unwrap();
    let y0 = c.table(y.seq).unwrap().entries()[0].slot();
    println!("Y entry 0 = {y0:?}");
    assert_ne!(
        first,
        Slot::Cold(cz),
        "a prefix hit for tokens 0..4 handed out Z's block (tokens 1000..1004)"
    );
    assert_ne!(
        y0,
        Slot::Cold(cz),
        "Y holds the canonical as a plain cold entry"
    );
}

/// B2: a plan counts the hot blocks it demotes as freed; a prefix hit of
/// another sequence between the plan and its commit keeps them held, and
/// the commit leaves the bytes in use over the budget.
#[test]
fn a_prefix_hit_between_plan_and_commit_goes_over_the_budget() {
    let mut cfg = CoordinatorConfig::new(layout(), 4);
    cfg.prefix = Some(prefix(TurnTail::Skip));
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let ns = ExtraKeys::default();
    let toks: Vec<u32> = (0..12).collect();
    let a = c.open(&toks, &ns).unwrap().seq;
    c.plan(a, 12).fits();
    c.commit(a).unwrap();
    c.register(a, &toks, &ns).unwrap();
    // a's next token: entries 0 and 1 go cold (their hot blocks counted freed).
    let p = c.plan(a, 1).fits();
    assert_eq!(p.demotions.len(), 2);
    // Another request arrives while a's step is in flight.
    let b = c.open(&[toks.clone(), vec![77]].concat(), &ns).unwrap();
    // (The fix: the match is cut where keeping the blocks a's step frees
    // would go over the budget.)
    assert!(b.reused > 0 && b.reused < 12, "reused {}", b.reused);
    c.commit(a).unwrap();
    println!("bytes in use {} budget {}", c.bytes_in_use(), c.budget());
    assert!(
        c.bytes_in_use() <= c.budget(),
        "between steps, bytes in use {} exceed the budget {}",
        c.bytes_in_use(),
        c.budget()
    );
}

/// I: rollback_turn on a sequence with a step in flight but no turn
/// returns an error, after aborting the step.
#[test]
fn a_refused_rollback_changes_nothing() {
    let mut c = Coordinator::new(CoordinatorConfig::new(layout(), 16)).unwrap();
    let s = c.open_empty();
    c.plan(s, 5).fits();
    let r = c.rollback_turn(s);
    assert!(matches!(r, Err(CoordError::Order { .. })), "{r:?}");
    assert!(
        c.commit(s).is_ok(),
        "the refused rollback aborted the step in flight (commit now fails)"
    );
}

/// J: a fork taken during a turn reads the open block as the turn filled
/// it; rollback_turn gives the sequence back that block, open, and its
/// next step writes over rows the fork reads.
#[test]
fn after_a_rollback_the_sequence_writes_into_rows_a_fork_reads() {
    let mut c = Coordinator::new(CoordinatorConfig::new(layout(), 16)).unwrap();
    let s = c.open_empty();
    c.plan(s, 1).fits(); // P: 1 token, open
    c.commit(s).unwrap();
    let p = c.table(s).unwrap().entries()[0].slot().block().unwrap();
    c.begin_turn(s).unwrap();
    c.plan(s, 3).fits(); // P rows 1..4: the turn's tokens
    c.commit(s).unwrap();
    let f = c.fork(s).unwrap();
    assert_eq!(c.table(f).unwrap().entries()[0].slot(), Slot::Hot(p));
    assert_eq!(c.table(f).unwrap().entries()[0].tokens(), 4);
    c.rollback_turn(s).unwrap();
    let plan = c.plan(s, 1).fits();
    println!(
        "after the rollback: {:?}; the fork reads rows 0..4 of {p:?}",
        plan.writes
    );
    let w = plan.writes[0];
    assert!(
        !(w.block == p && w.offset < 4),
        "the step writes row {} of {p:?}, which the fork reads",
        w.offset
    );
}

/// J2: the same through the prefix index: a register during the turn,
/// another request's hit on the full block, then a rollback.
#[test]
fn after_a_rollback_the_sequence_writes_into_rows_a_prefix_hit_reads() {
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.prefix = Some(prefix(TurnTail::Skip));
    let mut c = checked(cfg);
    let ns = ExtraKeys::default();
    let s = c.open_empty();
    c.plan(s, 1).fits();
    c.commit(s).unwrap();
    let p = c.table(s).unwrap().entries()[0].slot().block().unwrap();
    c.begin_turn(s).unwrap();
    c.plan(s, 3).fits();
    c.commit(s).unwrap();
    c.register(s, &[1, 2, 3, 4], &ns).unwrap();
    let b = c.open(&[1, 2, 3, 4, 5], &ns).unwrap();
    assert_eq!(b.reused, 4);
    assert_eq!(c.table(b.seq).unwrap().entries()[0].slot(), Slot::Hot(p));
    c.rollback_turn(s).unwrap();
    let plan = c.plan(s, 1).fits();
    let w = plan.writes[0];
    assert!(
        !(w.block == p && w.offset < 4),
        "the step writes row {} of {p:?}, which another request's prefix hit reads",
        w.offset
    );
}

/// E2: the same stale cold copy without a fork or a register: the cold
/// copy made during the failed turn is kept alive by another sequence's
/// alias to it (exact sharing), and the rolled-back block, refilled with
/// other tokens, is "demoted" to it.
#[test]
fn a_rolled_back_block_refilled_reuses_a_cold_copy_kept_alive_by_an_alias() {
    use kvforge_coordinator::{Content, DedupConfig};
    let mut cfg = CoordinatorConfig::new(layout(), 32);
    cfg.cold = Some(cold(4, 0));
    cfg.dedup = Some(DedupConfig::Exact);
    let mut c = checked(cfg);
    let mut stored: std::collections::HashMap<kvforge_pool::BlockId, Content> =
        std::collections::HashMap::new();
    let content = |tag: u8| Content {
        bytes: vec![tag; 16],
        vector: Vec::new(),
    };
    // S1: P holds 2 tokens when its turn begins.
    let s1 = c.open_empty();
    c.plan(s1, 2).fits();
    c.commit(s1).unwrap();
    let p = c.table(s1).unwrap().entries()[0].slot().block().unwrap();
    c.begin_turn(s1).unwrap();
    c.plan(s1, 6).fits(); // P rows 2..4 hold the turn's tokens ("old")
    c.commit(s1).unwrap();
    let plan = c.plan(s1, 1).fits();
    let old_copy = plan.demotions[0].cold;
    assert_eq!(plan.demotions[0].hot, p);
    stored.insert(old_copy, content(1));
    let got = c
        .share(s1, old_copy, &content(1), &mut |b| stored.get(&b).cloned())
        .unwrap();
    assert_eq!(got, None); // a candidate now
    c.commit(s1).unwrap();
    // S2 computed the same tokens: its block quantizes to the same bytes.
    let s2 = c.open_empty();
    c.plan(s2, 8).fits();
    c.commit(s2).unwrap();
    let plan = c.plan(s2, 1).fits();
    let mine = plan.demotions[0].cold;
    stored.insert(mine, content(1));
    let got = c
        .share(s2, mine, &content(1), &mut |b| stored.get(&b).cloned())
        .unwrap();
    assert_eq!(got, Some(old_copy));
    c.commit(s2).unwrap();
    // S1's turn fails (e.g. the cache filled up later in the turn).
    c.rollback_turn(s1).unwrap();
    assert_eq!(c.table(s1).unwrap().entries()[0].tokens(), 2);
    // The next turn writes other tokens into rows 2..4 of P.
    c.begin_turn(s1).unwrap();
    c.plan(s1, 6).fits();
    c.commit(s1).unwrap();
    let plan = c.plan(s1, 1).fits();
    let d = plan.demotions[0];
    println!("second demotion of P: {d:?}; cold copy of the rolled-back content: {old_copy:?}");
    assert!(
        d.quantize || d.cold != old_copy,
        "P's new content is read from the cold copy of its rolled-back content"
    );
}

/// E3: a per-lane policy beside a cold tier (public setters; the code
/// anticipates it): a block packed in place keeps its demotion-map entry,
/// so its next demotion reuses the cold copy of its unpacked content.
#[test]
fn a_block_packed_in_place_reuses_the_cold_copy_of_its_old_content() {
    let mut cfg = CoordinatorConfig::new(layout(), 64);
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let per_head = || {
        Box::new(
            Scored::new(Score::KeyDiff, Trigger::Tokens(16), 0, 4)
                .unwrap()
                .per_head()
                .unwrap(),
        )
    };
    let a = c.open_empty();
    c.set_eviction_policy(None);
    c.plan(a, 20).fits();
    c.commit(a).unwrap();
    let f = c.fork(a).unwrap();
    // a's entries 0..4 go cold: the demotion map remembers X_i -> C_i.
    let plan = c.plan(a, 1).fits();
    let made: Vec<(kvforge_pool::BlockId, kvforge_pool::BlockId)> =
        plan.demotions.iter().map(|d| (d.hot, d.cold)).collect();
    println!("a's demotions: {made:?}");
    c.commit(a).unwrap();
    // f packs pages of those hot blocks in place (no index, f holds them alone).
    c.set_eviction_policy(Some(per_head()));
    // Lane l finds entries l and l+1 (mod 4) the most distinctive.
    let k = c.table(f).unwrap().entries().len();
    let nv: Vec<f32> = (0..k * 4)
        .map(|x| {
            let (e, l) = (x / 4, x % 4);
            if e == l || e == (l + 1) % 4 {
                0.9
            } else {
                0.1 + 0.01 * e as f32
            }
        })
        .collect();
    c.observe_keys(f, &nv).unwrap();
    let plan = c.plan(f, 1).fits();
    println!("f's pack: {:?}; demotions {:?}", plan.pack, plan.demotions);
    let packed: Vec<kvforge_pool::BlockId> = plan
        .pack
        .as_ref()
        .filter(|p| p.in_place)
        .map(|p| p.dst.clone())
        .unwrap_or_default();
    c.commit(f).unwrap();
    let plan = c.plan(f, 1).fits();
    println!("f's next demotions: {:?}", plan.demotions);
    for d in &plan.demotions {
        if packed.contains(&d.hot) {
            assert!(
                d.quantize,
                "{:?} was packed in place, yet its demotion reuses {:?}, the copy of its unpacked content",
                d.hot, d.cold
            );
        }
    }
    assert!(
        !packed.is_empty(),
        "no in-place pack happened (scenario did not trigger)"
    );
}

/// K: registration stops at the first dropped entry ("the KV after it was
/// not computed over the plain prefix"), but not at a holed one: blocks
/// computed while token-level eviction hid rows of an earlier block are
/// registered and handed out as the plain prefix's KV.
#[test]
fn blocks_computed_after_token_level_holes_are_registered_as_the_plain_prefix() {
    let mut cfg = CoordinatorConfig::new(layout(), 64);
    cfg.prefix = Some(prefix(TurnTail::Skip));
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::KeyDiff,
        trigger: Trigger::Tokens(22),
        sink: 4,
        window: 4,
        per_head: false,
        per_token: true,
    });
    let mut c = checked(cfg);
    let ns = ExtraKeys::default();
    let toks: Vec<u32> = (0..32).collect();
    let s = c.open(&toks[..24], &ns).unwrap().seq;
    c.plan(s, 24).fits();
    let nv: Vec<f32> = (0..6 * 4)
        .map(|x| {
            if [(1, 0), (1, 1), (2, 3)].contains(&(x / 4, x % 4)) {
                0.01
            } else {
                0.9
            }
        })
        .collect();
    c.observe_keys(s, &nv).unwrap();
    c.commit(s).unwrap();
    // Token 24: 25 live > 22: three rows of entries 1 and 2 become holes.
    let p = c.plan(s, 1).fits();
    assert!(p.rows.is_none() && p.drops.is_empty());
    c.commit(s).unwrap();
    let holed: Vec<usize> = (0..c.table(s).unwrap().entries().len())
        .filter(|&i| c.table(s).unwrap().entries()[i].holes() != 0)
        .collect();
    println!("holed entries: {holed:?}");
    assert!(!holed.is_empty());
    // Tokens 25..32 are computed with those rows invisible.
    c.set_eviction_policy(None);
    c.plan(s, 7).fits();
    c.commit(s).unwrap();
    let registered = c.register(s, &toks, &ns).unwrap();
    let o = c.open(&[toks.clone(), vec![99]].concat(), &ns).unwrap();
    println!(
        "registered {registered} tokens; a new request reuses {}",
        o.reused
    );
    assert!(
        o.reused <= 4 * holed[0] + 4,
        "the new request reuses KV of positions 24..{} that was computed while rows of entry {} were evicted",
        o.reused,
        holed[0]
    );
}

/// L: a fork registers the partial block it shares with its source (3
/// tokens); the source, which went on filling that block, registers its
/// table: the insertion stops at the shared block (indexed elsewhere), yet
/// `indexed` counts it, so the source's next registration *extends below
/// the fork's 3-token entry* with the source's tokens from position 8:
/// the index now says block Q holds position 7, but Q holds position 8.
#[test]
fn a_registration_extends_below_another_sequences_entry_of_a_shared_block() {
    let mut c = checked(config_prefix(TurnTail::Copy));
    let ns = ExtraKeys::default();
    let toks: Vec<u32> = (0..9).collect();
    let a = c.open_empty();
    c.plan(a, 7).fits(); // X = 0..4, P = 4..7 (open)
    c.commit(a).unwrap();
    let p = c.table(a).unwrap().entries()[1].slot().block().unwrap();
    let f = c.fork(a).unwrap(); // f: X, P (3 tokens, sealed)
    assert_eq!(c.register(f, &toks[..7], &ns).unwrap(), 7);
    c.plan(a, 2).fits(); // P row 3 = token 7, Q row 0 = token 8 (open)
    c.commit(a).unwrap();
    let q = c.table(a).unwrap().entries()[2].slot().block().unwrap();
    c.register(a, &toks, &ns).unwrap(); // stops at P (indexed by f)
    c.register(a, &toks, &ns).unwrap(); // extends below "P" -- f's entry
    // A request whose 8th token is a's 9th: [0..7) then 8.
    let b = c.open(&[0, 1, 2, 3, 4, 5, 6, 8, 99], &ns).unwrap();
    let t = c.table(b.seq).unwrap();
    println!(
        "b reused {}: {:?}",
        b.reused,
        t.entries()
            .iter()
            .map(|e| (e.slot(), e.first(), e.tokens()))
            .collect::<Vec<_>>()
    );
    assert_eq!(t.entries()[1].slot(), Slot::Hot(p));
    assert!(
        !t.entries().iter().any(|e| e.slot() == Slot::Hot(q)),
        "b reads {q:?} (a's KV of token 8 at position 8) as its position 7"
    );
}

fn config_prefix(tail: TurnTail) -> CoordinatorConfig {
    let mut cfg = CoordinatorConfig::new(layout(), 32);
    cfg.prefix = Some(prefix(tail));
    cfg
}

/// Drops every live entry of one sequence but its last (for idle cuts).
struct DropAllOf(u64);

impl kvforge_evict::EvictionPolicy for DropAllOf {
    fn name(&self) -> String {
        "drop-all-of".into()
    }
    fn victims(
        &mut self,
        seq: u64,
        table: &BlockTable,
        _p: kvforge_evict::Pressure,
        out: &mut Vec<usize>,
    ) {
        if seq != self.0 {
            return;
        }
        let n = table.entries().len();
        out.extend((0..n.saturating_sub(1)).filter(|&i| table.entries()[i].slot().is_live()));
    }
}

/// M (found by the model's 10^5-case run): a step reuses another holder's
/// cold copy of a hot block it demotes, and only fits by cutting idle
/// sequences; the cut drops the copy's only holder. The plan must not count
/// the copy as freed (it keeps it), and must not take a copy that is gone.
#[test]
fn an_idle_cut_does_not_free_the_cold_copy_the_step_reuses() {
    let hot = layout().block_bytes();
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.budget_bytes = 5 * hot;
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    // A computes 3 blocks; B and D read them too.
    let a = c.open_empty();
    c.plan(a, 12).fits();
    c.commit(a).unwrap();
    let b = c.fork(a).unwrap();
    let d = c.fork(a).unwrap();
    // A's next token: its blocks 0 and 1 go cold (C0, C1, held by A only).
    let p = c.plan(a, 1).fits();
    assert_eq!(p.demotions.len(), 2);
    let copies: Vec<_> = p.demotions.iter().map(|d| d.cold).collect();
    c.commit(a).unwrap();
    let a_before = c.table(a).unwrap().clone();
    // B's step reuses C0 and C1 and only fits if idle A gives up entries:
    // the policy would cut all of A, C0 and C1 included.
    c.set_eviction_policy(Some(Box::new(DropAllOf(a))));
    match c.plan(b, 1).unwrap() {
        Planned::Step(p) => {
            assert!(
                p.demotions
                    .iter()
                    .all(|d| copies.contains(&d.cold) || d.quantize)
            );
            c.commit(b).unwrap();
            assert!(c.bytes_in_use() <= c.budget());
        }
        Planned::Full(_) => {
            assert_eq!(c.table(a).unwrap(), &a_before, "a refused plan cut nothing");
        }
    }
    for &cc in &copies {
        assert!(c.pools().ref_count(cc).unwrap() >= 1, "{cc:?} still held");
    }
    for s in [a, b, d] {
        c.close(s).unwrap();
    }
    assert_eq!(c.bytes_in_use(), 0);
}

/// B3 (found by the model's 10^5-case run): a prefix hit revives cached
/// blocks while another sequence's step that frees blocks is in flight;
/// that step is then aborted and frees nothing. The hit may only take what
/// fits however the step ends.
#[test]
fn a_prefix_hit_during_a_step_that_is_aborted_stays_within_the_budget() {
    let hot = layout().block_bytes();
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.budget_bytes = 5 * hot;
    cfg.prefix = Some(prefix(TurnTail::Skip));
    cfg.cold = Some(cold(4, 0));
    let mut c = checked(cfg);
    let ns = ExtraKeys::default();
    // X leaves three cached cold blocks behind (positions 0..12).
    let xt: Vec<u32> = (0..17).collect();
    let x = c.open(&xt, &ns).unwrap().seq;
    c.plan(x, 16).fits();
    c.commit(x).unwrap();
    c.register(x, &xt[..16], &ns).unwrap();
    assert_eq!(c.plan(x, 1).fits().demotions.len(), 3);
    c.commit(x).unwrap();
    c.close(x).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
    // A holds four hot blocks; its next step drops three of them.
    let a = c.open_empty();
    c.plan(a, 16).fits();
    c.commit(a).unwrap();
    c.set_eviction_policy(Some(Box::new(
        kvforge_evict::SinkWindow::new(0, 4).unwrap(),
    )));
    let p = c.plan(a, 1).fits();
    assert_eq!(p.drops.len(), 3);
    // B asks for X's prompt while A's step is in flight; then A's step fails.
    let b = c.open(&[xt.clone(), vec![99]].concat(), &ns).unwrap();
    c.abort(a).unwrap();
    assert!(
        c.bytes_in_use() <= c.budget(),
        "B reused {}: {} bytes in use over the budget of {}",
        b.reused,
        c.bytes_in_use(),
        c.budget()
    );
    assert!(b.reused > 0, "what fits is still reused");
    c.close(a).unwrap();
    c.close(b.seq).unwrap();
}
