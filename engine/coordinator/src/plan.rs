//! What one step asks of the engine.

use kvforge_pool::BlockId;

/// New tokens written into one hot block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Write {
    /// The hot block (global handle; its slot in the hot tier is
    /// `TieredPool::slot_of(block)`).
    pub block: BlockId,
    /// Offset of the first token in the block.
    pub offset: u32,
    /// Tokens written.
    pub tokens: u32,
}

/// A hot block quantized into a cold one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demotion {
    /// The entry of the step's table.
    pub entry: usize,
    /// The hot block read.
    pub hot: BlockId,
    /// The cold block written.
    pub cold: BlockId,
    /// Whether the engine must quantize: `false` when another sequence
    /// already demoted this very block and `cold` is that copy, reused as
    /// is (never quantized twice).
    pub quantize: bool,
}

/// Tokens copied from a shared block into a fresh one of the sequence's
/// own (a cached partial block that the sequence continues).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    /// Read.
    pub src: BlockId,
    /// Written.
    pub dst: BlockId,
    /// Leading tokens copied.
    pub tokens: u32,
}

/// Head-wise eviction: each lane (one layer's one KV head) of block
/// `dst[k]` takes the page of the same lane of block `src[k × lanes +
/// lane]` — the lane's k-th surviving page among the entries packed. All
/// sources are read before any destination is written.
///
/// Copy-on-write (`in_place == false`): `dst` are fresh blocks, one per
/// packed entry. In place: `dst` are the packed entries' own blocks, all of
/// them, and each lane's sources are a permutation of them (the surviving
/// pages first, then the dropped ones, each in order), so the engine can
/// undo it exactly by moving every page back (`dst[k]` → `src[k × lanes +
/// lane]`) when the step is aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pack {
    /// Lanes per block: layers × KV heads, lane `layer × kv_heads + head`.
    pub lanes: usize,
    /// The blocks written.
    pub dst: Vec<BlockId>,
    /// Where each of their lanes is read from (still held during the step).
    pub src: Vec<BlockId>,
    /// The blocks are permuted where they are (no other holder, no index).
    pub in_place: bool,
}

/// Token-level eviction's compaction: row `r` of block `dst[k]` takes row
/// `src[k × block_size + r].1` of block `src[k × block_size + r].0` (all
/// layers and KV heads alike) — the live rows of the compacted entries in
/// position order, then their holes. All sources are read before any
/// destination is written.
///
/// Copy-on-write (`in_place == false`): `dst` are fresh blocks. In place:
/// `dst` are the compacted entries' own blocks, all of them, and `src` is a
/// permutation of all their rows, so the engine can undo it exactly by
/// moving every row back when the step is aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowPack {
    /// Tokens per block.
    pub block_size: u32,
    /// The blocks written.
    pub dst: Vec<BlockId>,
    /// Where each of their rows is read from (still held during the step).
    pub src: Vec<(BlockId, u32)>,
    /// The rows are permuted where they are (no other holder, no index).
    pub in_place: bool,
}

/// One step of one sequence: carry out `copies`, `pack` / `rows`, then `demotions`, then
/// write the new tokens' K/V at `writes` while attending over
/// [`Coordinator::view`](crate::Coordinator::view); then
/// [`commit`](crate::Coordinator::commit), or
/// [`abort`](crate::Coordinator::abort) if anything failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Position of the first new token.
    pub start: u64,
    /// Where the new tokens go, in order.
    pub writes: Vec<Write>,
    /// Blocks copied before the step.
    pub copies: Vec<CopyOp>,
    /// Hot blocks quantized into cold ones before the step.
    pub demotions: Vec<Demotion>,
    /// Entries dropped by this step (eviction): attention skips them.
    pub drops: Vec<usize>,
    /// Pages packed by head-wise eviction, before the step.
    pub pack: Option<Pack>,
    /// Rows compacted by token-level eviction, before the step.
    pub rows: Option<RowPack>,
    /// What the engine reports back for this step, and at what grain.
    pub wants: Wants,
}

