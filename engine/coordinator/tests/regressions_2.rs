//! One minimal reproduction per defect the second adversarial review of
//! the coordinator (at `d047843`) demonstrated, each asserting the correct
//! behaviour: a cold slot reported freed is never handed out again before
//! the engine takes the report (within one step or across calls), an
//! import cut short ends there (nothing lands at another block's
//! positions), and a policy failing on an idle sequence fails that
//! sequence's own step; plus the probes of that review that held, and
//! the defects a review of those fixes found (a hot allocation withdrawing
//! a cold block's report; a replaced policy's stored failure).

use std::collections::HashMap;
use std::sync::Mutex;

use kvforge_coordinator::{
    COLD, CoordError, Coordinator, CoordinatorConfig, EvictionConfig, HOT, Plan, Planned,
    PrefixConfig, Score, SeqId, Slot, TieredPool, Trigger, TurnTail,
};
use kvforge_evict::{EvictionPolicy, Pressure};
use kvforge_pool::{BlockId, BlockTable};
use kvforge_prefix::ExtraKeys;
use kvforge_quant::TierPolicy;

use crate::Fits;
use crate::regressions::{BS, cold, int4, layout};

fn hot_bytes() -> u64 {
    layout().block_bytes()
}

fn cold_bytes() -> u64 {
    layout()
        .with_kv_formats(int4(), int4())
        .unwrap()
        .block_bytes()
}

/// What the engine's cold tier does (engine/src/tier/mod.rs): a block's
/// content is stored *by slot* (`ColdTier::put`), and what
/// `take_freed_cold` reports is freed *by slot* (`ColdTier::free`, called
/// by `PagedKvCache::free_cold` after commit, abort, close and turn ends —
/// not after a plan).
#[derive(Default)]
struct EngineColdStore(HashMap<u32, BlockId>);

