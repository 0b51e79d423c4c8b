//! Eviction policies written in Python, run by the coordinator through the
//! Rust trait: [`PyPolicy`] holds the Python object and answers each trait
//! call by calling its method under the GIL (`kvforge.policy` builds the
//! table and pressure objects it sees). A `victims` that raises, or
//! answers anything but a sequence of ints, answers nothing and keeps the
//! words for [`EvictionPolicy::take_error`]: the coordinator fails the
//! step with them, changing nothing. An `observe` / `observe_keys` that
//! raises fails the sequence's next step the same way (or, if the
//! sequence ends first, is reported through `sys.unraisablehook`, as is a
//! `forget` that raises: neither can fail anything that is still running).
//! An interrupt (`KeyboardInterrupt`, `SystemExit`) is kept whole and
//! raised again by the engine call that ran the policy.
//!
//! `resolve.rs` builds them from `"module:Class"` names in mechanisms
//! tables.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use kvforge_evict::{EvictionPolicy, Pressure, SeqKey};
use kvforge_pool::{BlockTable, Slot};
use pyo3::exceptions::{
    PyAttributeError, PyException, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyFrozenSet, PyInt, PySet, PyString};

/// A Python object as the coordinator's eviction policy.
pub(crate) struct PyPolicy {
    obj: Py<PyAny>,
    pub(crate) name: String,
    wants_attention: bool,
    observation_window: usize,
    wants_keys: bool,
    /// The first failure since the coordinator last asked.
    error: Option<String>,
    /// Whether that failure is an answer that breaks the trait's contract
    /// (the conformance suite reports it as its `AssertionError`).
    pub(crate) broke_contract: bool,
    /// An `observe` / `observe_keys` that raised, per sequence: it fails
    /// that sequence's next step.
    observed: HashMap<SeqKey, String>,
}

