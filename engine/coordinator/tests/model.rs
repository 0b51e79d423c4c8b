//! A randomized, model-based test of the public coordinator API: a
//! simulated engine carries out every plan (copies, packs, row packs,
//! demotions, writes) on shadow block storage keyed by slot and epoch, each
//! row holding `(position, token, computed over the plain prefix)`, so
//! stale handles, freed storage, writes under a reader and wrong content
//! are all observable. Every mechanism is on in some case: both indexes ×
//! every turn tail, the cold tier, exact and SimHash sharing, every
//! eviction (page, head-wise and token-level beside a cold tier through
//! the setters), the configured lifecycles and a researcher's own
//! (contract-bending) lifecycle policy.
//!
//! The cold tier's storage is freed *by slot*, as the engine's
//! `ColdTier::free` does, and a freed block whose slot a table lists is a
//! defect. Besides steps, turns, forks and lifecycles: imports of remote
//! blocks (hot and cold, `Coordinator::import`, now and then at a wrong
//! position, which must be refused), preemption by recompute (register,
//! close, reopen with the whole context, as the server's scheduler does),
//! tier and eviction policies that fail (`take_error`) or answer out of
//! range mid-plan — on the stepping sequence or on an idle one, whose own
//! next step must then fail —, an aggressive valid tier policy (every full
//! hot entry), adapters and salted namespaces.
//!
//! From the adversarial reviews of `004489b` (twelve defects, each kept as
//! a regression in `regressions.rs`) and of `d047843` (four, in
//! `freed_slots.rs`). Knobs (env): `KVFORGE_MODEL_CASES` (default 1500),
//! `KVFORGE_MODEL_OPS` (200), `KVFORGE_MODEL_SEED` (replay one case with
//! its op log), `KVFORGE_MODEL_THREAD_ROUNDS` (20); `cargo xtask
//! model-check [CASES]` runs the long version in release.

use std::collections::{BTreeMap, HashMap};

use kvforge_coordinator::testing::{check_invariants, fail_plan_at};
use kvforge_coordinator::{
    COLD, ColdConfig, Content, CoordError, Coordinator, CoordinatorConfig, DedupConfig,
    EvictionConfig, Grain, HOT, IndexKind, Label, LifecycleConfig, Phase, Plan, Planned,
    PrefixConfig, Score, Segment, SeqId, SimHashConfig, Slot, TieredPool, Trigger, TurnTail,
};
use kvforge_evict::Scored;
use kvforge_evict::{EvictionPolicy, Pressure, SinkWindow};
use kvforge_lifecycle::{LifecycleParams, LifecyclePolicy};
use kvforge_pool::{BlockAllocator, BlockId, BlockTable, KvLayout, StorageFormat};
use kvforge_prefix::ExtraKeys;
use kvforge_quant::{TierPlan, TierPolicy};
use std::sync::{Arc, Mutex};

/// Policy failures armed by the model for the next plan.
#[derive(Default)]
struct Flaky {
    /// 1 tier error, 2 tier out of range, 3 tier twice out of range,
    /// 4 eviction error, 5 eviction out of range, 6 eviction error on an
    /// idle sequence only (an idle cut).
    armed: u8,
    fired: bool,
    stepping: u64,
    /// Demote every full, closed, hot entry without holes (valid).
    greedy: bool,
    /// Mode 6 fired while this idle sequence was asked.
    failed_idle: Option<u64>,
    tier_error: Option<String>,
    evict_error: Option<String>,
    fired_total: usize,
}
type SharedFlaky = Arc<Mutex<Flaky>>;

struct FlakyTier {
    inner: TierPlan,
    s: SharedFlaky,
}

impl TierPolicy for FlakyTier {
    fn demote(&self, t: &BlockTable, out: &mut Vec<usize>) {
        let mut s = self.s.lock().unwrap();
        let n = t.entries().len();
        let last = n.wrapping_sub(1);
        match s.armed {
            1 => {
                self.inner.demote(t, out);
                s.tier_error = Some("RuntimeError: demote raised".into());
            }
            2 => out.push(n + 1),
            3 => out.extend([n + 2, n + 2]),
            _ => {
                if s.greedy {
                    for (i, e) in t.entries().iter().enumerate() {
                        if matches!(e.slot(), Slot::Hot(_))
                            && e.tokens() == t.block_size()
                            && e.holes() == 0
                            && !(t.is_open() && i == last)
                        {
                            out.push(i);
                        }
                    }
                } else {
                    self.inner.demote(t, out);
                }
                return;
            }
        }
        s.armed = 0;
        s.fired = true;
        s.fired_total += 1;
    }
    fn take_error(&self) -> Option<String> {
        self.s.lock().unwrap().tier_error.take()
    }
}

struct FlakyEvict {
    inner: Box<dyn EvictionPolicy>,
    s: SharedFlaky,
}

impl FlakyEvict {
    /// Whether this call fails (and how): `Some(true)` an error, `Some(false)` out of range.
    fn fail(&mut self, seq: u64) -> Option<bool> {
        let mut s = self.s.lock().unwrap();
        let how = match s.armed {
            4 => Some(true),
            5 => Some(false),
            6 if seq != s.stepping => Some(true),
            _ => None,
        }?;
        if how {
            s.evict_error = Some("ValueError: victims raised".into());
        }
        if s.armed == 6 {
            s.failed_idle = Some(seq);
        }
        s.armed = 0;
        s.fired = true;
        s.fired_total += 1;
        Some(how)
    }
}

impl EvictionPolicy for FlakyEvict {
    fn name(&self) -> String {
        format!("flaky-{}", self.inner.name())
    }
    fn wants_attention(&self) -> bool {
        self.inner.wants_attention()
    }
    fn observe(&mut self, seq: u64, t: &BlockTable, m: &[f32]) {
        self.inner.observe(seq, t, m)
    }
    fn observation_window(&self) -> usize {
        self.inner.observation_window()
    }
    fn wants_keys(&self) -> bool {
        self.inner.wants_keys()
    }
    fn observe_keys(&mut self, seq: u64, t: &BlockTable, v: &[f32]) {
        self.inner.observe_keys(seq, t, v)
    }
    fn per_lane(&self) -> bool {
        self.inner.per_lane()
    }
    fn lane_victims(
        &mut self,
        seq: u64,
        t: &BlockTable,
        p: Pressure,
        lanes: usize,
        out: &mut Vec<usize>,
    ) {
        self.inner.lane_victims(seq, t, p, lanes, out);
        if self.fail(seq) == Some(false) {
            out.push(t.entries().len() + 3);
        }
    }
    fn token_level(&self) -> bool {
        self.inner.token_level()
    }
    fn token_victims(
        &mut self,
        seq: u64,
        t: &BlockTable,
        p: Pressure,
        out: &mut Vec<(usize, u32)>,
    ) {
        self.inner.token_victims(seq, t, p, out);
        if self.fail(seq) == Some(false) {
            out.push((t.entries().len() + 3, 0));
        }
    }
    fn victims(&mut self, seq: u64, t: &BlockTable, p: Pressure, out: &mut Vec<usize>) {
        self.inner.victims(seq, t, p, out);
        if self.fail(seq) == Some(false) {
            out.push(t.entries().len() + 3);
        }
    }
    fn forget(&mut self, seq: u64) {
        self.inner.forget(seq)
    }
    fn take_error(&mut self) -> Option<String> {
        self.s.lock().unwrap().evict_error.take()
    }
}

const BS: u32 = 4;
const LANES: usize = 4;

/// An integer from the environment, or `default`.
fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A rollback gave back the turn's starting table: exactly, or with the
/// open last block sealed (others read rows the turn wrote into it; the
/// next step copies it).
fn restored(now: &BlockTable, snap: &BlockTable) -> bool {
    if now == snap {
        return true;
    }
    let mut sealed = snap.clone();
    sealed.seal();
    snap.is_open() && *now == sealed
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }
}

/// A researcher's lifecycle policy that bends its contract: random labels,
/// sometimes one too few or two too many, the newest turn's segments
/// labelled too, the fallback flag at random.
struct Chaos(Rng);

impl LifecyclePolicy for Chaos {
    fn name(&self) -> String {
        "chaos".into()
    }
    fn label(
        &mut self,
        _seq: u64,
        segments: &[Segment],
        _model: Option<&[Label]>,
        out: &mut Vec<Label>,
    ) -> bool {
        let n = match self.0.below(10) {
            0 => segments.len().saturating_sub(1),
            1 => segments.len() + 2,
            _ => segments.len(),
        };
        out.extend((0..n).map(|_| [Label::Keep, Label::Drop, Label::Compress][self.0.below(3)]));
        self.0.chance(20)
    }
}

/// The vector SimHash compares: each row's token (0 for an empty row),
/// lane after lane, so blocks of similar tokens are near duplicates.
fn vector_of(c: &Content2) -> Vec<f32> {
    c.iter()
        .flat_map(|lane| {
            lane.iter()
                .map(|r| r.map_or(0.0, |(_, t, _)| 1.0 + t as f32))
        })
        .collect()
}

/// (position, token, computed over the plain prefix: every earlier position visible)
type Row = Option<(u64, u32, bool)>;
type Content2 = Vec<Vec<Row>>; // lanes x rows

#[derive(Clone, Debug)]
enum Stored {
    Live(u32, Content2),
    Freed(u32),
}

#[derive(Default)]
struct Store {
    blocks: HashMap<u32, Stored>,
}

fn empty() -> Content2 {
    vec![vec![None; BS as usize]; LANES]
}

