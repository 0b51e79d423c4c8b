//! Engine errors as Python exceptions: bad input a `ValueError`, a failed
//! step a `RuntimeError`, and an interrupt a policy raised always itself.

use kvforge_engine::EngineError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::policy::take_interrupt;

/// An engine error as the Python exception of its kind (or the
/// interrupt a policy raised during the call, raised again).
pub(crate) fn raise(e: EngineError) -> PyErr {
    if let Some(interrupt) = take_interrupt() {
        return interrupt;
    }
    match e {
        EngineError::Model(_)
        | EngineError::Unsupported(_)
        | EngineError::Tokenizer(_)
        | EngineError::Request(_)
        | EngineError::Sampling(_)
        | EngineError::Device(_)
        | EngineError::Quant(_) => PyValueError::new_err(e.to_string()),
        EngineError::CacheFull(_) => PyRuntimeError::new_err(format!(
            "{e} (the hot tier holds Engine(kv_tokens=...) tokens, default the model's context: raise it, or let eviction make room)"
        )),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// An engine call's result; an interrupt a policy raised during it wins
/// even when the call got through (the policy's failure was reported
/// elsewhere), so that Ctrl-C is never lost.
pub(crate) fn done<T>(r: Result<T, EngineError>) -> PyResult<T> {
    match take_interrupt() {
        Some(interrupt) => Err(interrupt),
        None => r.map_err(raise),
    }
}

/// A bad input's `ValueError` — or the interrupt a policy's constructor
/// raised while the input was checked, as itself.
pub(crate) fn bad(msg: impl Into<String>) -> PyErr {
    take_interrupt().unwrap_or_else(|| PyValueError::new_err(msg.into()))
}

/// `v` as a size, or a `ValueError` naming `name`: sizes arrive as `i64`
/// (any Python int or numpy integer) so that a negative one is refused by
/// name rather than as pyo3's unnamed `OverflowError`.
pub(crate) fn size(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| bad(format!("kvforge: {name} must be ≥ 0, not {v}")))
}
