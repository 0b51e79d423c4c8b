//! The attention seam is open: a backend written outside the engine crate
//! (here, a plain softmax attention over what `StepView::gather` returns)
//! reads every key and value it needs through public accessors, and gives
//! what the reference backend gives over hot, cold and dropped entries.

use kvforge_engine::numerics::within;
use kvforge_engine::{
    Attended, AttentionBackend, Axis, Device, EngineError, EvictionConfig, Kind, KvQuant, KvStore,
    KvTensors, Observe, PagedKvCache, ReferenceBackend, Sequence, StepView, Tensor,
};

use super::{max_diff, tiny};

/// Softmax attention in f32 from the gathered keys and values, every KV
/// head repeated for its query heads; the mass per entry when asked.
struct Naive;

impl AttentionBackend for Naive {
    fn name(&self) -> &'static str {
        "naive"
    }

    fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        view: &StepView,
        kv: &KvTensors<'_>,
        observe: Observe,
    ) -> Result<Attended, EngineError> {
        let k = view.gather(kv, layer, false, Kind::Float)?;
        let v = view.gather(kv, layer, true, Kind::Float)?;
        let (n, h, d) = (q.size()[0], q.size()[1], q.size()[2]);
        let g = h / k.size()[1];
        let (k, v) = (
            k.repeat_interleave_self_int(g, 1, None),
            v.repeat_interleave_self_int(g, 1, None),
        );
        let q32 = q.to_kind(Kind::Float);
        // [heads, queries, keys]
        let scores =
            Tensor::einsum("nhd,khd->hnk", &[&q32, &k], None::<&[i64]>) / (d as f64).sqrt();
        let keys = view.keys() as i64;
        let visible = match view.mask() {
            Some(m) => m.shallow_clone(),
            None if view.is_causal() => Tensor::ones([n, keys], (Kind::Bool, Device::Cpu)).tril(0),
            None => Tensor::ones([n, keys], (Kind::Bool, Device::Cpu)),
        };
        let w = scores
            .masked_fill(&visible.logical_not().unsqueeze(0), f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let out = Tensor::einsum("hnk,khd->nhd", &[&w, &v], None::<&[i64]>).to_kind(q.kind());
        let mass = observe.mass.then(|| {
            let per_key =
                Vec::<f32>::try_from(w.sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float))
                    .unwrap_or_default();
            view.per_entry(&per_key, false)
        });
        Ok(Attended {
            out,
            mass,
            key_novelty: None,
        })
    }
}

fn cache(backend: Box<dyn AttentionBackend>) -> PagedKvCache {
    let model = tiny();
    let mut c = PagedKvCache::new(&model.cfg, 4, 512, Device::Cpu, Kind::Float).unwrap();
    let mut cfg = c.base_config();
    cfg.eviction = Some(EvictionConfig::SinkWindow {
        sink: 4,
        window: 24,
    });
    let quant = KvQuant {
        bits: 4,
        group_size: 8,
        window: 8,
        rotate: false,
        key_axis: Axis::PerChannel,
        sink: 4,
    };
    c.configure(cfg, Some(quant)).unwrap();
    c.set_backend(backend);
    c
}

#[test]
fn a_backend_outside_the_engine_matches_the_reference_over_hot_cold_and_dropped_entries() {
    let model = tiny();
    let tokens: Vec<u32> = (0..60).map(|i| 3 + (i * 13) % 90).collect();
    let mut outs = Vec::new();
    for backend in [
        Box::new(ReferenceBackend) as Box<dyn AttentionBackend>,
        Box::new(Naive),
    ] {
        let c = cache(backend);
        let mut seq = Sequence::default();
        let mut logits = vec![
            model
                .forward(&tokens[..20], &mut c.view(&mut seq), true)
                .unwrap(),
        ];
        for &t in &tokens[20..] {
            logits.push(model.forward(&[t], &mut c.view(&mut seq), true).unwrap());
        }
        let t = c.table(&seq).unwrap();
        let kinds = |f: fn(&kvforge_pool::Slot) -> bool| {
            t.entries().iter().filter(|e| f(&e.slot())).count()
        };
        assert!(
            kinds(|s| matches!(s, kvforge_pool::Slot::Cold(_))) > 0,
            "cold entries read"
        );
        assert!(
            kinds(|s| matches!(s, kvforge_pool::Slot::Dropped)) > 0,
            "dropped entries skipped"
        );
        assert!(c.view(&mut seq).len() == tokens.len());
        c.free(&mut seq).unwrap();
        outs.push(Tensor::cat(&logits, 0));
    }
    let d = max_diff(&outs[0], &outs[1]);
    assert!(within("logits", d, 1e-4), "max |Δlogit| {d}");
}