impl Store {
    /// Content a handle reads, or why it cannot.
    fn read(&self, b: BlockId) -> Result<&Content2, String> {
        match self.blocks.get(&b.index()) {
            Some(Stored::Live(e, c)) if *e == b.epoch() => Ok(c),
            Some(Stored::Live(e, _)) => Err(format!("{b:?} overwritten (slot now epoch {e})")),
            Some(Stored::Freed(e)) if *e == b.epoch() => Err(format!("{b:?} storage freed")),
            Some(Stored::Freed(e)) => Err(format!("{b:?} freed at epoch {e}")),
            None => Err(format!("{b:?} never written")),
        }
    }
    /// The content a write into `b` goes to: a newer epoch starts empty.
    fn write(&mut self, b: BlockId) -> Result<&mut Content2, String> {
        let fresh = match self.blocks.get(&b.index()) {
            Some(Stored::Live(e, _)) if *e == b.epoch() => false,
            Some(Stored::Freed(e)) if *e == b.epoch() => {
                return Err(format!("write into freed storage through {b:?}"));
            }
            Some(Stored::Live(e, _)) | Some(Stored::Freed(e)) if *e > b.epoch() => {
                return Err(format!("write through stale {b:?} (slot at epoch {e})"));
            }
            _ => true,
        };
        if fresh {
            self.blocks
                .insert(b.index(), Stored::Live(b.epoch(), empty()));
        }
        match self.blocks.get_mut(&b.index()) {
            Some(Stored::Live(_, c)) => Ok(c),
            _ => unreachable!(),
        }
    }
    fn free(&mut self, b: BlockId) {
        if let Some(Stored::Live(e, _)) = self.blocks.get(&b.index()) {
            // The engine's ColdTier::free drops whatever the slot holds.
            let e = *e;
            self.blocks.insert(b.index(), Stored::Freed(e));
        }
    }
}

fn bytes_of(c: &Content2) -> Vec<u8> {
    let mut v = Vec::new();
    for lane in c {
        for r in lane {
            match r {
                None => v.extend_from_slice(&[0xff; 12]),
                Some((p, t, plain)) => {
                    v.extend_from_slice(&p.to_le_bytes());
                    v.extend_from_slice(&t.to_le_bytes());
                    v.push(u8::from(*plain));
                }
            }
        }
    }
    v
}

#[derive(Clone)]
struct MSeq {
    toks: Vec<u32>,
    queue: Vec<u32>,
    extra: ExtraKeys,
    turn: Option<(BlockTable, usize, Vec<u32>)>,
    pending: Option<PendingM>,
}

#[derive(Clone)]
struct PendingM {
    n: usize,
    undo: Vec<(BlockId, Content2)>,
    from_queue: usize,
}

#[derive(Clone, Copy, Debug)]
struct Feat {
    prefix: Option<(IndexKind, TurnTail)>,
    cold: Option<(usize, usize)>,
    evict: u8, // 0 none, 1 sinkwindow, 2 scored lfu, 3 keydiff per head, 4 keydiff per token, 5 keydiff page
    /// 0 none, 1 exact, 2 SimHash.
    dedup: u8,
    /// 0 none, 1 recent turns, 2 labels, 3 a researcher's own policy.
    lifecycle: u8,
    hot_blocks: usize,
    budget_blocks: usize,
    flaky: bool,
    greedy_tier: bool,
}

fn layout() -> KvLayout {
    KvLayout::new(2, 2, 8, BS, StorageFormat::F16).unwrap()
}

