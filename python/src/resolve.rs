//! Python policies named in mechanisms tables: [`registry`] is the
//! registry every mechanisms table of the Python package is checked and
//! built with (the engine's, the ablation's): `"module:Class"` names of
//! eviction and tier policies are Python classes, each built with the
//! table's parameters as keyword arguments.

use std::sync::Arc;

use kvforge_engine::mechanisms::{EvictionBuilder, PolicyParams, Registry, TierBuilder};
use kvforge_evict::EvictionPolicy;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::policy::{PyPolicy, failure};
use crate::tier::PyTier;

/// Builds `module:Class` with a mechanisms table's parameters as keyword
/// arguments, and wraps it. An interrupt raised on the way (the class's
/// `__init__`, the module's import) is kept to come out as itself.
fn build<T>(
    module: &str,
    class: &str,
    p: &PolicyParams<'_>,
    wrap: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> Result<T, String> {
    let params: serde_json::Map<String, serde_json::Value> = p.parse()?;
    let json = serde_json::Value::Object(params).to_string();
    Python::attach(|py| {
        let built = (|| {
            let mut cls = py.import(module)?.into_any();
            for part in class.split('.') {
                cls = cls.getattr(part)?;
            }
            let kwargs = py.import("json")?.call_method1("loads", (json,))?;
            wrap(&cls.call((), Some(kwargs.cast::<PyDict>()?))?)
        })();
        // The registry names the policy ("tier NAME: …").
        built.map_err(|e| failure(py, e))
    })
}

/// `"module:Class"` split, or `None` for any other name.
fn python_name(name: &str) -> Option<(String, String)> {
    let (module, class) = name.split_once(':')?;
    (!module.is_empty() && !class.is_empty()).then(|| (module.to_string(), class.to_string()))
}

/// The Python package's registry: kvforge's own policies, and
/// `"module:Class"` names of eviction and tier policies built from Python.
pub(crate) fn registry() -> Registry {
    with_python(Registry::builtin())
}

/// `registry` with `"module:Class"` names resolved to Python classes.
pub(crate) fn with_python(registry: Registry) -> Registry {
    registry
        .with_resolver(Arc::new(|name: &str| {
            let (module, class) = python_name(name)?;
            let b: EvictionBuilder = Arc::new(move |p| {
                build(&module, &class, p, |obj| {
                    Ok(Box::new(PyPolicy::wrap(obj)?) as Box<dyn EvictionPolicy>)
                })
            });
            Some(b)
        }))
        .with_tier_resolver(Arc::new(|name: &str| {
            let (module, class) = python_name(name)?;
            let b: TierBuilder = Arc::new(move |p| {
                build(&module, &class, p, |obj| {
                    Ok(Box::new(PyTier::wrap(obj)?) as Box<dyn kvforge_quant::TierPolicy>)
                })
            });
            Some(b)
        }))
}
