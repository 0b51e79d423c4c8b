//! Eviction policies written in Python, run by the coordinator through the
//! Rust trait: [`PyPolicy`] holds the Python object and answers each trait
//! call by calling its method under the GIL (`kvforge.policy` builds the
//! table and pressure objects it sees). A method that raises, or answers
//! anything but a sequence of ints, answers nothing and keeps the words
//! for [`EvictionPolicy::take_error`]: the coordinator fails the step with
//! them, changing nothing.
//!
//! [`install_resolver`] makes `"module:Class"` names reach every registry
//! of the process (mechanisms tables, the ablation).

use std::sync::Arc;

use kvforge_engine::mechanisms::{EvictionBuilder, PolicyParams, Registry};
use kvforge_evict::{EvictionPolicy, Pressure, SeqKey};
use kvforge_pool::{BlockTable, Slot};
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString};

/// A Python object as the coordinator's eviction policy.
pub(crate) struct PyPolicy {
    obj: Py<PyAny>,
    name: String,
    wants_attention: bool,
    observation_window: usize,
    wants_keys: bool,
    /// The first failure since the coordinator last asked.
    error: Option<String>,
}

/// A Python exception in one line: `TypeError: …`.
fn one_line(e: &PyErr) -> String {
    e.to_string().replace('\n', " ")
}

impl PyPolicy {
    /// Wraps `obj`, reading its name and what it wants once (class
    /// attributes of `kvforge.EvictionPolicy`).
    pub(crate) fn wrap(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let attr = |name: &str| obj.getattr(name).ok();
        let flag = |name: &str| -> PyResult<bool> {
            attr(name).map_or(Ok(false), |v| {
                v.extract()
                    .map_err(|_| PyTypeError::new_err(format!("policy.{name} must be a bool")))
            })
        };
        if !attr("victims").is_some_and(|v| v.is_callable()) {
            return Err(PyTypeError::new_err(format!(
                "kvforge: a {} is not an eviction policy: it has no victims() method (subclass kvforge.EvictionPolicy)",
                obj.get_type().name()?
            )));
        }
        let name = match attr("name") {
            Some(n) => n
                .extract::<String>()
                .map_err(|_| PyTypeError::new_err("policy.name must be a str"))?,
            None => obj.get_type().name()?.to_string(),
        };
        let observation_window = match attr("observation_window") {
            Some(w) => w.extract().map_err(|_| {
                PyTypeError::new_err("policy.observation_window must be an int ≥ 0")
            })?,
            None => 0,
        };
        Ok(PyPolicy {
            obj: obj.clone().unbind(),
            name,
            wants_attention: flag("wants_attention")?,
            observation_window,
            wants_keys: flag("wants_keys")?,
            error: None,
        })
    }

    /// Runs `f` with the object under the GIL; a failure is kept (the
    /// first one) for `take_error`.
    fn call<T>(&mut self, f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>) -> Option<T> {
        let r = Python::attach(|py| f(self.obj.bind(py)).map_err(|e| one_line(&e)));
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.error.get_or_insert(e);
                None
            }
        }
    }

    fn signal(&mut self, method: &str, seq: SeqKey, table: &BlockTable, values: &[f32]) {
        self.call(|obj| {
            let py = obj.py();
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let arr = policy_module(py)?.call_method1("_floats", (PyBytes::new(py, &raw),))?;
            obj.call_method1(method, (seq, table_object(py, table)?, arr))?;
            Ok(())
        });
    }
}

fn policy_module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("kvforge.policy")
}

/// `kvforge.policy.Table` of `t`: numpy views of its entries.
fn table_object<'py>(py: Python<'py>, t: &BlockTable) -> PyResult<Bound<'py, PyAny>> {
    let entries = t.entries();
    let first: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.first().to_le_bytes())
        .collect();
    let tokens: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.tokens().to_le_bytes())
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
        ),
    )
}