fn make(r: &mut Rng) -> (Feat, Coordinator, Option<SharedFlaky>) {
    loop {
        let prefix = match r.below(4) {
            0 => None,
            k => Some((
                if r.chance(50) {
                    IndexKind::HashChain
                } else {
                    IndexKind::Radix
                },
                [TurnTail::Skip, TurnTail::Seal, TurnTail::Copy][k - 1],
            )),
        };
        let cold = if r.chance(60) {
            Some((4 * (1 + r.below(3)), 4 * r.below(2)))
        } else {
            None
        };
        let evict = r.below(6) as u8;
        let dedup = if cold.is_some() { r.below(3) as u8 } else { 0 };
        let lifecycle = if r.chance(50) {
            0
        } else {
            1 + r.below(3) as u8
        };
        let hot_blocks = if r.chance(30) {
            6 + r.below(10)
        } else {
            16 + r.below(32)
        };
        let budget_blocks = if r.chance(60) {
            0
        } else {
            6 + r.below(hot_blocks)
        };
        let f = Feat {
            prefix,
            cold,
            evict,
            dedup,
            lifecycle,
            hot_blocks,
            budget_blocks,
            flaky: false,
            greedy_tier: false,
        };
        let mut cfg = CoordinatorConfig::new(layout(), hot_blocks);
        cfg.budget_bytes = budget_blocks as u64 * layout().block_bytes();
        cfg.prefix = prefix.map(|(index, tail)| PrefixConfig {
            index,
            seed: Some(3),
            tail,
        });
        let int4 = StorageFormat::Int4 { group_size: 8 };
        cfg.cold = cold.map(|(window, sink)| ColdConfig {
            format: int4,
            value_format: int4,
            window,
            sink,
        });
        let win = cold.map_or(4, |c| c.0).max(4) + 4 * r.below(2);
        let sink = 4 * r.below(2);
        let eviction = match evict {
            0 => None,
            1 => Some(EvictionConfig::SinkWindow { sink, window: win }),
            k => Some(EvictionConfig::Scored {
                score: if k == 2 { Score::Lfu } else { Score::KeyDiff },
                trigger: if r.chance(50) {
                    Trigger::Tokens(sink + win + 4 + r.below(12))
                } else {
                    Trigger::Watermark {
                        high: 0.8,
                        low: 0.5,
                    }
                },
                sink,
                window: win,
                per_head: k == 3,
                per_token: k == 4,
            }),
        };
        // The configuration refuses head-wise and token-level eviction
        // beside a cold tier (the engine does not run them together); the
        // setters take them, and the coordinator must stay correct.
        let packing_beside_cold = cold.is_some() && (evict == 3 || evict == 4);
        if !packing_beside_cold {
            cfg.eviction = eviction;
        }
        cfg.dedup = match dedup {
            0 => None,
            1 => Some(DedupConfig::Exact),
            _ => Some(DedupConfig::SimHash(SimHashConfig {
                threshold: 0.9,
                bits: 8,
                tables: 2,
                seed: r.next(),
            })),
        };
        let chaos_seed = r.next();
        cfg.lifecycle = (lifecycle == 1 || lifecycle == 2).then(|| {
            if lifecycle == 1 {
                LifecycleConfig::RecentTurns {
                    keep: 1 + r.below(2) as u32,
                }
            } else {
                LifecycleConfig::Labels {
                    source: if r.chance(50) {
                        kvforge_coordinator::LabelSource::Rule
                    } else {
                        kvforge_coordinator::LabelSource::Free
                    },
                    protect: 1 + r.below(2) as u32,
                    delay: r.below(3) as u32,
                    min_match: if r.chance(50) { 0 } else { 2 + r.below(3) },
                    compress_min: if r.chance(50) {
                        None
                    } else {
                        Some(4 + r.below(8) as u64)
                    },
                }
            }
        });
        let mut c = match Coordinator::new(cfg) {
            Ok(c) => c,
            Err(_) => continue,
        };
        if packing_beside_cold {
            let Some(EvictionConfig::Scored {
                score,
                trigger,
                sink,
                window,
                ..
            }) = eviction
            else {
                unreachable!()
            };
            let p = Scored::new(score, trigger, sink, window).unwrap();
            let p = if evict == 3 {
                p.per_head().unwrap()
            } else {
                p.per_token().unwrap()
            };
            c.set_eviction_policy(Some(Box::new(p)));
        }
        // Every public call checks every invariant as well.
        c.check_every_call(true);
        if lifecycle == 3 {
            let params = LifecycleParams {
                delay: r.below(3) as u32,
                min_match: if r.chance(50) { 0 } else { 2 },
                compress_min: if r.chance(50) {
                    None
                } else {
                    Some(1 + r.below(6) as u64)
                },
            };
            c.set_lifecycle_policy(Some((Box::new(Chaos(Rng(chaos_seed))), params)))
                .unwrap();
        }
        // Policies that fail mid-plan, or answer aggressively.
        let mut f = f;
        let mut flaky = None;
        if r.chance(40) && (cold.is_some() || eviction.is_some()) {
            let shared: SharedFlaky = Arc::new(Mutex::new(Flaky::default()));
            f.flaky = true;
            f.greedy_tier = cold.is_some() && r.chance(30);
            shared.lock().unwrap().greedy = f.greedy_tier;
            if let Some((window, sink)) = cold {
                let inner = TierPlan::new(BS as usize, window)
                    .unwrap()
                    .with_sink(sink)
                    .unwrap();
                c.set_tier_policy(Box::new(FlakyTier {
                    inner,
                    s: shared.clone(),
                }))
                .unwrap();
            }
            let inner: Option<Box<dyn EvictionPolicy>> = match eviction {
                None => None,
                Some(EvictionConfig::SinkWindow { sink, window }) => {
                    Some(Box::new(SinkWindow::new(sink, window).unwrap()))
                }
                Some(EvictionConfig::Scored {
                    score,
                    trigger,
                    sink,
                    window,
                    per_head,
                    per_token,
                }) => {
                    let p = Scored::new(score, trigger, sink, window).unwrap();
                    Some(match (per_head, per_token) {
                        (true, _) => Box::new(p.per_head().unwrap()),
                        (_, true) => Box::new(p.per_token().unwrap()),
                        _ => Box::new(p),
                    })
                }
            };
            if let Some(inner) = inner {
                c.set_eviction_policy(Some(Box::new(FlakyEvict {
                    inner,
                    s: shared.clone(),
                })));
            }
            flaky = Some(shared);
        }
        return (f, c, flaky);
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct Stats {
    plans: usize,
    refused: usize,
    commits: usize,
    aborts: usize,
    demotions: usize,
    reused_demotions: usize,
    aliases: usize,
    copies: usize,
    drops: usize,
    packs: usize,
    in_place_packs: usize,
    row_packs: usize,
    in_place_rows: usize,
    prefix_hits: usize,
    registers: usize,
    forks: usize,
    turns: usize,
    rollbacks: usize,
    end_turns: usize,
    lifecycle_drops: usize,
    closes: usize,
    idle_evictions: u64,
    bad_calls: usize,
    injected: usize,
    imports: usize,
    imported_blocks: usize,
    refused_imports: usize,
    preempts: usize,
    policy_failures: usize,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.plans += o.plans;
        self.refused += o.refused;
        self.commits += o.commits;
        self.aborts += o.aborts;
        self.demotions += o.demotions;
        self.reused_demotions += o.reused_demotions;
        self.aliases += o.aliases;
        self.copies += o.copies;
        self.drops += o.drops;
        self.packs += o.packs;
        self.in_place_packs += o.in_place_packs;
        self.row_packs += o.row_packs;
        self.in_place_rows += o.in_place_rows;
        self.prefix_hits += o.prefix_hits;
        self.registers += o.registers;
        self.forks += o.forks;
        self.turns += o.turns;
        self.rollbacks += o.rollbacks;
        self.end_turns += o.end_turns;
        self.lifecycle_drops += o.lifecycle_drops;
        self.closes += o.closes;
        self.idle_evictions += o.idle_evictions;
        self.bad_calls += o.bad_calls;
        self.injected += o.injected;
        self.imports += o.imports;
        self.imported_blocks += o.imported_blocks;
        self.refused_imports += o.refused_imports;
        self.preempts += o.preempts;
        self.policy_failures += o.policy_failures;
    }
}

struct World {
    st: Stats,
    c: Coordinator,
    f: Feat,
    store: Store,
    seqs: BTreeMap<SeqId, MSeq>,
    bases: Vec<Vec<u32>>,
    log: Vec<String>,
    mix: u8,
    /// Segments handed out for summarising and answered already.
    answered: Vec<(SeqId, Segment)>,
    flaky: Option<SharedFlaky>,
    /// Idle sequences the eviction policy failed on while another's step
    /// asked about them: their own next plan must fail.
    owes: std::collections::BTreeSet<SeqId>,
}

#[derive(Debug)]
struct Defect {
    kind: &'static str,
    what: String,
}

fn defect(kind: &'static str, what: String) -> Defect {
    Defect { kind, what }
}

/// Everything an abort or a refused call must leave as it was.
#[derive(Debug, PartialEq)]
struct Snap {
    tables: Vec<(SeqId, BlockTable)>,
    counts: Vec<(BlockId, u32)>,
    in_use: Vec<(usize, u64)>,
    index: Option<kvforge_prefix::MatchStats>,
}

impl World {
    fn snap(&self) -> Snap {
        let mut counts = Vec::new();
        let mut tables = Vec::new();
        for (&id, m) in &self.seqs {
            let t = self.c.table(id).unwrap().clone();
            for b in t.held() {
                counts.push((b, self.c.pools().ref_count(b).unwrap_or(u32::MAX)));
            }
            if let Some((st, _, _)) = &m.turn {
                for b in st.held() {
                    counts.push((b, self.c.pools().ref_count(b).unwrap_or(u32::MAX)));
                }
            }
            tables.push((id, t));
        }
        Snap {
            tables,
            counts,
            in_use: self
                .c
                .tier_stats()
                .iter()
                .map(|t| (t.pool.in_use, t.pool.in_use_bytes))
                .collect(),
            index: self.c.index_stats().map(|mut s| {
                s.queries = 0;
                s.query_tokens = 0;
                s
            }),
        }
    }

    /// Offers a cold block the step of `id` quantized to the deduplicator.
    fn offer(&mut self, id: SeqId, cold: BlockId) -> Result<Option<BlockId>, Defect> {
        let near = self.c.wants().share_vectors;
        let content_of = |c: &Content2| Content {
            bytes: bytes_of(c),
            vector: if near { vector_of(c) } else { Vec::new() },
        };
        let content = content_of(self.store.read(cold).map_err(|m| defect("share-src", m))?);
        let store = &self.store;
        let mut stored = |b: BlockId| store.read(b).ok().map(content_of);
        self.c
            .share(id, cold, &content, &mut stored)
            .map_err(|e| defect("share-error", format!("{e}")))
    }

    fn any_pending(&self) -> bool {
        self.seqs.values().any(|m| m.pending.is_some())
    }

    /// Checks the content every live entry of `t` reads against `toks`.
    fn check_table(
        &self,
        id: SeqId,
        t: &BlockTable,
        toks: &[u32],
        what: &str,
    ) -> Result<(), Defect> {
        t.check()
            .map_err(|e| defect("table-invariant", format!("seq {id} {what}: {e}")))?;
        if t.positions() as usize != toks.len() {
            return Err(defect(
                "positions",
                format!(
                    "seq {id} {what}: table {} positions, model {}",
                    t.positions(),
                    toks.len()
                ),
            ));
        }
        for (i, e) in t.entries().iter().enumerate() {
            let b = match e.slot() {
                Slot::Dropped => continue,
                Slot::Hot(b) | Slot::Cold(b) => b,
                Slot::Alias { canonical } => {
                    if self.f.dedup == 0 {
                        return Err(defect("alias-without-dedup", format!("seq {id} entry {i}")));
                    }
                    canonical
                }
            };
            // A near duplicate (SimHash) reads another block's content:
            // only that the canonical's storage is live is checked; an
            // entry of any other kind holds exactly its own KV.
            let near = self.f.dedup == 2 && matches!(e.slot(), Slot::Alias { .. });
            let expect_tier = match e.slot() {
                Slot::Hot(_) => HOT,
                _ => COLD,
            };
            if TieredPool::tier_of(b) != expect_tier {
                return Err(defect(
                    "slot-tier",
                    format!("seq {id} {what} entry {i} {:?}", e.slot()),
                ));
            }
            let c = self.store.read(b).map_err(|m| {
                defect(
                    "read-gone-block",
                    format!("seq {id} {what} entry {i} {:?}: {m}", e.slot()),
                )
            })?;
            if near {
                continue;
            }
            for r in 0..e.tokens() as usize {
                if e.holes() >> r & 1 == 1 {
                    continue;
                }
                let pos = e.first() + r as u64;
                for (lane, l) in c.iter().enumerate() {
                    let got = l[r];
                    let ok = if e.is_packed() {
                        matches!(got, Some((p, tk, _)) if (p as usize) < toks.len() && toks[p as usize] == tk)
                    } else {
                        if let Some((p, tk, false)) = got {
                            if p == pos && tk == toks[pos as usize] && what.starts_with("opened") {
                                return Err(defect(
                                    "non-plain-prefix-hit",
                                    format!(
                                        "seq {id} {what} entry {i} {:?} row {r}: a prefix hit hands out KV computed while earlier positions were evicted (dropped, holed or packed)",
                                        e.slot()
                                    ),
                                ));
                            }
                        }
                        matches!(got, Some((p, tk, _)) if p == pos && tk == toks[pos as usize])
                    };
                    if !ok {
                        return Err(defect(
                            "wrong-content",
                            format!(
                                "seq {id} {what} entry {i} {:?} (first {}, packed {}) row {r} lane {lane}: holds {got:?}, expected ({pos}, {})",
                                e.slot(),
                                e.first(),
                                e.is_packed(),
                                toks[pos as usize]
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn check_all(&mut self, op: &str) -> Result<(), Defect> {
        check_invariants(&self.c).map_err(|e| defect("invariant", format!("{op}: {e}")))?;
        for (&id, m) in &self.seqs {
            // A step in flight may have permuted its blocks in place: its
            // view is what reads them now.
            let (t, what) = match m.pending {
                Some(_) => (self.c.view(id).unwrap().clone(), "view"),
                None => (self.c.table(id).unwrap().clone(), "committed"),
            };
            self.check_table(id, &t, &m.toks, what)?;
            if let Some((st, len, _)) = &m.turn {
                self.check_table(id, st, &m.toks[..*len], "snapshot")?;
            }
        }
        // Freed cold storage: must not be read by anyone.
        let freed = self.c.take_freed_cold();
        for &b in &freed {
            for (&id, m) in &self.seqs {
                let mut lists: Vec<BlockId> = self.c.table(id).unwrap().held().collect();
                if let Some((st, _, _)) = &m.turn {
                    lists.extend(st.held());
                }
                if m.pending.is_some() {
                    lists.extend(self.c.view(id).unwrap().held());
                }
                if let Some(x) = lists.iter().find(|x| x.index() == b.index() && **x != b) {
                    return Err(defect(
                        "freed-slot-live",
                        format!(
                            "{op}: cold {b:?} reported freed, its slot now holds {x:?} listed by seq {id} (the engine frees by slot)"
                        ),
                    ));
                }
            }
        }
        for &b in &freed {
            for (&id, m) in &self.seqs {
                let t = self.c.table(id).unwrap();
                let mut lists: Vec<BlockId> = t.held().collect();
                if let Some((st, _, _)) = &m.turn {
                    lists.extend(st.held());
                }
                if m.pending.is_some() {
                    lists.extend(self.c.view(id).unwrap().held());
                }
                if lists.contains(&b) {
                    return Err(defect(
                        "freed-while-held",
                        format!("{op}: cold {b:?} reported freed but seq {id} lists it"),
                    ));
                }
            }
            if self.c.pools().ref_count(b).is_ok_and(|n| n > 0) {
                return Err(defect(
                    "freed-while-held",
                    format!("{op}: cold {b:?} freed with count > 0"),
                ));
            }
            self.store.free(b);
        }
        if self.any_pending() {
            return Ok(());
        }
        // Reference counts: exactly one per listing, tables + snapshots.
        let mut mult: HashMap<BlockId, u32> = HashMap::new();
        for (&id, m) in &self.seqs {
            for b in self.c.table(id).unwrap().held() {
                *mult.entry(b).or_default() += 1;
            }
            if let Some((st, _, _)) = &m.turn {
                for b in st.held() {
                    *mult.entry(b).or_default() += 1;
                }
            }
        }
        for (&b, &n) in &mult {
            let rc = self.c.pools().ref_count(b);
            if rc != Ok(n) {
                return Err(defect(
                    "refcount",
                    format!("{op}: {b:?} listed {n} times, pool says {rc:?}"),
                ));
            }
        }
        for (t, s) in self.c.tier_stats().iter().enumerate() {
            let distinct = mult
                .keys()
                .filter(|b| TieredPool::tier_of(**b) == t)
                .count();
            if s.pool.in_use != distinct {
                return Err(defect(
                    "leak",
                    format!(
                        "{op}: tier {t} has {} in use, tables hold {distinct}",
                        s.pool.in_use
                    ),
                ));
            }
        }
        if self.c.bytes_in_use() > self.c.budget() {
            return Err(defect(
                "over-budget",
                format!(
                    "{op}: {} bytes in use > budget {}",
                    self.c.bytes_in_use(),
                    self.c.budget()
                ),
            ));
        }
        Ok(())
    }

    /// Carries out `p` on the store for sequence `id`; returns the undo log
    /// of in-place rewrites.
    fn execute(
        &mut self,
        id: SeqId,
        p: &Plan,
        new: &[u32],
    ) -> Result<Vec<(BlockId, Content2)>, Defect> {
        let bad =
            |k: &'static str, m: String| defect(k, format!("seq {id} plan at {}: {m}", p.start));
        // Blocks other holders read (rows), to check that no write reaches them.
        let mut readers: HashMap<BlockId, u32> = HashMap::new();
        for (&o, m) in &self.seqs {
            let mut tabs: Vec<BlockTable> = Vec::new();
            if o != id {
                tabs.push(self.c.view(o).unwrap().clone());
                tabs.push(self.c.table(o).unwrap().clone());
            }
            if let Some((st, _, _)) = &m.turn {
                tabs.push(st.clone());
            }
            for t in tabs {
                for e in t.entries() {
                    if let Slot::Hot(b) = e.slot() {
                        let rows = if e.is_packed() { BS } else { e.tokens() };
                        let r = readers.entry(b).or_default();
                        *r = (*r).max(rows);
                    }
                }
            }
        }
        let mut undo = Vec::new();
        for cp in &p.copies {
            let src = self
                .store
                .read(cp.src)
                .map_err(|m| bad("copy-src", m))?
                .clone();
            if readers.contains_key(&cp.dst) {
                return Err(bad(
                    "write-shared",
                    format!("copy into {:?} read by another", cp.dst),
                ));
            }
            let dst = self.store.write(cp.dst).map_err(|m| bad("copy-dst", m))?;
            for l in 0..LANES {
                for r in 0..cp.tokens as usize {
                    dst[l][r] = src[l][r];
                }
            }
        }
        if let Some(pk) = &p.pack {
            let mut pages = Vec::new();
            for k in 0..pk.dst.len() {
                for l in 0..pk.lanes {
                    let s = self
                        .store
                        .read(pk.src[k * pk.lanes + l])
                        .map_err(|m| bad("pack-src", m))?;
                    pages.push(s[l].clone());
                }
            }
            for (k, &d) in pk.dst.iter().enumerate() {
                if readers.contains_key(&d) {
                    return Err(bad(
                        "write-shared",
                        format!("pack into {d:?} read by another"),
                    ));
                }
                if pk.in_place {
                    undo.push((
                        d,
                        self.store.read(d).map_err(|m| bad("pack-dst", m))?.clone(),
                    ));
                }
                let dst = self.store.write(d).map_err(|m| bad("pack-dst", m))?;
                for l in 0..pk.lanes {
                    dst[l] = pages[k * pk.lanes + l].clone();
                }
            }
        }
        if let Some(rp) = &p.rows {
            let bs = rp.block_size as usize;
            let mut rows = Vec::new();
            for &(b, r) in &rp.src {
                let s = self.store.read(b).map_err(|m| bad("rows-src", m))?;
                rows.push((0..LANES).map(|l| s[l][r as usize]).collect::<Vec<_>>());
            }
            for (k, &d) in rp.dst.iter().enumerate() {
                if readers.contains_key(&d) {
                    return Err(bad(
                        "write-shared",
                        format!("rows into {d:?} read by another"),
                    ));
                }
                if rp.in_place {
                    undo.push((
                        d,
                        self.store.read(d).map_err(|m| bad("rows-dst", m))?.clone(),
                    ));
                }
                let dst = self.store.write(d).map_err(|m| bad("rows-dst", m))?;
                for (r, row) in rows.iter().skip(k * bs).take(bs).enumerate() {
                    for (lane, &v) in dst.iter_mut().zip(row) {
                        lane[r] = v;
                    }
                }
            }
        }
        for d in &p.demotions {
            let hot = self
                .store
                .read(d.hot)
                .map_err(|m| bad("demote-src", m))?
                .clone();
            if d.quantize {
                let cold = self.store.write(d.cold).map_err(|m| bad("demote-dst", m))?;
                *cold = hot;
            } else {
                let cold = self
                    .store
                    .read(d.cold)
                    .map_err(|m| bad("reused-cold-gone", m))?;
                if *cold != hot {
                    return Err(bad(
                        "stale-reuse",
                        format!(
                            "demotion {d:?}: the reused cold copy does not hold the hot block's content"
                        ),
                    ));
                }
            }
        }
        // Whether the new tokens attend over the plain prefix.
        let view = self.c.view(id).unwrap();
        let plain = view.entries().iter().all(|e| {
            e.first() >= p.start || (e.slot().is_live() && e.holes() == 0 && !e.is_packed())
        });
        let mut k = 0usize;
        for w in &p.writes {
            if let Some(&rows) = readers.get(&w.block) {
                if w.offset < rows {
                    return Err(bad(
                        "write-shared",
                        format!("write {w:?} into rows another holder reads (0..{rows})"),
                    ));
                }
            }
            let dst = self.store.write(w.block).map_err(|m| bad("write-dst", m))?;
            for r in w.offset..w.offset + w.tokens {
                let pos = p.start + k as u64;
                for lane in dst.iter_mut() {
                    lane[r as usize] = Some((pos, new[k], plain));
                }
                k += 1;
            }
        }
        if k != new.len() {
            return Err(bad(
                "writes",
                format!("plan writes {k} tokens, step has {}", new.len()),
            ));
        }
        Ok(undo)
    }

    fn feed(&mut self, id: SeqId, r: &mut Rng) -> Result<(), Defect> {
        let v = self.c.view(id).unwrap();
        let per = if self.c.wants().grain == Grain::Lane {
            LANES
        } else if self.c.wants().grain == Grain::Row {
            BS as usize
        } else {
            1
        };
        let n = v.entries().len() * per;
        let vals: Vec<f32> = (0..n)
            .map(|_| match r.below(50) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => -1.0,
                _ => (r.below(1000) as f32) / 1000.0,
            })
            .collect();
        let res = if self.c.wants().keys {
            self.c.observe_keys(id, &vals)
        } else if self.c.wants().attention {
            self.c.observe(id, &vals)
        } else {
            Ok(())
        };
        res.map_err(|e| defect("observe", format!("seq {id}: {e}")))
    }

    fn pick(&self, r: &mut Rng, idle: Option<bool>) -> Option<SeqId> {
        let ids: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, m)| idle.is_none_or(|i| m.pending.is_none() == i))
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            None
        } else {
            Some(ids[r.below(ids.len())])
        }
    }

    fn op(&mut self, r: &mut Rng) -> Result<(), Defect> {
        if r.chance(8) {
            return self.extra_op(r);
        }
        let mut roll = r.below(100);
        if self.mix == 1 && r.chance(40) {
            roll = [0, 3, 60, 63, 92, 93][r.below(6)]; // open, register, close
        }
        match roll {
            0..=7 => {
                // open with a prompt sharing a prefix with others
                if self.seqs.len() >= 6 {
                    return Ok(());
                }
                let base = &self.bases[r.below(self.bases.len())];
                let len = 1 + r.below(base.len());
                let mut prompt = base[..len].to_vec();
                let mut extra = ExtraKeys::namespace(match r.below(10) {
                    0 => "b",
                    1 => "a\u{0}salt",
                    _ => "a",
                });
                if r.chance(10) {
                    extra = extra.with_adapter(7);
                }
                // A follow-up request: another sequence's whole history.
                if r.chance(40) {
                    if let Some(o) = self.pick(r, None) {
                        prompt = self.seqs[&o].toks.clone();
                        extra = self.seqs[&o].extra.clone();
                    }
                }
                for _ in 0..r.below(6) {
                    prompt.push(r.below(3) as u32);
                }
                let o = self
                    .c
                    .open(&prompt, &extra)
                    .map_err(|e| defect("open-error", format!("{e}")))?;
                let t = self.c.table(o.seq).unwrap().clone();
                if t.positions() as usize != o.reused {
                    return Err(defect(
                        "open",
                        format!("reused {} but table has {}", o.reused, t.positions()),
                    ));
                }
                self.st.prefix_hits += usize::from(o.reused > 0);
                let toks = prompt[..o.reused].to_vec();
                self.check_table(o.seq, &t, &toks, "opened (prefix hit)")?;
                self.log.push(format!(
                    "open {} prompt {:?} ns {} -> reused {}",
                    o.seq, prompt, extra.namespace, o.reused
                ));
                self.seqs.insert(
                    o.seq,
                    MSeq {
                        toks,
                        queue: prompt[o.reused..].to_vec(),
                        extra,
                        turn: None,
                        pending: None,
                    },
                );
                self.check_all("open")
            }
            8..=44 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                let m = &self.seqs[&id];
                let from_queue = if !m.queue.is_empty() && r.chance(70) {
                    m.queue.len()
                } else {
                    0
                };
                let n = if from_queue > 0 {
                    from_queue
                } else {
                    1 + r.below(2 * BS as usize + 2)
                };
                let mut new: Vec<u32> = m.queue[..from_queue.min(m.queue.len())].to_vec();
                while new.len() < n {
                    new.push(r.below(3) as u32);
                }
                let before = self.snap();
                let idle_before = self.c.counters().evicted_idle_entries;
                // The policy failed on this sequence while another's step
                // asked about it: this, its own next plan, fails with it,
                // changing nothing.
                if self.owes.remove(&id) {
                    let planned = self.c.plan(id, n);
                    self.log.push(format!(
                        "plan {id} {n} owing a policy failure -> {planned:?}"
                    ));
                    if !matches!(planned, Err(CoordError::Policy(_))) {
                        return Err(defect(
                            "idle-policy-failure-lost",
                            format!("seq {id}: {planned:?}"),
                        ));
                    }
                    self.st.policy_failures += 1;
                    self.check_after_refusal(&before, None, "owed policy failure")?;
                    return self.check_all("owed policy failure");
                }
                // Sometimes a failure is injected into one phase: the plan
                // gives back everything it took.
                if r.chance(10) {
                    let phase = Phase::ALL[r.below(Phase::ALL.len())];
                    fail_plan_at(&mut self.c, phase);
                    match self.c.plan(id, n) {
                        Err(CoordError::Injected { .. }) => self.st.injected += 1,
                        Ok(Planned::Full(_)) => {}
                        other => {
                            return Err(defect("injection", format!("{phase:?}: {other:?}")));
                        }
                    }
                    let excuse = (phase >= Phase::Allocate).then_some(idle_before);
                    self.check_after_refusal(
                        &before,
                        excuse,
                        &format!("plan failed at {phase:?}"),
                    )?;
                    self.check_all("injected failure")?;
                    return Ok(());
                }
                let armed = match &self.flaky {
                    Some(fl) if r.chance(10) => {
                        let mut modes = Vec::new();
                        if self.f.cold.is_some() {
                            modes.extend([1u8, 2, 3]);
                        }
                        if self.f.evict != 0 {
                            modes.extend([4u8, 5, 6, 6]);
                        }
                        let m = modes[r.below(modes.len())];
                        let mut g = fl.lock().unwrap();
                        g.armed = m;
                        g.fired = false;
                        g.stepping = id;
                        m
                    }
                    _ => 0,
                };
                let planned = self.c.plan(id, n);
                if armed != 0 {
                    let fl = self.flaky.as_ref().unwrap();
                    let (fired, idle) = {
                        let mut g = fl.lock().unwrap();
                        g.armed = 0;
                        g.tier_error = None;
                        g.evict_error = None;
                        (std::mem::take(&mut g.fired), g.failed_idle.take())
                    };
                    // A failure while an idle sequence was asked is that
                    // sequence's: this plan goes on without its entries.
                    if let Some(x) = idle {
                        self.log
                            .push(format!("policy failed on idle {x} during plan {id}"));
                        self.owes.insert(x);
                    }
                    if fired && idle.is_none() {
                        self.log.push(format!(
                            "plan {id} {n} with policy failure {armed} -> {planned:?}"
                        ));
                        if !matches!(planned, Err(CoordError::Policy(_))) {
                            return Err(defect(
                                "policy-failure-accepted",
                                format!("mode {armed}: {planned:?}"),
                            ));
                        }
                        self.st.policy_failures += 1;
                        self.check_after_refusal(
                            &before,
                            None,
                            &format!("policy failure {armed}"),
                        )?;
                        return self.check_all("policy failure");
                    }
                }
                match planned {
                    Ok(Planned::Full(m)) => {
                        self.st.refused += 1;
                        self.log.push(format!("plan {id} {n} -> {m}"));
                        // A refused plan evicts no idle sequence either.
                        self.check_after_refusal(&before, None, &format!("refused plan {id} {n}"))?;
                        self.check_all("refused plan")
                    }
                    Err(e) => Err(defect("plan-error", format!("seq {id} n {n}: {e}"))),
                    Ok(Planned::Step(p)) => {
                        self.st.plans += 1;
                        self.st.demotions += p.demotions.len();
                        self.st.reused_demotions +=
                            p.demotions.iter().filter(|d| !d.quantize).count();
                        self.st.copies += p.copies.len();
                        self.st.drops += p.drops.len();
                        self.st.packs += usize::from(p.pack.is_some());
                        self.st.in_place_packs +=
                            usize::from(p.pack.as_ref().is_some_and(|x| x.in_place));
                        self.st.row_packs += usize::from(p.rows.is_some());
                        self.st.in_place_rows +=
                            usize::from(p.rows.as_ref().is_some_and(|x| x.in_place));
                        self.log.push(format!(
                            "plan {id} {n} -> start {} writes {:?} copies {:?} demotions {:?} drops {:?} pack {} rows {}",
                            p.start,
                            p.writes.iter().map(|w| (w.block, w.offset, w.tokens)).collect::<Vec<_>>(),
                            p.copies,
                            p.demotions,
                            p.drops,
                            p.pack.as_ref().map_or(0, |x| x.dst.len()),
                            p.rows.as_ref().map_or(0, |x| x.dst.len())
                        ));
                        let undo = self.execute(id, &p, &new)?;
                        // Offer fresh cold blocks to the deduplicator.
                        if self.f.dedup != 0 {
                            for d in p.demotions.iter().filter(|d| d.quantize) {
                                if !r.chance(80) {
                                    continue;
                                }
                                let got = self.offer(id, d.cold)?;
                                self.st.aliases += usize::from(got.is_some());
                                self.log.push(format!("share {id} {:?} -> {got:?}", d.cold));
                            }
                        }
                        self.feed(id, r)?;
                        let m = self.seqs.get_mut(&id).unwrap();
                        m.pending = Some(PendingM {
                            n,
                            undo,
                            from_queue,
                        });
                        m.toks.extend_from_slice(&new);
                        // Check the view reads what it should.
                        let v = self.c.view(id).unwrap().clone();
                        let toks = self.seqs[&id].toks.clone();
                        self.check_table(id, &v, &toks, "view")?;
                        // Abort at once sometimes, and compare.
                        if r.chance(20) {
                            return self.finish(id, false, Some((before, idle_before)));
                        }
                        if r.chance(60) {
                            return self.finish(id, true, None);
                        }
                        Ok(())
                    }
                }
            }
            45..=59 => {
                let Some(id) = self.pick(r, Some(false)) else {
                    return Ok(());
                };
                let commit = r.chance(80);
                self.finish(id, commit, None)
            }
            60..=66 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                let m = &self.seqs[&id];
                let (toks, extra) = (m.toks.clone(), m.extra.clone());
                let got = self
                    .c
                    .register(id, &toks, &extra)
                    .map_err(|e| defect("register-error", format!("seq {id}: {e}")))?;
                self.st.registers += 1;
                self.log.push(format!(
                    "register {id} -> {got}; table {:?}",
                    self.c
                        .table(id)
                        .unwrap()
                        .entries()
                        .iter()
                        .map(|e| (e.slot(), e.first(), e.tokens()))
                        .collect::<Vec<_>>()
                ));
                self.check_all("register")
            }
            67..=68 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                self.c.seal(id).unwrap();
                self.log.push(format!("seal {id}"));
                self.check_all("seal")
            }
            69..=72 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                if self.seqs.len() >= 6 {
                    return Ok(());
                }
                let f = self
                    .c
                    .fork(id)
                    .map_err(|e| defect("fork-error", format!("{e}")))?;
                let mut m = self.seqs[&id].clone();
                m.turn = None;
                m.pending = None;
                self.seqs.insert(f, m);
                self.st.forks += 1;
                self.log.push(format!("fork {id} -> {f}"));
                self.check_all("fork")
            }
            73..=78 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                if self.seqs[&id].turn.is_some() {
                    return Ok(());
                }
                self.c.begin_turn(id).unwrap();
                let t = self.c.table(id).unwrap().clone();
                let m = self.seqs.get_mut(&id).unwrap();
                m.turn = Some((t, m.toks.len(), m.queue.clone()));
                self.st.turns += 1;
                self.log.push(format!("begin_turn {id}"));
                self.check_all("begin_turn")
            }
            79..=86 => {
                let Some(id) = self.pick(r, Some(true)) else {
                    return Ok(());
                };
                if self.seqs[&id].turn.is_none() && r.chance(70) {
                    return Ok(());
                }
                let end = self.seqs[&id].toks.len() as u64;
                let start = self.seqs[&id].turn.as_ref().map_or(0, |t| t.1 as u64);
                let mut t = kvforge_coordinator::TurnInput::default();
                for _ in 0..r.below(3) {
                    t.cuts.push(r.below(end as usize + 3) as u64);
                }
                if r.chance(70) {
                    t.tokens = self.seqs[&id].toks.clone();
                }
                if r.chance(30) {
                    t.refer = Some(start..(start + r.below(8) as u64));
                }
                if r.chance(30) {
                    use kvforge_coordinator::Label;
                    let segs = self.c.turn_segments(id, &t.cuts).unwrap();
                    let n = segs.len() + r.below(2);
                    t.model = Some(
                        (0..n)
                            .map(|_| [Label::Keep, Label::Drop, Label::Compress][r.below(3)])
                            .collect(),
                    );
                }
                let out = self
                    .c
                    .end_turn_labelled(id, &t)
                    .map_err(|e| defect("end-turn-error", format!("{e}")))?;
                let d = out.dropped_entries;
                self.seqs.get_mut(&id).unwrap().turn = None;
                self.check_all("end_turn")?;
                for seg in out.outcome.compress {
                    let replaced = r.chance(50);
                    let k = self
                        .c
                        .compressed(id, seg.clone(), replaced)
                        .map_err(|e| defect("compressed-error", format!("{e}")))?;
                    self.log
                        .push(format!("compressed {id} {seg:?} {replaced} -> {k}"));
                    self.answered.push((id, seg));
                    self.check_all("compressed")?;
                }
                self.st.end_turns += 1;
                self.st.lifecycle_drops += d;
                self.log.push(format!("end_turn {id} -> dropped {d}"));
                self.check_all("end_turn")
            }
            87..=90 => {
                let Some(id) = self.pick(r, None) else {
                    return Ok(());
                };
                if self.seqs[&id].turn.is_none() {
                    return Ok(());
                }
                self.undo_pending(id);
                self.c
                    .rollback_turn(id)
                    .map_err(|e| defect("rollback-error", format!("{e}")))?;
                let m = self.seqs.get_mut(&id).unwrap();
                let (st, len, q) = m.turn.take().unwrap();
                m.toks.truncate(len);
                m.queue = q;
                m.pending = None;
                let now = self.c.table(id).unwrap();
                if !restored(now, &st) {
                    return Err(defect(
                        "rollback-inexact",
                        format!(
                            "seq {id}: table after rollback {:?} != snapshot {:?}",
                            now, st
                        ),
                    ));
                }
                self.st.rollbacks += 1;
                self.log.push(format!("rollback_turn {id}"));
                self.check_all("rollback")
            }
            91..=96 => {
                let Some(id) = self.pick(r, None) else {
                    return Ok(());
                };
                if r.chance(40) {
                    return Ok(());
                }
                self.undo_pending(id);
                self.c
                    .close(id)
                    .map_err(|e| defect("close-error", format!("{e}")))?;
                self.seqs.remove(&id);
                self.owes.remove(&id);
                self.st.closes += 1;
                self.log.push(format!("close {id}"));
                self.check_all("close")
            }
            _ => {
                // Bad calls: must be errors that change nothing.
                self.st.bad_calls += 1;
                let before = self.snap();
                let id = self.pick(r, None).unwrap_or(999);
                let k = r.below(7);
                let res: Result<(), CoordError> =
                    match k {
                        0 => self.c.plan(id, 0).map(|_| ()),
                        1 => self.c.plan(10_000, 1).map(|_| ()),
                        2 => {
                            if self.seqs.get(&id).is_some_and(|m| m.pending.is_none()) {
                                self.c.commit(id)
                            } else {
                                Err(CoordError::UnknownSeq(0))
                            }
                        }
                        3 => {
                            // Without a turn, also with a step in flight
                            // (which must stay in flight).
                            if self.seqs.get(&id).is_some_and(|m| m.turn.is_none()) {
                                self.c.rollback_turn(id)
                            } else {
                                Err(CoordError::UnknownSeq(0))
                            }
                        }
                        4 => self.c.observe(id, &[0.5; 1000]),
                        6 => {
                            // A segment never handed out for summarising,
                            // or one answered already.
                            let seg = match self.answered.iter().find(|a| a.0 == id) {
                                Some(a) if r.chance(50) => a.1.clone(),
                                _ => {
                                    let start = r.below(40) as u64;
                                    Segment {
                                        id: r.below(8) as u32,
                                        range: start..start + 1 + r.below(12) as u64,
                                        turn: r.below(4) as u32,
                                    }
                                }
                            };
                            if self.seqs.get(&id).is_some_and(|m| m.pending.is_none()) {
                                self.c.compressed(id, seg, r.chance(50)).map(|_| ())
                            } else {
                                Err(CoordError::UnknownSeq(0))
                            }
                        }

                        _ => {
                            let live0 =
                                self.seqs.contains_key(&id)
                                    && self.c.table(id).unwrap().entries().first().is_some_and(
                                        |e| {
                                            matches!(e.slot(), Slot::Hot(_) | Slot::Cold(_))
                                                && !e.is_packed()
                                        },
                                    );
                            if self.f.prefix.is_some() && live0 && self.seqs[&id].pending.is_none()
                            {
                                let ex = self.seqs[&id].extra.clone();
                                // Fewer tokens than the table holds (under
                                // `Seal` too: nothing may be sealed).
                                match self.c.register(id, &[], &ex) {
                                    // Nothing covered (a holed first entry):
                                    // a registration of nothing, which may seal.
                                    Ok(0) => return Ok(()),
                                    r => r.map(|_| ()),
                                }
                            } else {
                                Err(CoordError::UnknownSeq(0))
                            }
                        }
                    };
                if res.is_ok() && k != 4 {
                    return Err(defect(
                        "bad-call-accepted",
                        format!("bad call {k} on {id} accepted"),
                    ));
                }
                let after = self.snap();
                if res.is_err() && after != before {
                    return Err(defect(
                        "bad-call-changed",
                        format!("bad call {k} on {id}: {before:?} -> {after:?}"),
                    ));
                }
                Ok(())
            }
        }
    }

    /// An import of remote blocks, or a preemption by recompute.
    fn extra_op(&mut self, r: &mut Rng) -> Result<(), Defect> {
        let Some(id) = self.pick(r, Some(true)) else {
            return Ok(());
        };
        if r.chance(60) {
            let tier = if self.f.cold.is_some() && r.chance(50) {
                COLD
            } else {
                HOT
            };
            let n = 1 + r.below(4);
            let before = self.snap();
            let room = self.c.import_room(id, tier);
            // The position the caller expects to append at: the model's
            // own count, or (now and then) one a block off, which must be
            // refused with nothing changed.
            let end = self.seqs[&id].toks.len() as u64;
            let wrong = r.chance(15);
            let at = if !wrong {
                end
            } else if end >= u64::from(BS) && r.chance(50) {
                end - u64::from(BS)
            } else {
                end + u64::from(BS)
            };
            return match self.c.import(id, tier, at, n) {
                Err(CoordError::Order { .. }) if wrong => {
                    self.st.refused_imports += 1;
                    self.check_after_refusal(&before, None, "import at a wrong position")?;
                    self.check_all("import at a wrong position")
                }
                Ok(blocks) if wrong => Err(defect(
                    "import-position",
                    format!(
                        "seq {id} ends at {end}: {} blocks imported at {at}",
                        blocks.len()
                    ),
                )),
                Err(CoordError::Order { .. }) => {
                    self.st.refused_imports += 1;
                    if room != 0 {
                        return Err(defect(
                            "import-room",
                            format!("seq {id}: refused, room {room}"),
                        ));
                    }
                    self.check_after_refusal(&before, None, "refused import")?;
                    self.check_all("refused import")
                }
                Err(e) => Err(defect("import-error", format!("seq {id}: {e}"))),
                Ok(blocks) => {
                    if blocks.len() != n.min(room) {
                        return Err(defect(
                            "import-room",
                            format!("seq {id}: {} of {n} imported, room {room}", blocks.len()),
                        ));
                    }
                    let m = self.seqs.get_mut(&id).unwrap();
                    let start = m.toks.len() as u64;
                    let mut k = 0u64;
                    for &b in &blocks {
                        let dst = self
                            .store
                            .write(b)
                            .map_err(|e| defect("import-dst", format!("{b:?}: {e}")))?;
                        for row in 0..BS as usize {
                            let tok = if m.queue.is_empty() {
                                r.below(3) as u32
                            } else {
                                m.queue.remove(0)
                            };
                            for lane in dst.iter_mut() {
                                lane[row] = Some((start + k, tok, true));
                            }
                            m.toks.push(tok);
                            k += 1;
                        }
                    }
                    self.st.imports += 1;
                    self.st.imported_blocks += blocks.len();
                    self.log
                        .push(format!("import {id} tier {tier} {n} -> {blocks:?}"));
                    self.check_all("import")
                }
            };
        }
        // Preemption by recompute (server/src/sched): register what it
        // holds, free it, reopen with the whole context.
        if self.f.prefix.is_none() || self.seqs[&id].turn.is_some() {
            return Ok(());
        }
        let m = self.seqs[&id].clone();
        let got = self
            .c
            .register(id, &m.toks, &m.extra)
            .map_err(|e| defect("register-error", format!("seq {id}: {e}")))?;
        self.c
            .close(id)
            .map_err(|e| defect("close-error", format!("{e}")))?;
        self.seqs.remove(&id);
        self.owes.remove(&id);
        self.check_all("preempt")?;
        let mut prompt = m.toks.clone();
        prompt.extend_from_slice(&m.queue);
        if prompt.is_empty() {
            return Ok(());
        }
        let o = self
            .c
            .open(&prompt, &m.extra)
            .map_err(|e| defect("open-error", format!("{e}")))?;
        let t = self.c.table(o.seq).unwrap().clone();
        let toks = prompt[..o.reused].to_vec();
        self.check_table(o.seq, &t, &toks, "opened (prefix hit after preemption)")?;
        self.st.preempts += 1;
        self.st.prefix_hits += usize::from(o.reused > 0);
        self.log.push(format!(
            "preempt {id} (registered {got}) -> reopened {} reused {}",
            o.seq, o.reused
        ));
        self.seqs.insert(
            o.seq,
            MSeq {
                toks,
                queue: prompt[o.reused..].to_vec(),
                extra: m.extra,
                turn: None,
                pending: None,
            },
        );
        self.check_all("reopen")
    }

    /// After a refused call (`idle_before: None`: exactly as before) or an
    /// abort (`Some(idle evictions before the plan)`: the documented
    /// exceptions: the index forgot reclaimed blocks, idle sequences lost
    /// entries to the aborted step).
    fn check_after_refusal(
        &self,
        before: &Snap,
        idle_before: Option<u64>,
        what: &str,
    ) -> Result<(), Defect> {
        let after = self.snap();
        if after == *before {
            return Ok(());
        }
        let Some(idle_before) = idle_before else {
            return Err(defect(
                "refusal-changed",
                format!("{what}: before {before:?}\n after {after:?}"),
            ));
        };
        if self.c.counters().evicted_idle_entries != idle_before {
            return Ok(()); // documented: idle sequences' evictions are not undone
        }
        // Reclaimed cached blocks are forgotten by the index: allowed.
        let only_index = Snap {
            index: after.index,
            ..Snap {
                tables: after.tables.clone(),
                counts: after.counts.clone(),
                in_use: after.in_use.clone(),
                index: None,
            }
        };
        let b2 = Snap {
            tables: before.tables.clone(),
            counts: before.counts.clone(),
            in_use: before.in_use.clone(),
            index: after.index,
        };
        if only_index == b2 {
            let (bi, ai) = (before.index.unwrap(), after.index.unwrap());
            if ai.forgotten_blocks > bi.forgotten_blocks {
                return Ok(());
            }
        }
        Err(defect(
            "inexact-undo",
            format!("{what}: before {before:?}\n after {after:?}"),
        ))
    }

    fn undo_pending(&mut self, id: SeqId) {
        if let Some(p) = self.seqs.get_mut(&id).unwrap().pending.take() {
            for (b, c) in p.undo.into_iter().rev() {
                if let Some(Stored::Live(e, old)) = self.store.blocks.get_mut(&b.index()) {
                    if *e == b.epoch() {
                        *old = c;
                    }
                }
            }
            let m = self.seqs.get_mut(&id).unwrap();
            let len = m.toks.len() - p.n;
            m.toks.truncate(len);
        }
    }

    fn finish(&mut self, id: SeqId, commit: bool, cmp: Option<(Snap, u64)>) -> Result<(), Defect> {
        if commit {
            self.c
                .commit(id)
                .map_err(|e| defect("commit-error", format!("seq {id}: {e}")))?;
            let m = self.seqs.get_mut(&id).unwrap();
            let p = m.pending.take().unwrap();
            if p.from_queue > 0 {
                m.queue.drain(..p.from_queue);
            }
            self.st.commits += 1;
            self.log.push(format!("commit {id}"));
            self.check_all("commit")
        } else {
            self.undo_pending(id);
            self.c
                .abort(id)
                .map_err(|e| defect("abort-error", format!("seq {id}: {e}")))?;
            self.st.aborts += 1;
            self.log.push(format!("abort {id}"));
            if let Some((before, idle)) = cmp {
                self.check_after_refusal(&before, Some(idle), &format!("abort {id}"))?;
            }
            self.check_all("abort")
        }
    }

    fn close_all(&mut self) -> Result<(), Defect> {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.undo_pending(id);
            self.c
                .close(id)
                .map_err(|e| defect("close-error", format!("{e}")))?;
            self.seqs.remove(&id);
            self.owes.remove(&id);
            self.check_all("close_all")?;
        }
        if self.c.bytes_in_use() != 0 || self.c.tier_stats().iter().any(|t| t.pool.in_use != 0) {
            return Err(defect(
                "leak-at-end",
                format!(
                    "{} bytes in use after every sequence closed: {:?}",
                    self.c.bytes_in_use(),
                    self.c.tier_stats()
                ),
            ));
        }
        Ok(())
    }
}