impl EngineColdStore {
    fn put(&mut self, b: BlockId) {
        self.0.insert(TieredPool::slot_of(b), b);
    }
    fn free_cold(&mut self, c: &mut Coordinator) {
        for b in c.take_freed_cold() {
            self.0.remove(&TieredPool::slot_of(b));
        }
    }
    fn holds(&self, b: BlockId) -> bool {
        self.0.get(&TieredPool::slot_of(b)) == Some(&b)
    }
    /// Every cold block any table lists has its content stored.
    fn check(&self, c: &Coordinator, seqs: &[SeqId]) -> Result<(), String> {
        for &s in seqs {
            for (i, e) in c.view(s).unwrap().entries().iter().enumerate() {
                if let Slot::Cold(b) | Slot::Alias { canonical: b } = e.slot() {
                    if !self.holds(b) {
                        return Err(format!(
                            "seq {s} entry {i} reads {b:?}, whose stored content the engine freed (slot {} now {:?})",
                            TieredPool::slot_of(b),
                            self.0.get(&TieredPool::slot_of(b))
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// A step as `PagedSeq::prepare` + `commit` carry it out: plan, quantize
/// the demoted blocks (put by slot), commit, free what was reported freed.
fn engine_step(c: &mut Coordinator, st: &mut EngineColdStore, s: SeqId, n: usize) -> Plan {
    let p = c.plan(s, n).fits();
    for d in p.demotions.iter().filter(|d| d.quantize) {
        st.put(d.cold);
    }
    c.commit(s).unwrap();
    st.free_cold(c);
    p
}

/// Cold tier (window 4, no sink) beside page eviction that acts only when
/// the budget is full (a watermark at 100%): a sequence's own steps evict
/// nothing; another's step that does not fit takes entries of idle ones.
fn idle_cut_config(budget: u64, low: f64) -> CoordinatorConfig {
    let mut cfg = CoordinatorConfig::new(layout(), 16);
    cfg.budget_bytes = budget;
    cfg.cold = Some(cold(4, 0));
    cfg.eviction = Some(EvictionConfig::Scored {
        score: Score::Lfu,
        trigger: Trigger::Watermark { high: 1.0, low },
        sink: 0,
        window: 4,
        per_head: false,
        per_token: false,
    });
    cfg
}

/// S holds two full hot blocks; idle I four cold and two hot ones, under
/// a budget that S's next step (a demotion and one hot block) fits only by
/// cutting I's oldest cold entries.
fn stepping_and_idle() -> (Coordinator, EngineColdStore, SeqId, SeqId) {
    let (h, k) = (hot_bytes(), cold_bytes());
    let mut c = Coordinator::new(idle_cut_config(4 * h + 5 * k - 1, 0.9)).unwrap();
    c.check_every_call(true);
    let mut st = EngineColdStore::default();
    let s = c.open_empty();
    engine_step(&mut c, &mut st, s, 8);
    let i = c.open_empty();
    for _ in 0..6 {
        engine_step(&mut c, &mut st, i, 4);
    }
    (c, st, s, i)
}

/// The eviction of `idle_cut_config`, on its own.
fn lfu() -> kvforge_evict::Scored {
    kvforge_evict::Scored::new(
        Score::Lfu,
        Trigger::Watermark {
            high: 1.0,
            low: 0.9,
        },
        0,
        4,
    )
    .unwrap()
}

/// Finding 1 (wrong KV / storage freed under a reader). A plan that only fits by
/// cutting an idle sequence's cold entries releases their blocks (reported
/// by `take_freed_cold`), then allocates the step's fresh cold copy — which
/// the pool hands out in the slot just freed (LIFO free list). The engine
/// puts the step's quantized block there, commits, and frees what was
/// reported: by slot, so the *new* block's content goes. Every later step
/// of that sequence reads a cold block without content.
#[test]
fn a_cold_slot_reported_freed_is_not_handed_out_again_before_the_report_is_taken() {
    let (h, k) = (hot_bytes(), cold_bytes());
    let (mut c, mut st, s, i) = stepping_and_idle();
    assert_eq!(c.bytes_in_use(), 4 * h + 4 * k);
    // S's next step demotes its block 0 and needs one hot block: it fits
    // only by cutting idle I's oldest cold entries.
    let p = c.plan(s, 4).fits();
    assert!(c.counters().evicted_idle_entries > 0, "idle cut");
    let fresh = p.demotions.iter().find(|d| d.quantize).unwrap().cold;
    // What the coordinator reports freed right after the plan, as the
    // engine would see it at its next drain:
    let freed = c.take_freed_cold();
    let same_slot: Vec<_> = freed
        .iter()
        .filter(|f| TieredPool::slot_of(**f) == TieredPool::slot_of(fresh))
        .collect();
    println!("fresh cold copy {fresh:?}; reported freed {freed:?}");
    // Put the reports back the way the engine would meet them (it drains
    // after the commit), and carry the step out.
    for d in p.demotions.iter().filter(|d| d.quantize) {
        st.put(d.cold);
    }
    c.commit(s).unwrap();
    for b in &freed {
        st.0.remove(&TieredPool::slot_of(*b));
    }
    st.free_cold(&mut c);
    let r = st.check(&c, &[s, i]);
    assert!(
        same_slot.is_empty() && r.is_ok(),
        "a block reported freed shares its slot with the step's fresh cold copy {fresh:?}: {same_slot:?}; {}",
        r.err().unwrap_or_default()
    );
}

/// Finding 1b: the same across calls. A plan's idle cut reports cold blocks
/// freed; before its commit (when the engine drains the report) another
/// call — here an import of remote cold blocks, as
/// `PagedKvCache::import_fetched` does for a request opened meanwhile —
/// allocates one of those slots and fills it. The drain after the first
/// step's commit frees the imported block's content.
#[test]
fn a_cold_slot_freed_by_an_idle_cut_is_not_imported_into_before_the_report_is_taken() {
    let (h, k) = (hot_bytes(), cold_bytes());
    let mut c = Coordinator::new(idle_cut_config(3 * h + 4 * k - 1, 0.5)).unwrap();
    c.check_every_call(true);
    let mut st = EngineColdStore::default();
    let i = c.open_empty();
    for _ in 0..6 {
        engine_step(&mut c, &mut st, i, 4); // 4 cold + 2 hot blocks
    }
    let s = c.open_empty();
    let _p = c.plan(s, 4).fits(); // fits by cutting I
    assert!(c.counters().evicted_idle_entries > 0, "idle cut");
    // A request opened meanwhile imports one remote cold block and fills it.
    let t = c.open_empty();
    let got = c.import(t, COLD, 0, 1).unwrap();
    assert_eq!(got.len(), 1);
    st.put(got[0]);
    // The first step ends; the engine frees what was reported.
    c.commit(s).unwrap();
    st.free_cold(&mut c);
    let r = st.check(&c, &[s, i, t]);
    assert!(r.is_ok(), "{}", r.unwrap_err());
}

/// A stand-in for the remote tier of engine/src/cache/remote.rs: block
/// `k` of a prompt has payload `k`.
#[derive(Default)]
struct Contents(HashMap<BlockId, usize>);

/// `RemoteLookup::fetch` + `PagedKvCache::import_fetched` (engine/src/cache/remote.rs) transcribed
/// onto the coordinator: the full blocks after the local hit, in runs that
/// travel alike (the sink's blocks hot, the rest cold in cold mode), each
/// run cut to `import_room` before it is fetched; a run that imports fewer
/// blocks than the whole run (cut by room included) ends the import.
fn import_remote_as_the_engine_does(
    c: &mut Coordinator,
    st: &mut Contents,
    id: SeqId,
    len: &mut usize,
    tokens: &[u32],
    hot_blocks: usize,
) {
    let bs = BS as usize;
    let full = tokens.len().saturating_sub(1) / bs;
    if *len % bs != 0 || *len / bs >= full {
        return;
    }
    let range = *len / bs..full;
    let cut = hot_blocks.clamp(range.start, range.end);
    let runs: Vec<(usize, std::ops::Range<usize>)> =
        [(HOT, range.start..cut), (COLD, cut..range.end)]
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .collect();
    let mut added = 0;
    for (tier, run) in runs {
        let room = c.import_room(id, tier);
        let asked = run.start..run.end.min(run.start + room);
        // `cache.fetch`: every block of the run is in the store.
        let payloads: Vec<usize> = asked.clone().collect();
        // `fill`: blocks appended at the run's first position, then
        // written with the payloads in order.
        let n = if payloads.is_empty() {
            0
        } else {
            let at = (asked.start * bs) as u64;
            let blocks = c.import(id, tier, at, payloads.len()).unwrap();
            for (b, p) in blocks.iter().zip(&payloads) {
                st.0.insert(*b, *p);
            }
            blocks.len()
        };
        if n < run.len() {
            added += n;
            break;
        }
        added += n;
    }
    *len += added * bs;
}

/// Finding 2 (wrong KV; `engine/src/cache/remote.rs`). In cold mode the
/// sink's blocks travel hot and the rest cold. When the hot room is smaller
/// than the hot run, the run is cut *before* it is fetched, so `n <
/// run.len()` never fires: the loop goes on to the cold run, whose blocks
/// are appended right after the (short) hot part — block 2's KV at
/// positions 4..8, and so on. `register` then indexes them under the
/// tokens of the positions they sit at.
#[test]
fn an_import_whose_hot_run_is_cut_by_room_does_not_shift_the_cold_blocks() {
    let mut cfg = CoordinatorConfig::new(layout(), 3); // three hot blocks
    cfg.budget_bytes = 64 * hot_bytes(); // bytes are not what runs out
    cfg.cold = Some(cold(8, 8)); // the engine's remote test: window 8, sink 8
    cfg.prefix = Some(PrefixConfig {
        seed: Some(1),
        tail: TurnTail::Copy,
        ..PrefixConfig::default()
    });
    let mut c = Coordinator::new(cfg).unwrap();
    c.check_every_call(true);
    // Another request holds two hot blocks.
    let x = c.open_empty();
    c.plan(x, 8).fits();
    c.commit(x).unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| 3 + (i * 11 % 90)).collect();
    let o = c.open(&prompt, &ExtraKeys::default()).unwrap();
    let mut st = Contents::default();
    let mut len = o.reused;
    import_remote_as_the_engine_does(&mut c, &mut st, o.seq, &mut len, &prompt, 2);
    let t = c.table(o.seq).unwrap().clone();
    assert_eq!(t.positions() as usize, len);
    let wrong: Vec<String> = t
        .entries()
        .iter()
        .enumerate()
        .filter_map(|(k, e)| {
            let b = e.slot().block()?;
            let p = st.0.get(&b)?;
            (*p != k).then(|| {
                format!(
                    "entry {k} (positions {}..{}) holds block {p}'s KV",
                    e.first(),
                    e.end()
                )
            })
        })
        .collect();
    println!(
        "imported table {:?}",
        t.entries().iter().map(|e| e.slot()).collect::<Vec<_>>()
    );
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// An eviction policy that can fail (a Python policy's `victims` raised)
/// for the idle sequence the coordinator asks about, after naming victims.
struct FailsFor {
    inner: kvforge_evict::Scored,
    fail: Option<SeqId>,
    error: Option<String>,
}

impl EvictionPolicy for FailsFor {
    fn name(&self) -> String {
        "fails-for".into()
    }
    fn victims(&mut self, seq: u64, t: &BlockTable, p: Pressure, out: &mut Vec<usize>) {
        self.inner.victims(seq, t, p, out);
        if self.fail == Some(seq) {
            out.push(0);
            self.error = Some("ValueError: raised".into());
        }
    }
    fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }
}

/// A policy failing while the plan asks it about an idle sequence (after
/// the stepping sequence's own eviction, demotions and the budget were
/// worked out) cuts nothing from the idle sequence and fails that
/// sequence's own next step with its words (the contract of
/// `EvictionPolicy::take_error`), not the stepping one's.
#[test]
fn a_policy_failing_on_an_idle_sequence_mid_plan_changes_nothing() {
    let (mut c, _, s, i) = stepping_and_idle();
    let inner = lfu();
    c.set_eviction_policy(Some(Box::new(FailsFor {
        inner,
        fail: Some(i),
        error: None,
    })));
    let before = (
        c.table(s).unwrap().clone(),
        c.table(i).unwrap().clone(),
        c.tier_stats(),
        c.counters(),
    );
    // The policy's failure is I's: S's step takes nothing from I (its
    // answer about I is not trusted) and, without that room, does not fit.
    let planned = c.plan(s, 4);
    assert!(matches!(planned, Ok(Planned::Full(_))), "{planned:?}");
    let after = (
        c.table(s).unwrap().clone(),
        c.table(i).unwrap().clone(),
        c.tier_stats(),
        c.counters(),
    );
    assert_eq!(before, after);
    assert!(c.take_freed_cold().is_empty());
    // I's own next step fails with the policy's words, changing nothing.
    let e = c.plan(i, 1).unwrap_err();
    assert!(
        matches!(&e, CoordError::Policy(m) if m.contains("raised")),
        "{e}"
    );
    assert_eq!(c.table(i).unwrap(), &before.1);
}

/// A tier policy answering anything (a researcher's, or a Python one's
/// ints), failing or not.
struct Odd {
    answer: Mutex<Vec<usize>>,
    error: Mutex<Option<String>>,
}

impl TierPolicy for Odd {
    fn demote(&self, _t: &BlockTable, out: &mut Vec<usize>) {
        out.extend(self.answer.lock().unwrap().iter().copied());
    }
    fn take_error(&self) -> Option<String> {
        self.error.lock().unwrap().take()
    }
}

/// Held in the review: odd tier answers after this step's own eviction dropped
/// entries — a dropped entry, a cold one, the open one, one out of range,
/// twice, out of order, an error with a valid answer — are refused with
/// nothing changed; a valid odd answer (every full hot entry, the sink
/// too) is carried out and the index follows it.
#[test]
fn odd_tier_answers_are_refused_or_carried_out_exactly() {
    let mut cfg = CoordinatorConfig::new(layout(), 32);
    cfg.cold = Some(cold(4, 0));
    cfg.prefix = Some(PrefixConfig {
        seed: Some(2),
        tail: TurnTail::Copy,
        ..PrefixConfig::default()
    });
    cfg.eviction = Some(EvictionConfig::SinkWindow {
        sink: 4,
        window: 16,
    });
    let mut c = Coordinator::new(cfg).unwrap();
    c.check_every_call(true);
    let toks: Vec<u32> = (100..130).collect();
    let o = c.open(&toks, &ExtraKeys::default()).unwrap();
    c.plan(o.seq, 29).fits();
    c.commit(o.seq).unwrap();
    c.register(o.seq, &toks[..29], &ExtraKeys::default())
        .unwrap();
    let odd = std::sync::Arc::new(Odd {
        answer: Mutex::new(Vec::new()),
        error: Mutex::new(None),
    });
    struct Shared(std::sync::Arc<Odd>);
    impl TierPolicy for Shared {
        fn demote(&self, t: &BlockTable, out: &mut Vec<usize>) {
            self.0.demote(t, out)
        }
        fn take_error(&self) -> Option<String> {
            self.0.take_error()
        }
    }
    c.set_tier_policy(Box::new(Shared(odd.clone()))).unwrap();
    let t = c.table(o.seq).unwrap().clone();
    let last = t.entries().len() - 1;
    let state = |c: &Coordinator| {
        (
            c.table(o.seq).unwrap().clone(),
            c.tier_stats(),
            c.index_stats(),
        )
    };
    let before = state(&c);
    // SinkWindow drops entries 1..=2 in this step (positions 4..12 are
    // outside the sink and the 16-token window of a 30-token table).
    for (answer, error) in [
        (vec![1], None),
        (vec![0, 0], None),
        (vec![3, 0], None),
        (vec![last], None),
        (vec![last + 5], None),
        (vec![usize::MAX], None),
        (vec![3], Some("TypeError: no".to_string())),
    ] {
        *odd.answer.lock().unwrap() = answer.clone();
        *odd.error.lock().unwrap() = error;
        let e = c.plan(o.seq, 1);
        assert!(matches!(e, Err(CoordError::Policy(_))), "{answer:?}: {e:?}");
        assert_eq!(state(&c), before, "{answer:?}");
        assert!(c.take_freed_cold().is_empty());
    }
    // Valid, odd: the sink block and every full hot entry but the dropped ones.
    *odd.answer.lock().unwrap() = vec![0, 3, 4];
    let p = c.plan(o.seq, 1).fits();
    assert_eq!(p.demotions.len(), 3);
    c.commit(o.seq).unwrap();
    // A cold entry named again is refused.
    *odd.answer.lock().unwrap() = vec![0];
    assert!(matches!(c.plan(o.seq, 1), Err(CoordError::Policy(_))));
    *odd.answer.lock().unwrap() = vec![];
    c.register(o.seq, &toks[..30], &ExtraKeys::default())
        .unwrap();
    // A request for the same prompt: the index moved to the three cold
    // copies; the dropped entries' blocks stay cached (hot).
    let o2 = c.open(&toks, &ExtraKeys::default()).unwrap();
    assert_eq!(o2.reused, 29);
    let kinds: Vec<bool> = c
        .table(o2.seq)
        .unwrap()
        .entries()
        .iter()
        .map(|e| matches!(e.slot(), Slot::Cold(_)))
        .collect();
    assert_eq!(kinds, [true, false, false, true, true, false, false, false]);
    c.close(o2.seq).unwrap();
    c.close(o.seq).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
    let _ = t;
}

/// Held in the review: preemption by recompute as the scheduler does it
/// (server/src/sched/step.rs `release`: register the held context, free,
/// reopen with the whole context later), under every turn tail, with a
/// fork of the preempted request still running and a remote import in
/// between: the reopened request reuses exactly its held KV.
#[test]
fn preemption_by_recompute_reuses_exactly_what_was_held() {
    for tail in [TurnTail::Skip, TurnTail::Seal, TurnTail::Copy] {
        let mut cfg = CoordinatorConfig::new(layout(), 64);
        cfg.prefix = Some(PrefixConfig {
            seed: Some(5),
            tail,
            ..PrefixConfig::default()
        });
        cfg.cold = Some(cold(8, 4));
        let mut c = Coordinator::new(cfg).unwrap();
        c.check_every_call(true);
        let e = ExtraKeys::namespace("key\u{0}salt");
        let mut ctx: Vec<u32> = (0..23).collect();
        let o = c.open(&ctx, &e).unwrap();
        assert_eq!(o.reused, 0);
        let imported = c.import(o.seq, HOT, o.reused as u64, 2).unwrap().len();
        let mut held = imported * BS as usize;
        // Prefill in chunks, then decode 5 tokens.
        while held < ctx.len() - 1 {
            let n = (ctx.len() - 1 - held).min(7);
            c.plan(o.seq, n).fits();
            c.commit(o.seq).unwrap();
            held += n;
        }
        for t in 0..5 {
            c.plan(o.seq, 1).fits();
            c.commit(o.seq).unwrap();
            held += 1;
            ctx.push(500 + t);
        }
        let f = c.fork(o.seq).unwrap();
        // Preempted: registered, freed.
        c.register(o.seq, &ctx[..held], &e).unwrap();
        c.close(o.seq).unwrap();
        c.plan(f, 3).fits();
        c.commit(f).unwrap();
        // Readmitted with its whole context.
        let o2 = c.open(&ctx, &e).unwrap();
        let expect = match tail {
            TurnTail::Skip => held / BS as usize * BS as usize,
            _ => held,
        };
        assert_eq!(o2.reused, expect.min(ctx.len() - 1), "{tail:?}");
        // Another namespace sees nothing.
        let o3 = c
            .open(&ctx, &ExtraKeys::namespace("key\u{0}other"))
            .unwrap();
        assert_eq!(o3.reused, 0);
        for s in [o2.seq, o3.seq, f] {
            c.close(s).unwrap();
        }
        assert_eq!(c.bytes_in_use(), 0);
    }
}

/// The error bookkeeping of `PyPolicy` (python/src/policy.rs:283-337): an
/// `observe` that raised is kept per sequence and fails *that sequence's*
/// next `victims` call; any other failure is kept until `take_error`.
struct PyLike {
    inner: kvforge_evict::Scored,
    observed: HashMap<u64, String>,
    error: Option<String>,
}

impl EvictionPolicy for PyLike {
    fn name(&self) -> String {
        "pylike".into()
    }
    fn victims(&mut self, seq: u64, t: &BlockTable, p: Pressure, out: &mut Vec<usize>) {
        if let Some(why) = self.observed.remove(&seq) {
            self.error.get_or_insert(why);
            return;
        }
        self.inner.victims(seq, t, p, out);
    }
    fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }
}

/// Finding 3 (contract): "an `observe` that raises fails the sequence's
/// next step" (python/src/policy.rs). When another sequence's step needs
/// room, the coordinator asks the policy about the idle one: the failure
/// is the idle sequence's — its own next step fails with it — and never
/// the stepping sequence's.
#[test]
fn a_failed_observe_fails_its_own_sequences_next_step_not_anothers() {
    let (mut c, _, s, i) = stepping_and_idle();
    let inner = lfu();
    let mut observed = HashMap::new();
    observed.insert(i, format!("seq {i}: ZeroDivisionError in observe"));
    c.set_eviction_policy(Some(Box::new(PyLike {
        inner,
        observed,
        error: None,
    })));
    let stepping = c.plan(s, 4);
    let own = c.plan(i, 1);
    println!("S's step: {stepping:?}\nI's step: {own:?}");
    assert!(
        !matches!(&stepping, Err(CoordError::Policy(m)) if m.contains(&format!("seq {i}"))),
        "S's step failed with idle I's observe error: {stepping:?}"
    );
    assert!(
        matches!(&own, Err(CoordError::Policy(_))),
        "I's own next step should fail: {own:?}"
    );
}

/// The engine's cold tier as it is now (engine/src/tier/mod.rs): content
/// stored by slot with the epoch of its handle; `free` drops a slot's
/// content only when the freed handle's epoch is the stored one.
#[derive(Default)]
struct EpochStore(HashMap<u32, BlockId>);

impl EpochStore {
    fn put(&mut self, b: BlockId) {
        self.0.insert(TieredPool::slot_of(b), b);
    }
    fn free_cold(&mut self, c: &mut Coordinator) {
        for b in c.take_freed_cold() {
            let s = TieredPool::slot_of(b);
            if self.0.get(&s) == Some(&b) {
                self.0.remove(&s);
            }
        }
    }
}

/// Review of issue 42's fixes, R1: `allocate` withdrew every pending
/// freed-cold report whose local slot *number* equalled that of a block it
/// handed out, of any tier — a hot allocation withdrew the report of the
/// cold block of the same number, whose content the engine then never
/// freed (memory outside the byte budget). Random steps of three sequences
/// (no prefix index, so a cold block no table lists is held by no one):
/// after every engine step, every cold block the engine still stores is
/// listed by a table.
#[test]
fn no_cold_content_stays_stored_that_no_table_lists() {
    let (h, k) = (hot_bytes(), cold_bytes());
    let mut found = None;
    'cases: for case in 0..400u64 {
        let mut rng = case.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let budget = (3 + next() % 4) * h + (2 + next() % 6) * k - 1;
        let mut c = Coordinator::new(idle_cut_config(budget, 0.9)).unwrap();
        c.check_every_call(true);
        let mut st = EpochStore::default();
        let mut seqs: Vec<SeqId> = (0..3).map(|_| c.open_empty()).collect();
        for op in 0..60 {
            let j = (next() % 3) as usize;
            if next() % 10 == 0 {
                c.close(seqs[j]).unwrap();
                st.free_cold(&mut c);
                seqs[j] = c.open_empty();
            } else {
                let n = 1 + (next() % 6) as usize;
                let p = match c.plan(seqs[j], n) {
                    Ok(kvforge_coordinator::Planned::Step(p)) => p,
                    Ok(kvforge_coordinator::Planned::Full(_)) => continue,
                    Err(e) => panic!("{e}"),
                };
                for d in p.demotions.iter().filter(|d| d.quantize) {
                    st.put(d.cold);
                }
                c.commit(seqs[j]).unwrap();
                st.free_cold(&mut c);
            }
            let listed: Vec<BlockId> = seqs
                .iter()
                .flat_map(|&q| c.view(q).unwrap().entries().to_vec())
                .filter_map(|e| match e.slot() {
                    Slot::Cold(b) | Slot::Alias { canonical: b } => Some(b),
                    _ => None,
                })
                .collect();
            let stale: Vec<BlockId> =
                st.0.values()
                    .filter(|b| !listed.contains(b))
                    .copied()
                    .collect();
            if !stale.is_empty() {
                found = Some(format!(
                    "case {case} op {op}: cold content of {stale:?} stays stored, listed by no table and held by no one"
                ));
                break 'cases;
            }
        }
    }
    assert!(found.is_none(), "{}", found.unwrap());
}

/// An LFU policy that cannot answer about sequence `fail` (a Python
/// policy's `victims` raised), once.
struct FailsOnce {
    inner: kvforge_evict::Scored,
    fail: Option<u64>,
    error: Option<String>,
}

impl kvforge_evict::EvictionPolicy for FailsOnce {
    fn name(&self) -> String {
        "fails-once".into()
    }
    fn victims(
        &mut self,
        seq: u64,
        t: &kvforge_pool::BlockTable,
        p: kvforge_evict::Pressure,
        out: &mut Vec<usize>,
    ) {
        self.inner.victims(seq, t, p, out);
        if self.fail == Some(seq) {
            self.fail = None;
            self.error = Some("ValueError: raised by the old policy".into());
        }
    }
    fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }
}

/// R6: a failure stored on idle I (the policy could not answer about it)
/// belongs to the policy that failed: once `set_eviction_policy` replaces
/// it, I's next step is the new policy's, and succeeds.
#[test]
fn a_replaced_policys_failure_does_not_fail_a_step_under_the_new_policy() {
    let (mut c, _, s, i) = stepping_and_idle();
    c.set_eviction_policy(Some(Box::new(FailsOnce {
        inner: lfu(),
        fail: Some(i),
        error: None,
    })));
    // S's plan asks the policy about idle I, which fails: stored on I.
    let planned = c.plan(s, 4);
    assert!(planned.is_ok(), "{planned:?}");
    if matches!(planned, Ok(Planned::Step(_))) {
        c.commit(s).unwrap();
    }
    // The failing policy is replaced by a sound one.
    c.set_eviction_policy(Some(Box::new(lfu())));
    let r = c.plan(i, 1);
    assert!(
        !matches!(r, Err(CoordError::Policy(_))),
        "I's step under the new policy fails with the replaced policy's error: {r:?}"
    );
}