thread_local! {
    /// Whether this thread is inside a Python policy's method (the engine
    /// refuses to be called from there: its cache is locked by the step).
    static IN_POLICY: Cell<bool> = const { Cell::new(false) };
    /// An interrupt a policy raised (`KeyboardInterrupt`, `SystemExit`),
    /// raised again by the engine call that ran the policy.
    static INTERRUPT: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// Refuses an engine call made from inside a policy's method.
pub(crate) fn not_in_policy() -> PyResult<()> {
    if IN_POLICY.with(Cell::get) {
        return Err(PyRuntimeError::new_err(
            "kvforge: a policy cannot call the engine from inside its methods (the step in progress holds the cache)",
        ));
    }
    Ok(())
}

/// The interrupt a policy raised during the last engine call, taken.
pub(crate) fn take_interrupt() -> Option<PyErr> {
    INTERRUPT.with(|i| i.borrow_mut().take())
}

/// Runs `f` with a policy object under the GIL: its value, or the
/// [`failure`].
pub(crate) fn run_policy<T>(
    obj: &Py<PyAny>,
    f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> Result<T, String> {
    Python::attach(|py| {
        // Restored, not cleared: a policy may run another one (a
        // conformance check) and must stay refused the engine after it.
        let outer = IN_POLICY.with(|p| p.replace(true));
        let r = f(obj.bind(py));
        IN_POLICY.with(|p| p.set(outer));
        r.map_err(|e| failure(py, e))
    })
}

/// A policy's failure in one line; an interrupt (`KeyboardInterrupt`,
/// `SystemExit`) is also kept whole for the engine call to raise again.
pub(crate) fn failure(py: Python<'_>, e: PyErr) -> String {
    let words = one_line(&e);
    if !e.is_instance_of::<PyException>(py) {
        INTERRUPT.with(|i| {
            i.borrow_mut().get_or_insert(e);
        });
    }
    words
}

/// `obj.name`, or `None` when it has no such attribute (any other error
/// raised while reading it is the caller's).
pub(crate) fn attr<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match obj.getattr(name) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<PyAttributeError>(obj.py()) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A Python exception in one line: `TypeError: …`.
pub(crate) fn one_line(e: &PyErr) -> String {
    e.to_string().replace('\n', " ")
}

impl PyPolicy {
    /// Wraps `obj`, reading its name and what it wants once (class
    /// attributes of `kvforge.EvictionPolicy`).
    pub(crate) fn wrap(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let flag = |name: &str| -> PyResult<bool> {
            attr(obj, name)?.map_or(Ok(false), |v| {
                v.extract()
                    .map_err(|_| PyTypeError::new_err(format!("policy.{name} must be a bool")))
            })
        };
        if !attr(obj, "victims")?.is_some_and(|v| v.is_callable()) {
            return Err(PyTypeError::new_err(format!(
                "kvforge: a {} is not an eviction policy: it has no victims() method (subclass kvforge.EvictionPolicy)",
                obj.get_type().name()?
            )));
        }
        let name = match attr(obj, "name")? {
            Some(n) => n
                .extract::<String>()
                .map_err(|_| PyTypeError::new_err("policy.name must be a str"))?,
            None => obj.get_type().name()?.to_string(),
        };
        let observation_window = match attr(obj, "observation_window")? {
            Some(w) => w.extract::<u32>().map_err(|_| {
                PyTypeError::new_err("policy.observation_window must be an int from 0 to 2**32 - 1")
            })? as usize,
            None => 0,
        };
        Ok(PyPolicy {
            obj: obj.clone().unbind(),
            name,
            wants_attention: flag("wants_attention")?,
            observation_window,
            wants_keys: flag("wants_keys")?,
            error: None,
            broke_contract: false,
            observed: HashMap::new(),
        })
    }

    fn run<T>(&self, f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>) -> Result<T, String> {
        run_policy(&self.obj, f)
    }

    /// A failure nothing running can be failed with: to
    /// `sys.unraisablehook` (Python prints "Exception ignored in …").
    fn unraisable(&self, method: &str, why: String) {
        Python::attach(|py| {
            let e = PyRuntimeError::new_err(format!("{}.{method}: {why}", self.name));
            e.write_unraisable(py, Some(self.obj.bind(py)));
        });
    }

    fn signal(&mut self, method: &str, seq: SeqKey, table: &BlockTable, values: &[f32]) {
        let r = self.run(|obj| {
            let py = obj.py();
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let arr = policy_module(py)?.call_method1("_floats", (PyBytes::new(py, &raw),))?;
            obj.call_method1(method, (seq, table_object(py, table)?, arr))?;
            Ok(())
        });
        if let Err(why) = r {
            self.observed
                .entry(seq)
                .or_insert(format!("{method}: {why}"));
        }
    }
}

pub(crate) fn policy_module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("kvforge.policy")
}

/// `kvforge.policy.Table` of `t`: numpy views of its entries.
pub(crate) fn table_object<'py>(py: Python<'py>, t: &BlockTable) -> PyResult<Bound<'py, PyAny>> {
    let entries = t.entries();
    let first: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.first().to_le_bytes())
        .collect();
    let tokens: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.tokens().to_le_bytes())
        .collect();
    let holes: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.holes().to_le_bytes())
        .collect();
    let tier: Vec<u8> = entries
        .iter()
        .map(|e| match e.slot() {
            Slot::Hot(_) => 0,
            Slot::Cold(_) => 1,
            Slot::Alias { .. } => 2,
            Slot::Dropped => 3,
        })
        .collect();
    policy_module(py)?.getattr("Table")?.call_method1(
        "_from_native",
        (
            PyBytes::new(py, &first),
            PyBytes::new(py, &tokens),
            PyBytes::new(py, &tier),
            t.positions(),
            t.block_size(),
            t.is_open(),
            t.live_tokens(),
            PyBytes::new(py, &holes),
        ),
    )
}

