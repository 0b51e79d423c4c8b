//! What attention tells the eviction policies: the mass each entry (lane,
//! row) received, and how far its keys stand from the mean key.

use tch::{Device, Kind, Tensor};

use crate::error::Result;

use super::*;

/// KeyDiff's signal for one layer, per table entry, from the view's live
/// keys `[keys, kv_heads, head_dim]`: `1 − cos(key, mean key)` per key and
/// head, averaged over heads (unless `per_head`: then one value per entry
/// and head) and over the entry's keys (0 for dropped entries); with
/// `per_token`, one value per row of the table.
pub(super) fn entry_key_novelty(
    view: &StepView,
    keys: &Tensor,
    observe: Observe,
) -> Result<Vec<f32>> {
    let k = keys.f_to_kind(Kind::Float)?;
    let unit = |t: &Tensor| -> Result<Tensor> {
        let n = t.f_norm_scalaropt_dim(2, [-1i64].as_slice(), true)?;
        Ok(t / n.f_clamp_min(1e-12)?)
    };
    let mean = k.f_mean_dim([0i64].as_slice(), true, Kind::Float)?; // [1, h, d]
    let cos =
        (unit(&k)? * unit(&mean)?).f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?;
    let novelty = cos.f_neg()? + 1.0; // [keys, h]
    if observe.per_head {
        let v = Vec::<f32>::try_from(
            novelty
                .f_transpose(0, 1)?
                .f_contiguous()?
                .f_flatten(0, -1)?
                .f_to_device(Device::Cpu)?,
        )?;
        return Ok(interleave_heads(view, &v, true));
    }
    let novelty = novelty
        .f_mean_dim([1i64].as_slice(), false, Kind::Float)?
        .f_to_device(Device::Cpu)?;
    let novelty = Vec::<f32>::try_from(novelty)?;
    Ok(if observe.per_token {
        view.per_row(&novelty)
    } else {
        view.per_entry(&novelty, true)
    })
}

/// Softmax weights of every query (of the last `observe.window`, if set)
/// over the keys, summed over heads (or over each KV head's group) and
/// queries, then per table entry (and KV head, entry-major).
pub(super) fn entry_mass(
    view: &StepView,
    q: &Tensor,
    k: &Tensor,
    group: i64,
    observe: Observe,
) -> Result<Vec<f32>> {
    let d = q.size()[3] as f64;
    let k = if group > 1 {
        k.f_repeat_interleave_self_int(group, 1, None)?
    } else {
        k.shallow_clone()
    };
    let q = q.f_to_kind(Kind::Float)?;
    let k = k.f_to_kind(Kind::Float)?;
    let mut scores = q.f_matmul(&k.f_transpose(2, 3)?)? / d.sqrt(); // [1, h, n, keys]
    let visible = match (&view.mask, view.causal) {
        (Some(m), _) => Some(m.shallow_clone()),
        (None, true) => {
            let dev = q.device();
            let kp = Tensor::f_arange(view.keys, (Kind::Int64, dev))?;
            let qp = Tensor::f_arange(view.n, (Kind::Int64, dev))?;
            Some(kp.f_unsqueeze(0)?.f_le_tensor(&qp.f_unsqueeze(1)?)?)
        }
        (None, false) => None,
    };
    if let Some(m) = visible {
        scores = scores.f_masked_fill(&m.f_logical_not()?, f64::NEG_INFINITY)?;
    }
    let mut w = scores.f_softmax(-1, Kind::Float)?; // [1, h, n, keys]
    let n = w.size()[2];
    // A window of at least the step's queries (however large) is all of them.
    let last = i64::try_from(observe.window).unwrap_or(i64::MAX);
    if last > 0 && last < n {
        w = w.f_narrow(2, n - last, last)?;
    }
    if !observe.per_head {
        let w = w
            .f_sum_dim_intlist([0i64, 1, 2].as_slice(), false, Kind::Float)?
            .f_to_device(Device::Cpu)?;
        let w = Vec::<f32>::try_from(w)?;
        return Ok(if observe.per_token {
            view.per_row(&w)
        } else {
            view.per_entry(&w, false)
        });
    }
    // [h, keys] -> [kv_heads, keys], summed over each group's query heads.
    let keys = w.size()[3];
    let w = w
        .f_sum_dim_intlist([0i64, 2].as_slice(), false, Kind::Float)?
        .f_view([-1, group, keys])?
        .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Float)?
        .f_contiguous()?
        .f_to_device(Device::Cpu)?;
    let flat = Vec::<f32>::try_from(w.f_flatten(0, -1)?)?;
    Ok(interleave_heads(view, &flat, false))
}
