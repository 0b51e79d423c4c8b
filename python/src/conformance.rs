//! `kvforge.testing`'s checks: the Rust traits' conformance suites run on
//! a Python policy object. A violation panics in the suite and comes back
//! as a one-line `AssertionError` (the panic hook stays quiet for the
//! suite's thread while it runs: no Rust message or backtrace on stderr);
//! a method that raised, as `RuntimeError` with its words; an interrupt,
//! as itself.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use kvforge_evict::EvictionPolicy;
use kvforge_quant::TierPolicy;
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::policy::{PyPolicy, take_interrupt};
use crate::tier::PyTier;

/// `kvforge.testing.check_eviction_policy`: the Rust trait's conformance
/// suite (`kvforge_evict::testing::check_policy`) on a Python policy.
#[pyfunction]
#[pyo3(signature = (policy, block_size = 16))]
pub(crate) fn check_eviction_policy(policy: &Bound<'_, PyAny>, block_size: u32) -> PyResult<()> {
    block(block_size)?;
    let mut p = PyPolicy::wrap(policy)?;
    let r = quietly(|| kvforge_evict::testing::check_policy(&mut p, block_size));
    let broke = p.broke_contract;
    checked(r, p.take_error(), broke, &p.name)
}

thread_local! {
    /// Set while a suite runs on this thread: its panics are its verdict.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `suite`, catching its panic, with the panic hook silent for this
/// thread (other threads' panics are reported as before).
fn quietly(suite: impl FnOnce()) -> std::thread::Result<()> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let r = catch_unwind(AssertUnwindSafe(suite));
    QUIET.with(|q| q.set(false));
    r
}

fn block(block_size: u32) -> PyResult<()> {
    if block_size == 0 {
        return Err(PyValueError::new_err(
            "kvforge: block_size must be at least 1",
        ));
    }
    Ok(())
}

/// A conformance suite's outcome: an interrupt the policy raised as
/// itself, else its failure (an answer the binding refused as breaking the
/// contract is the suite's `AssertionError`, in the binding's words), else
/// the suite's violation.
fn checked(
    r: std::thread::Result<()>,
    failed: Option<String>,
    broke_contract: bool,
    name: &str,
) -> PyResult<()> {
    if let Some(interrupt) = take_interrupt() {
        return Err(interrupt);
    }
    if let Some(e) = failed {
        if broke_contract {
            return Err(PyAssertionError::new_err(format!("{name}: {e}")));
        }
        return Err(PyRuntimeError::new_err(format!("the policy failed: {e}")));
    }
    r.map_err(|payload| broken(name, payload.as_ref()))
}

/// A conformance suite's panic as `AssertionError: NAME: why`.
fn broken(name: &str, payload: &(dyn std::any::Any + Send)) -> PyErr {
    let why = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the contract was broken".into());
    // One line: `assert_eq!` adds its `left:` / `right:` lines.
    let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
    PyAssertionError::new_err(format!("{name}: {why}"))
}

/// `kvforge.testing.check_tier_policy`: the Rust trait's conformance suite
/// (`kvforge_quant::testing::check_tier_policy`) on a Python policy.
#[pyfunction]
#[pyo3(signature = (policy, block_size = 16))]
pub(crate) fn check_tier_policy(policy: &Bound<'_, PyAny>, block_size: u32) -> PyResult<()> {
    block(block_size)?;
    let p = PyTier::wrap(policy)?;
    let r = quietly(|| kvforge_quant::testing::check_tier_policy(&p, block_size));
    checked(r, p.take_error(), false, &p.name)
}
