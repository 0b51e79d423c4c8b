//! One reply from Python: the sampling a call asks for, the generation run
//! with the GIL released, and its report as a `dict`.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use kvforge_engine::{Generation, PagedKvCache, SamplingParams, TurnReport};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::done;
use crate::policy::not_in_policy;

/// How to sample.
#[derive(FromPyObject)]
pub(crate) struct Sampling {
    max_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    ignore_eos: bool,
}

impl From<Sampling> for SamplingParams {
    fn from(s: Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            seed: s.seed,
            max_tokens: s.max_tokens,
            ignore_eos: s.ignore_eos,
        }
    }
}

fn report<'py>(py: Python<'py>, r: &TurnReport, peak: u64) -> PyResult<Bound<'py, PyDict>> {
    let d = generation(py, &r.generation)?;
    d.set_item("kv_bytes_peak", peak)?;
    d.set_item("prompt_tokens", r.prompt_tokens)?;
    d.set_item("reused_tokens", r.reused_tokens)?;
    d.set_item("prefilled_tokens", r.prefilled_tokens)?;
    d.set_item("ttft_s", r.ttft_secs)?;
    d.set_item("kv_bytes_in_use", r.kv_bytes_in_use)?;
    Ok(d)
}

fn generation<'py>(py: Python<'py>, g: &Generation) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tokens", &g.tokens)?;
    d.set_item("new_tokens", g.tokens.len())?;
    d.set_item("prefill_s", g.prefill_secs)?;
    d.set_item("decode_s", g.decode_secs)?;
    d.set_item("decode_tokens_per_s", g.decode_tokens_per_sec())?;
    d.set_item("stopped_at_eos", g.stopped_at_eos)?;
    Ok(d)
}

/// The unwind payload of a reply that a signal handler interrupted
/// (Ctrl-C between two decode steps): the manager gives back what the
/// request holds (a session turn is rolled back) and resumes the unwind;
/// `replied` raises the handler's exception (`KeyboardInterrupt`).
/// `resume_unwind` does not run the panic hook: nothing is printed.
struct Interrupted(PyErr);

/// Runs one reply (`run`: a request or a session turn) with the GIL
/// released, collecting its text: the text and its report (with
/// `kv_bytes_peak`, the most KV bytes `cache` held inside any step of the
/// call). Pending signals are handled after every new token, so Ctrl-C
/// stops the reply within one decode step and leaves the engine usable.
pub(crate) fn replied<'py>(
    py: Python<'py>,
    cache: &PagedKvCache,
    sampling: Sampling,
    run: impl FnOnce(
        &SamplingParams,
        &mut dyn FnMut(u32, &str) -> bool,
    ) -> kvforge_engine::Result<TurnReport>
    + Send,
) -> PyResult<(String, Bound<'py, PyDict>)> {
    not_in_policy()?;
    let params = SamplingParams::from(sampling);
    let out = py.detach(|| {
        cache.take_step_peak_bytes();
        catch_unwind(AssertUnwindSafe(|| {
            let mut text = String::new();
            let r = run(&params, &mut |_, piece| {
                if let Err(e) = Python::attach(|py| py.check_signals()) {
                    resume_unwind(Box::new(Interrupted(e)));
                }
                text.push_str(piece);
                true
            });
            r.map(|r| (text, r, cache.take_step_peak_bytes()))
        }))
    });
    let (text, r, peak) = match out {
        Ok(r) => done(r)?,
        Err(payload) => match payload.downcast::<Interrupted>() {
            Ok(interrupted) => return Err(interrupted.0),
            Err(other) => resume_unwind(other),
        },
    };
    Ok((text, report(py, &r, peak)?))
}
