//! The tensor-free KV cache coordinator of kvforge.
//!
//! Every mechanism of kvforge meets here, and nowhere else:
//!
//! * storage tiers as pools ([`TieredPool`]): hot blocks in the KV dtype,
//!   cold blocks in a quantized format, each with ids, reference counts
//!   and bytes counted once however many sequences share them, under one
//!   byte budget;
//! * one [`BlockTable`] per sequence, of typed entries (hot, cold, alias,
//!   dropped) over fixed positions;
//! * the optional policies, each present or absent by
//!   [`CoordinatorConfig`] alone: a [`PrefixMatcher`](kvforge_prefix::PrefixMatcher)
//!   (prefix reuse; it matches hot and cold blocks alike), a
//!   [`TierPolicy`](kvforge_quant::TierPolicy) (what goes cold), an
//!   [`EvictionPolicy`](kvforge_evict::EvictionPolicy), a
//!   [`Deduplicator`](kvforge_lsh::Deduplicator) and a
//!   [`LifecyclePolicy`](kvforge_lifecycle::LifecyclePolicy).
//!
//! For each step of a sequence the coordinator returns a [`Plan`]
//! (allocate, copy, demote, drop; alias through [`Coordinator::share`])
//! that the engine carries out with tensors; the plan is committed after
//! the forward pass succeeds and aborted otherwise, which leaves tables,
//! reference counts, pools and index as they were. A turn of a session can
//! be rolled back as a whole ([`Coordinator::begin_turn`]).
//!
//! No tensors, no libtorch: the tests run anywhere in milliseconds, and an
//! engine other than kvforge's could drive it.
//!
//! ```
//! use kvforge_coordinator::{ColdConfig, Coordinator, CoordinatorConfig, Planned, PrefixConfig};
//! use kvforge_pool::{KvLayout, Slot, StorageFormat};
//! use kvforge_prefix::ExtraKeys;
//!
//! let layout = KvLayout::new(2, 2, 8, 4, StorageFormat::F16)?;
//! let mut cfg = CoordinatorConfig::new(layout, 64);
//! cfg.prefix = Some(PrefixConfig { seed: Some(1), ..PrefixConfig::default() });
//! let int4 = StorageFormat::Int4 { group_size: 8 };
//! cfg.cold = Some(ColdConfig { format: int4, value_format: int4, window: 8, sink: 0 });
//! let mut c = Coordinator::new(cfg)?;
//!
//! let prompt: Vec<u32> = (0..20).collect();
//! let opened = c.open(&prompt, &ExtraKeys::default())?;
//! let plan = match c.plan(opened.seq, prompt.len())? {
//!     Planned::Step(plan) => plan, // the engine writes K/V at plan.writes
//!     Planned::Full(short) => return Err(short.into()), // or wait, or preempt
//! };
//! assert_eq!(plan.tokens(), 20);
//! c.commit(opened.seq)?;
//! let plan = c.plan(opened.seq, 1)?.step().ok_or("full")?; // blocks older than the window go cold first
//! assert_eq!(plan.demotions.len(), 3); // positions 0..12
//! c.commit(opened.seq)?;
//! assert!(matches!(c.table(opened.seq)?.entries()[0].slot(), Slot::Cold(_)));
//! c.close(opened.seq)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod config;
mod coordinator;
mod error;
mod plan;
pub mod rules;
pub mod testing;

pub use config::{
    ColdConfig, CoordinatorConfig, DedupConfig, EvictionConfig, IndexKind, LifecycleConfig,
    PrefixConfig, TurnTail,
};
pub use coordinator::{
    COLD, Coordinator, Counters, HOT, Opened, Phase, SeqId, TierStats, TurnInput, TurnLifecycle,
};
pub use error::{CoordError, Result};
pub use kvforge_evict::{EvictionPolicy, Score, Trigger};
pub use kvforge_lifecycle::{Label, LabelSource, Segment};
pub use kvforge_lsh::{Content, ShareStats, SimHashConfig};
pub use kvforge_pool::{BlockId, BlockTable, Entry, PoolStats, Slot, TieredPool};
pub use kvforge_prefix::MatchStats;
pub use plan::{
    CopyOp, Demotion, Grain, Lack, Pack, Plan, Planned, RowPack, Shortfall, Wants, Write,
};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