/// The entry indexes a `method()` answer names (`victims`, `demote`): any
/// iterable of ints (a list, a tuple, a 1-D integer array), none negative.
pub(crate) fn indexes(ans: &Bound<'_, PyAny>, method: &str) -> PyResult<Vec<usize>> {
    let kind = |x: &Bound<'_, PyAny>| {
        x.get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string())
    };
    let wrong = || {
        PyTypeError::new_err(format!(
            "{method}() returned a {}, not a sequence of entry indexes (an empty list for none)",
            kind(ans)
        ))
    };
    if ans.is_none()
        || ans.is_instance_of::<PyString>()
        || ans.is_instance_of::<PyBytes>()
        || ans.is_instance_of::<PyByteArray>()
        || ans.is_instance_of::<PyDict>()
    {
        return Err(wrong());
    }
    let mut out = Vec::new();
    for x in ans.try_iter().map_err(|_| wrong())? {
        let x = x?;
        if x.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "{method}() returned a bool: answer entry indexes, not a mask"
            )));
        }
        let i: i64 = x.extract().map_err(|e: PyErr| {
            if e.is_instance_of::<PyOverflowError>(x.py()) || x.is_instance_of::<PyInt>() {
                PyValueError::new_err(format!("{method}() named entry {x}, out of range"))
            } else {
                PyTypeError::new_err(format!(
                    "{method}() returned a {} among its indexes: entry indexes are ints",
                    kind(&x)
                ))
            }
        })?;
        let i = usize::try_from(i)
            .map_err(|_| PyValueError::new_err(format!("{method}() named entry {i}")))?;
        out.push(i);
    }
    Ok(out)
}

/// The rule the conformance suite checks of every answer, said plainly:
/// indexes of live entries, ascending, each once, never the newest entry
/// (the open block being written, or the one the next step attends from).
fn contract(named: &[usize], t: &BlockTable) -> Result<(), String> {
    let entries = t.entries();
    for (k, &i) in named.iter().enumerate() {
        if k > 0 && named[k - 1] == i {
            return Err(format!("victims() named entry {i} twice"));
        }
        if k > 0 && named[k - 1] > i {
            return Err(format!(
                "victims() answers must ascend: entry {} before entry {i}",
                named[k - 1]
            ));
        }
        let Some(e) = entries.get(i) else {
            return Err(format!(
                "victims() named entry {i}, out of range (the table has {})",
                entries.len()
            ));
        };
        if matches!(e.slot(), Slot::Dropped) {
            return Err(format!("victims() named entry {i}, already dropped"));
        }
        if i + 1 == entries.len() {
            return Err(format!(
                "victims() named entry {i}, the newest: it cannot be evicted"
            ));
        }
    }
    Ok(())
}

impl EvictionPolicy for PyPolicy {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn wants_attention(&self) -> bool {
        self.wants_attention
    }

    fn observation_window(&self) -> usize {
        self.observation_window
    }

    fn wants_keys(&self) -> bool {
        self.wants_keys
    }

    fn observe(&mut self, seq: SeqKey, table: &BlockTable, mass: &[f32]) {
        self.signal("observe", seq, table, mass);
    }

    fn observe_keys(&mut self, seq: SeqKey, table: &BlockTable, novelty: &[f32]) {
        self.signal("observe_keys", seq, table, novelty);
    }

    fn victims(&mut self, seq: SeqKey, table: &BlockTable, p: Pressure, out: &mut Vec<usize>) {
        if let Some(why) = self.observed.remove(&seq) {
            self.error.get_or_insert(why);
            return;
        }
        let named = self.run(|obj| {
            let py = obj.py();
            let pressure = policy_module(py)?.getattr("Pressure")?.call1((
                p.used,
                p.new_tokens,
                p.budget_bytes,
                p.hot_block_bytes,
                p.cold_block_bytes,
            ))?;
            let ans = obj.call_method1("victims", (seq, table_object(py, table)?, pressure))?;
            if ans.is_instance_of::<PySet>() || ans.is_instance_of::<PyFrozenSet>() {
                return Err(PyTypeError::new_err(
                    "victims() returned a set: answer entry indexes in ascending order (a list)",
                ));
            }
            indexes(&ans, "victims")
        });
        match named.map(|v| contract(&v, table).map(|()| v)) {
            Ok(Ok(v)) => out.extend(v),
            Ok(Err(why)) => {
                self.broke_contract |= self.error.is_none();
                self.error.get_or_insert(why);
            }
            Err(why) => {
                self.error.get_or_insert(why);
            }
        }
    }

    fn forget(&mut self, seq: SeqKey) {
        if let Some(why) = self.observed.remove(&seq) {
            self.unraisable("observe", why);
        }
        if let Err(why) = self.run(|obj| obj.call_method1("forget", (seq,)).map(drop)) {
            self.unraisable("forget", why);
        }
    }

    fn take_error(&mut self) -> Option<String> {
        self.broke_contract = false;
        self.error.take()
    }
}