fn run_case(seed: u64, ops: usize) -> Result<(Feat, Stats), (Feat, Defect, Vec<String>)> {
    let mut r = Rng(seed);
    let (f, c, flaky) = make(&mut r);
    let bases = (0..3)
        .map(|_| (0..24).map(|_| 10 + r.below(50) as u32).collect())
        .collect();
    let mut w = World {
        st: Stats::default(),
        c,
        f,
        store: Store::default(),
        seqs: BTreeMap::new(),
        bases,
        log: Vec::new(),
        mix: (seed % 2) as u8,
        answered: Vec::new(),
        flaky,
        owes: Default::default(),
    };
    for i in 0..ops {
        if let Err(d) = w.op(&mut r) {
            let log = w.log.clone();
            return Err((f, defect(d.kind, format!("op {i}: {}", d.what)), log));
        }
    }
    if let Err(d) = w.close_all() {
        return Err((f, d, w.log.clone()));
    }
    w.st.idle_evictions = w.c.counters().evicted_idle_entries;
    Ok((f, w.st))
}

#[test]
fn random_operations_with_imports_preemption_and_failing_policies() {
    let cases = knob("KVFORGE_MODEL_CASES", 1500);
    let ops = knob("KVFORGE_MODEL_OPS", 200) as usize;
    let only: Option<u64> = std::env::var("KVFORGE_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    let mut kinds: BTreeMap<&'static str, (usize, u64, String)> = BTreeMap::new();
    let mut steps = Stats::default();
    let mut by_evict = [0usize; 6];
    let (mut with_cold, mut with_prefix) = (0, 0);
    let (mut with_dedup, mut with_life) = ([0usize; 3], [0usize; 4]);
    let seeds: Vec<u64> = match only {
        Some(s) => vec![s],
        None => (1..=cases).collect(),
    };
    for &seed in &seeds {
        match run_case(seed, ops) {
            Ok((f, s)) => {
                steps.add(&s);
                by_evict[f.evict as usize] += 1;
                with_cold += usize::from(f.cold.is_some());
                with_prefix += usize::from(f.prefix.is_some());
                with_dedup[f.dedup as usize] += 1;
                with_life[f.lifecycle as usize] += 1;
                let _ = (f.hot_blocks, f.budget_blocks);
            }
            Err((f, d, log)) => {
                if only.is_some() {
                    println!("feat {f:?}");
                    for l in &log {
                        println!("  {l}");
                    }
                }
                let e = kinds
                    .entry(d.kind)
                    .or_insert((0, seed, format!("{f:?}\n    {}", d.what)));
                e.0 += 1;
                if e.0 <= 12 {
                    e.2.push_str(&format!(
                        "\n    also seed {seed}: evict {} prefix {:?} cold {:?}",
                        f.evict, f.prefix, f.cold
                    ));
                }
            }
        }
    }
    println!(
        "{} cases x {ops} ops; passing cases: {steps:?}",
        seeds.len()
    );
    println!(
        "  eviction none/sinkwindow/lfu/per-head/per-token/keydiff: {by_evict:?}; cold {with_cold}, prefix {with_prefix}, dedup none/exact/simhash {with_dedup:?}, lifecycle none/recent/labels/custom {with_life:?}"
    );
    for (k, (n, seed, what)) in &kinds {
        println!("DEFECT {k}: {n} cases, first seed {seed}\n    {what}");
    }
    assert!(
        kinds.is_empty(),
        "defects found: {:?}",
        kinds.keys().collect::<Vec<_>>()
    );
}

/// A turn of one sequence (others idle), any number of committed and
/// aborted steps with demotions, drops, packs, copies and aliases, then
/// rollback_turn: tables, every count, bytes per tier and index stats are
/// as at begin_turn (the index may only have forgotten reclaimed blocks).
#[test]
fn rollback_turn_restores_everything_exactly() {
    let cases = knob("KVFORGE_MODEL_CASES", 1500) / 4;
    let mut done = 0;
    let mut excused = 0;
    let mut steps = 0;
    let mut failures: Vec<(u64, String)> = Vec::new();
    for seed in 1..=cases {
        let mut r = Rng(seed ^ 0xabcdef);
        let (f, c, flaky) = make(&mut r);
        let bases = (0..2)
            .map(|_| (0..24).map(|_| 10 + r.below(50) as u32).collect())
            .collect();
        let mut w = World {
            st: Stats::default(),
            c,
            f,
            store: Store::default(),
            seqs: BTreeMap::new(),
            bases,
            log: Vec::new(),
            mix: 1,
            answered: Vec::new(),
            flaky,
            owes: Default::default(),
        };
        // Some history: other sequences, registrations.
        let mut ok = true;
        for _ in 0..40 {
            if w.op(&mut r).is_err() {
                ok = false;
                break;
            }
        }
        if !ok {
            continue;
        }
        let ids: Vec<SeqId> = w.seqs.keys().copied().collect();
        for &id in &ids {
            w.undo_pending(id);
            let _ = w.c.abort(id);
            if w.seqs[&id].turn.is_some() {
                w.c.end_turn(id).unwrap();
                w.seqs.get_mut(&id).unwrap().turn = None;
            }
        }
        let Some(&id) = ids.first() else { continue };
        let before = w.snap();
        let idle_before = w.c.counters().evicted_idle_entries;
        w.c.begin_turn(id).unwrap();
        let t = w.c.table(id).unwrap().clone();
        let len = w.seqs[&id].toks.len();
        let q = w.seqs[&id].queue.clone();
        w.seqs.get_mut(&id).unwrap().turn = Some((t, len, q));
        let forgotten = w.c.index_stats().map(|s| s.forgotten_blocks);
        for _ in 0..(1 + r.below(12)) {
            let n = 1 + r.below(9);
            let new: Vec<u32> = (0..n).map(|_| r.below(3) as u32).collect();
            let Ok(Planned::Step(p)) = w.c.plan(id, n) else {
                continue;
            };
            let undo = match w.execute(id, &p, &new) {
                Ok(u) => u,
                Err(d) => {
                    failures.push((seed, d.what));
                    break;
                }
            };
            if w.f.dedup != 0 {
                for d in p.demotions.iter().filter(|d| d.quantize) {
                    w.offer(id, d.cold).unwrap();
                }
            }
            let _ = w.feed(id, &mut r);
            if r.chance(75) {
                w.c.commit(id).unwrap();
                w.seqs.get_mut(&id).unwrap().toks.extend_from_slice(&new);
                steps += 1;
            } else {
                for (b, c) in undo.into_iter().rev() {
                    w.store.blocks.insert(b.index(), Stored::Live(b.epoch(), c));
                }
                w.c.abort(id).unwrap();
            }
        }
        w.c.rollback_turn(id).unwrap();
        let m = w.seqs.get_mut(&id).unwrap();
        let (_, len, _) = m.turn.take().unwrap();
        m.toks.truncate(len);
        let after = w.snap();
        let reclaimed = w.c.index_stats().map(|s| s.forgotten_blocks) != forgotten;
        if w.c.counters().evicted_idle_entries != idle_before {
            excused += 1; // documented: other idle sequences lost entries to this turn's steps
            let _ = w.close_all();
            continue;
        }
        let same = if reclaimed {
            after.tables == before.tables
                && after.counts == before.counts
                && after.in_use == before.in_use
        } else {
            after == before
        };
        if !same {
            failures.push((seed, format!("{f:?}\n before {before:?}\n after {after:?}")));
        }
        if let Err(d) = w.check_all("after rollback") {
            failures.push((seed, format!("{}: {}", d.kind, d.what)));
        }
        if let Err(d) = w.close_all() {
            failures.push((seed, format!("{}: {}", d.kind, d.what)));
        }
        done += 1;
    }
    println!(
        "rollback: {done} turns rolled back after {steps} committed steps ({excused} more skipped: idle sequences evicted)"
    );
    for (s, f) in failures.iter().take(3) {
        println!("seed {s}: {f}");
    }
    assert!(failures.is_empty(), "{} failures", failures.len());
}

/// Many threads over one coordinator (behind a mutex: its API takes
/// `&mut self`), steps interleaved across threads between plan and
/// commit; reference counts checked whenever no step is in flight;
/// everything closed at the end leaves nothing in use.
#[test]
fn threads_interleaving_steps_keep_counts_exact_and_leak_nothing() {
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    struct Shared {
        c: Coordinator,
        snaps: HashMap<SeqId, BlockTable>,
        pending: HashSet<SeqId>,
        checks: usize,
    }
    fn check(s: &mut Shared, seqs: &[SeqId]) {
        if !s.pending.is_empty() {
            return;
        }
        s.checks += 1;
        let mut mult: HashMap<BlockId, u32> = HashMap::new();
        for &id in seqs {
            for b in s.c.table(id).unwrap().held() {
                *mult.entry(b).or_default() += 1;
            }
        }
        for t in s.snaps.values() {
            for b in t.held() {
                *mult.entry(b).or_default() += 1;
            }
        }
        for (&b, &n) in &mult {
            assert_eq!(s.c.pools().ref_count(b), Ok(n), "{b:?}");
        }
        for (t, st) in s.c.tier_stats().iter().enumerate() {
            let d = mult
                .keys()
                .filter(|b| TieredPool::tier_of(**b) == t)
                .count();
            assert_eq!(st.pool.in_use, d, "tier {t}");
        }
    }
    let rounds = knob("KVFORGE_MODEL_THREAD_ROUNDS", 20);
    let mut total_ops = 0usize;
    let mut total_checks = 0usize;
    for round in 0..rounds {
        let mut cfg = CoordinatorConfig::new(layout(), 48);
        cfg.prefix = Some(PrefixConfig {
            index: if round % 2 == 0 {
                IndexKind::HashChain
            } else {
                IndexKind::Radix
            },
            seed: Some(1),
            tail: [TurnTail::Copy, TurnTail::Seal, TurnTail::Skip][(round % 3) as usize],
        });
        let int4 = StorageFormat::Int4 { group_size: 8 };
        cfg.cold = Some(ColdConfig {
            format: int4,
            value_format: int4,
            window: 8,
            sink: 4,
        });
        cfg.eviction = Some(EvictionConfig::SinkWindow {
            sink: 4,
            window: 16,
        });
        cfg.lifecycle = (round % 4 == 1).then_some(LifecycleConfig::RecentTurns { keep: 1 });
        if round % 3 == 2 {
            cfg.budget_bytes = 30 * layout().block_bytes();
        }
        let sh = Arc::new(Mutex::new(Shared {
            c: Coordinator::new(cfg).unwrap(),
            snaps: HashMap::new(),
            pending: HashSet::new(),
            checks: 0,
        }));
        let all: Arc<Mutex<Vec<SeqId>>> = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let sh = sh.clone();
                let all = all.clone();
                std::thread::spawn(move || {
                    let mut r = Rng(round * 1000 + t);
                    let base: Vec<u32> = (0..40).map(|i| 100 + (i * 7 % 13)).collect();
                    let mut mine: Vec<(SeqId, Vec<u32>)> = Vec::new();
                    let mut ops = 0;
                    for _ in 0..300 {
                        ops += 1;
                        let k = r.below(10);
                        let mut g = sh.lock().unwrap();
                        let ids = all.lock().unwrap().clone();
                        match k {
                            0 | 1 if mine.len() < 3 => {
                                let len = 1 + r.below(base.len());
                                let mut p = base[..len].to_vec();
                                p.push(r.below(5) as u32);
                                let o = g.c.open(&p, &ExtraKeys::namespace("t")).unwrap();
                                all.lock().unwrap().push(o.seq);
                                let toks = p[..o.reused].to_vec();
                                mine.push((o.seq, toks));
                            }
                            2..=5 if !mine.is_empty() => {
                                let i = r.below(mine.len());
                                let id = mine[i].0;
                                let n = 1 + r.below(9);
                                match g.c.plan(id, n) {
                                    Ok(Planned::Step(_)) => {
                                        g.pending.insert(id);
                                        drop(g);
                                        std::thread::yield_now();
                                        let mut g = sh.lock().unwrap();
                                        if r.chance(80) {
                                            g.c.commit(id).unwrap();
                                            let toks = &mut mine[i].1;
                                            for _ in 0..n {
                                                toks.push(r.below(5) as u32);
                                            }
                                        } else {
                                            g.c.abort(id).unwrap();
                                        }
                                        g.pending.remove(&id);
                                        let ids = all.lock().unwrap().clone();
                                        check(&mut g, &ids);
                                        continue;
                                    }
                                    Ok(Planned::Full(_)) => {}
                                    Err(e) => panic!("plan: {e}"),
                                }
                            }
                            6 if !mine.is_empty() => {
                                let (id, toks) = &mine[r.below(mine.len())];
                                g.c.register(*id, toks, &ExtraKeys::namespace("t")).unwrap();
                            }
                            7 if !mine.is_empty() => {
                                let id = mine[r.below(mine.len())].0;
                                if let Some(snap) = g.snaps.remove(&id) {
                                    if r.chance(50) {
                                        g.c.rollback_turn(id).unwrap();
                                        let now = g.c.table(id).unwrap();
                                        assert!(restored(now, &snap), "{now:?} != {snap:?}");
                                        // The model's tokens: cut back to the snapshot.
                                        let len = snap.positions() as usize;
                                        for m in mine.iter_mut().filter(|m| m.0 == id) {
                                            m.1.truncate(len);
                                        }
                                    } else {
                                        g.c.end_turn(id).unwrap();
                                    }
                                } else {
                                    g.c.begin_turn(id).unwrap();
                                    let t = g.c.table(id).unwrap().clone();
                                    g.snaps.insert(id, t);
                                }
                            }
                            8 if !mine.is_empty() && mine.len() < 3 => {
                                let (id, toks) = mine[r.below(mine.len())].clone();
                                if !g.snaps.contains_key(&id) {
                                    let f = g.c.fork(id).unwrap();
                                    all.lock().unwrap().push(f);
                                    mine.push((f, toks));
                                }
                            }
                            _ if !mine.is_empty() => {
                                let (id, _) = mine.swap_remove(r.below(mine.len()));
                                g.c.close(id).unwrap();
                                g.snaps.remove(&id);
                                all.lock().unwrap().retain(|&x| x != id);
                            }
                            _ => {}
                        }
                        let ids2 = all.lock().unwrap().clone();
                        let _ = ids;
                        check(&mut g, &ids2);
                    }
                    let mut g = sh.lock().unwrap();
                    for (id, _) in mine {
                        g.c.close(id).unwrap();
                        g.snaps.remove(&id);
                        all.lock().unwrap().retain(|&x| x != id);
                    }
                    ops
                })
            })
            .collect();
        for h in handles {
            total_ops += h.join().unwrap();
        }
        let g = sh.lock().unwrap();
        total_checks += g.checks;
        assert_eq!(g.c.sequences(), 0);
        assert_eq!(
            g.c.bytes_in_use(),
            0,
            "round {round}: {:?}",
            g.c.tier_stats()
        );
    }
    println!(
        "threads: {rounds} rounds x 8 threads, {total_ops} ops, {total_checks} full count checks"
    );
}
