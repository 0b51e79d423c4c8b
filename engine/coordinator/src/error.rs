//! The one error type of `kvforge-coordinator`.

use kvforge_evict::EvictError;
use kvforge_lifecycle::LifecycleError;
use kvforge_pool::PoolError;
use kvforge_prefix::PrefixError;
use kvforge_quant::QuantError;

use crate::plan::SeqId;

/// Everything the coordinator refuses. Every error but `Pool`, `Prefix`,
/// `Invariant` and `Injected` leaves tables, reference counts, pools, index and the
/// other sequences as they were before the call (the policies may have
/// been asked, as for a step that is aborted). The first three report a
/// broken internal contract — a bug, not bad input: the call stopped where
/// it found it, and what it had done is kept; a plan gives back every
/// reference it took on any error, `Injected` included (its only exception:
/// idle sequences' entries dropped to make the step fit stay dropped).
/// A step that does not fit is not an error:
/// [`plan`](crate::Coordinator::plan) answers
/// [`Planned::Full`](crate::Planned::Full).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoordError {
    /// A configuration that cannot work (or options that cannot be
    /// combined).
    #[error("cache config: {0}")]
    Config(String),
    /// The sequence does not exist (closed, or never opened).
    #[error("sequence {0} does not exist")]
    UnknownSeq(SeqId),
    /// A call out of order: a second plan before commit/abort, a commit
    /// with nothing planned, a turn inside a turn.
    #[error("sequence {seq}: {what}")]
    Order {
        /// The sequence.
        seq: SeqId,
        /// What was out of order.
        what: &'static str,
    },
    /// A policy answered something its contract rules out (a demotion of a
    /// block that is not a full hot one, a victim that does not exist).
    #[error("policy: {0}")]
    Policy(String),
    /// A coordinator invariant is broken: a bug, found by
    /// [`Coordinator::check_every_call`](crate::Coordinator::check_every_call)
    /// or by a plan whose checked room was not there.
    #[error("coordinator invariant broken: {0}")]
    Invariant(String),
    /// A failure a test injected into a plan
    /// ([`testing::fail_plan_at`](crate::testing::fail_plan_at)).
    #[error("a failure injected at the {phase:?} phase of a plan")]
    Injected {
        /// Where.
        phase: crate::plan::Phase,
    },
    /// A pool contract broke (a bug, not bad input).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The prefix index refused an insertion.
    #[error(transparent)]
    Prefix(#[from] PrefixError),
    /// A quantization parameter (window, sink) that cannot work.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// An eviction policy parameter that cannot work.
    #[error(transparent)]
    Evict(#[from] EvictError),
    /// A sharing parameter that cannot work, or content it cannot compare.
    #[error(transparent)]
    Share(#[from] kvforge_lsh::ShareError),
    /// A lifecycle policy parameter that cannot work.
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
}

/// `Result` with [`CoordError`].
pub type Result<T, E = CoordError> = std::result::Result<T, E>;