/// What the policies ask the engine to observe during a step: answered
/// once, in the [`Plan`], so the engine carries a step out without asking
/// the coordinator anything between `plan` and `commit`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wants {
    /// Attention mass per signal slot
    /// ([`Coordinator::observe`](crate::Coordinator::observe)).
    pub attention: bool,
    /// Key novelty per signal slot (KeyDiff's signal).
    pub keys: bool,
    /// The mass from the step's last `window` queries (0: all of them;
    /// SnapKV's observation window).
    pub window: usize,
    /// What one signal slot is: an entry, a lane of it, or a row of it.
    pub grain: Grain,
    /// Whether the blocks this step quantizes are offered for sharing
    /// ([`Coordinator::share`](crate::Coordinator::share)).
    pub share: bool,
    /// Whether sharing compares their vectors (else their bytes).
    pub share_vectors: bool,
}

/// What the eviction policy ranks, and so what one signal slot counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Grain {
    /// Whole entries: one slot per entry of the table.
    #[default]
    Entry,
    /// Each layer's each KV head's page: `layers × kv_heads` slots per
    /// entry, lane `layer × kv_heads + head`.
    Lane,
    /// Single tokens: `block_size` slots per entry, one per row.
    Row,
}

impl Plan {
    /// Tokens the step adds.
    pub fn tokens(&self) -> usize {
        self.writes.iter().map(|w| w.tokens as usize).sum()
    }
}

/// Names one sequence of a coordinator.
pub type SeqId = u64;

/// What [`Coordinator::plan`](crate::Coordinator::plan) decided: the step,
/// or that it does not fit. Running out is an outcome the caller handles
/// (wait, preempt, evict harder, refuse the request), not an error: a
/// `Full` step changed nothing (as an error does not).
#[must_use = "a step that does not fit must be handled"]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned {
    /// The step fits: carry it out, then commit or abort it.
    Step(Plan),
    /// It does not; nothing was taken.
    Full(Shortfall),
}

impl Planned {
    /// The plan, or `None` when the step does not fit.
    pub fn step(self) -> Option<Plan> {
        match self {
            Planned::Step(p) => Some(p),
            Planned::Full(_) => None,
        }
    }
}

/// Why a step does not fit, in numbers a caller can act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a step of {tokens} tokens of sequence {seq} does not fit: {lack}")]
pub struct Shortfall {
    /// The sequence.
    pub seq: SeqId,
    /// New tokens the step asked for.
    pub tokens: usize,
    /// What ran out.
    pub lack: Lack,
}

/// What a step that does not fit runs out of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Lack {
    /// Bytes in use after the step (idle sequences' cuts counted) would
    /// exceed the byte budget (`need` is `u64::MAX` when the sum
    /// overflows).
    #[error("it needs {need} bytes of KV, over the budget of {budget} bytes")]
    Bytes {
        /// Bytes in use the step would leave.
        need: u64,
        /// The budget.
        budget: u64,
    },
    /// A tier has too few free blocks (cached ones and idle sequences'
    /// cuts counted free).
    #[error("{need} more blocks of tier {tier} needed, {free} of {capacity} free")]
    Blocks {
        /// [`HOT`](crate::HOT) or [`COLD`](crate::COLD).
        tier: usize,
        /// Blocks the step needs there.
        need: usize,
        /// Blocks it could have.
        free: usize,
        /// The tier's size in blocks.
        capacity: usize,
    },
}

/// The phases of a plan, in order (where a test injects a failure:
/// [`testing::fail_plan_at`](crate::testing::fail_plan_at)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The stepping sequence's own eviction victims.
    Evict,
    /// Head-wise packing or token-level compaction worked out.
    Pack,
    /// The tier policy's demotions checked; cold copies to reuse chosen.
    Demote,
    /// Blocks the step needs; the budget, idle sequences' cuts and room
    /// in every tier checked.
    Fit,
    /// The cold copies the step reuses retained (the first references).
    Retain,
    /// Idle sequences' cuts applied.
    CutIdle,
    /// Fresh cold and hot blocks allocated.
    Allocate,
    /// The planned table and the plan built.
    Build,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 8] = [
        Phase::Evict,
        Phase::Pack,
        Phase::Demote,
        Phase::Fit,
        Phase::Retain,
        Phase::CutIdle,
        Phase::Allocate,
        Phase::Build,
    ];
}