/// The entry indexes a `victims()` answer names: any iterable of ints
/// (a list, a tuple, a 1-D integer array), none negative.
fn indexes(ans: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let kind = |x: &Bound<'_, PyAny>| {
        x.get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string())
    };
    let wrong = || {
        PyTypeError::new_err(format!(
            "victims() returned a {}, not a sequence of entry indexes (an empty list for none)",
            kind(ans)
        ))
    };
    if ans.is_none() || ans.is_instance_of::<PyString>() || ans.is_instance_of::<PyDict>() {
        return Err(wrong());
    }
    let mut out = Vec::new();
    for x in ans.try_iter().map_err(|_| wrong())? {
        let x = x?;
        if x.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(
                "victims() returned a bool: answer entry indexes, not a mask",
            ));
        }
        let i: i64 = x.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "victims() returned a {} among its indexes: entry indexes are ints",
                kind(&x)
            ))
        })?;
        let i = usize::try_from(i)
            .map_err(|_| PyValueError::new_err(format!("victims() named entry {i}")))?;
        out.push(i);
    }
    Ok(out)
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
        let named = self.call(|obj| {
            let py = obj.py();
            let pressure = policy_module(py)?.getattr("Pressure")?.call1((
                p.used,
                p.new_tokens,
                p.budget_bytes,
                p.hot_block_bytes,
                p.cold_block_bytes,
            ))?;
            let ans = obj.call_method1("victims", (seq, table_object(py, table)?, pressure))?;
            indexes(&ans)
        });
        out.extend(named.unwrap_or_default());
    }

    fn forget(&mut self, seq: SeqKey) {
        self.call(|obj| obj.call_method1("forget", (seq,)).map(drop));
    }

    fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }
}

/// Builds `module:Class` with a mechanisms table's parameters as keyword
/// arguments.
fn build(
    module: &str,
    class: &str,
    p: &PolicyParams<'_>,
) -> Result<Box<dyn EvictionPolicy>, String> {
    let params: serde_json::Map<String, serde_json::Value> = p.parse()?;
    let json = serde_json::Value::Object(params).to_string();
    Python::attach(|py| {
        let m = py.import(module)?;
        let mut cls = m.into_any();
        for part in class.split('.') {
            cls = cls.getattr(part)?;
        }
        let kwargs = py.import("json")?.call_method1("loads", (json,))?;
        let obj = cls.call((), Some(kwargs.cast::<PyDict>()?))?;
        Ok(Box::new(PyPolicy::wrap(&obj)?) as Box<dyn EvictionPolicy>)
    })
    .map_err(|e: PyErr| format!("{module}:{class}: {}", one_line(&e)))
}

/// Lets every registry of this process build `"module:Class"` names from
/// Python (once; later calls change nothing).
pub(crate) fn install_resolver() {
    Registry::install_resolver(Arc::new(|name: &str| {
        let (module, class) = name.split_once(':')?;
        if module.is_empty() || class.is_empty() {
            return None;
        }
        let (module, class) = (module.to_string(), class.to_string());
        let b: EvictionBuilder = Arc::new(move |p| build(&module, &class, p));
        Some(b)
    }));
}

/// `kvforge.testing.check_eviction_policy`: the Rust trait's conformance
/// suite (`kvforge_evict::testing::check_policy`) on a Python policy.
#[pyfunction]
#[pyo3(signature = (policy, block_size = 16))]
pub(crate) fn check_eviction_policy(policy: &Bound<'_, PyAny>, block_size: u32) -> PyResult<()> {
    if block_size == 0 {
        return Err(PyValueError::new_err(
            "kvforge: block_size must be at least 1",
        ));
    }
    let mut p = PyPolicy::wrap(policy)?;
    // A violation panics in the suite (its panic message also reaches
    // stderr through the panic hook); it comes back as AssertionError.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        kvforge_evict::testing::check_policy(&mut p, block_size)
    }));
    if let Some(e) = p.take_error() {
        return Err(PyRuntimeError::new_err(format!("the policy failed: {e}")));
    }
    r.map_err(|payload| {
        let why = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the contract was broken".into());
        PyAssertionError::new_err(format!("{}: {why}", p.name))
    })
}
