//! Tier policies written in Python (which hot blocks go to the quantized
//! cold tier), run by the coordinator through `kvforge_quant::TierPolicy`:
//! [`PyTier`] calls the object's `demote(table)` under the GIL. A `demote`
//! that raises, or answers anything but a sequence of ints, demotes
//! nothing and keeps its words for `TierPolicy::take_error`: the
//! coordinator fails the step with them, changing nothing (as it does when
//! the answer names an entry that cannot go cold).

use std::sync::Mutex;

use kvforge_pool::BlockTable;
use kvforge_quant::TierPolicy;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::policy::{attr, indexes, run_policy, table_object};

/// A Python object as the coordinator's tier policy.
pub(crate) struct PyTier {
    obj: Py<PyAny>,
    pub(crate) name: String,
    /// The failure of the last `demote`, until the coordinator asks.
    error: Mutex<Option<String>>,
}

impl PyTier {
    /// Wraps `obj`: anything with a `demote()` method (a subclass of
    /// `kvforge.TierPolicy`).
    pub(crate) fn wrap(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if !attr(obj, "demote")?.is_some_and(|v| v.is_callable()) {
            return Err(PyTypeError::new_err(format!(
                "kvforge: a {} is not a tier policy: it has no demote() method (subclass kvforge.TierPolicy)",
                obj.get_type().name()?
            )));
        }
        let name = match attr(obj, "name")? {
            Some(n) => n
                .extract::<String>()
                .map_err(|_| PyTypeError::new_err("policy.name must be a str"))?,
            None => obj.get_type().name()?.to_string(),
        };
        Ok(PyTier {
            obj: obj.clone().unbind(),
            name,
            error: Mutex::new(None),
        })
    }

    fn failed(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        // A poisoned lock only means a panic elsewhere; the words stay good.
        self.error.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl TierPolicy for PyTier {
    fn demote(&self, table: &BlockTable, out: &mut Vec<usize>) {
        let named = run_policy(&self.obj, |obj| {
            let ans = obj.call_method1("demote", (table_object(obj.py(), table)?,))?;
            indexes(&ans, "demote")
        });
        match named {
            Ok(v) => out.extend(v),
            Err(why) => {
                self.failed()
                    .get_or_insert(format!("{}.demote: {why}", self.name));
            }
        }
    }

    fn take_error(&self) -> Option<String> {
        self.failed().take()
    }
}
