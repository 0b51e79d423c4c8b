//! What tests need to drive a coordinator hard: its invariants, checked
//! on its whole state ([`check_invariants`]; or turn on
//! [`Coordinator::check_every_call`] to have each public call run it), and
//! a failure injected into any phase of a plan ([`fail_plan_at`]).
//!
//! The memory-safety argument of an engine that writes KV of concurrent
//! steps into one shared storage (kvforge-engine's `PagedKvCache` is
//! `Sync` on it) rests on the first of them: a block a step writes is
//! read by no one else at the rows it writes.

use crate::coordinator::Coordinator;
use crate::plan::Phase;

/// Checks every invariant of `c`, returning the first one broken:
///
/// * every table (committed, planned, turn snapshot) tiles its positions,
///   its slots name blocks of the right tier (hot in the hot tier, cold
///   and alias targets in the cold one);
/// * a block a step in flight writes, from row `r` on, is listed by no
///   other table (another sequence's, a turn snapshot, another step's)
///   with more than `r` tokens, and the index holds no more than `r` of
///   its tokens;
/// * every listed block holds exactly the references its listings account
///   for (committed tables, turn snapshots, the references steps in flight
///   took); each tier's blocks in use are exactly the blocks listed;
/// * every block of a planned table is held by the committed table or
///   taken by the step;
/// * bytes in use stay within the budget while no step is in flight;
/// * no cold block reported freed is listed or held; the demotion map
///   maps hot blocks to cold ones.
pub fn check_invariants(c: &Coordinator) -> Result<(), String> {
    c.invariants()
}

/// Makes the next [`plan`](Coordinator::plan) of `c` fail at `phase` with
/// [`CoordError::Injected`](crate::CoordError::Injected), if it gets that
/// far (the next plan clears it either way): what the plan took before is
/// given back, so the state is as before the call — but for idle
/// sequences' entries dropped to make the step fit (from
/// [`Phase::Allocate`](crate::Phase::Allocate) on).
pub fn fail_plan_at(c: &mut Coordinator, phase: Phase) {
    c.fail_at = Some(phase);
}
