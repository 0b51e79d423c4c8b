//! Unit tests of the module's private parts.
#![allow(clippy::unwrap_used)]

use kvforge_kernels::cuda::ColdPoolHost;
use kvforge_quant::{Axis, f16};

use super::*;
use crate::attention::kernel_table;
use crate::cache::{PagedKvCache, Sequence};
use crate::model::{Llama, LlamaConfig};
use crate::tier::KvQuant;

/// The table and cold-tier copy the CUDA kernel reads, decoded on the
/// CPU with the kernel's own index arithmetic, give every key and
/// value the reference gathers, in order (hot rows in place, cold rows
/// from the copy, aliases and sinks included).
#[test]
fn the_kernel_table_and_the_cold_copy_hold_what_the_reference_gathers() {
    let cfg = LlamaConfig {
        head_dim: 64,
        n_heads: 4,
        n_kv_heads: 2,
        d_model: 64,
        ..LlamaConfig::tiny()
    };
    let model = Llama::random(cfg.clone(), 5, Device::Cpu, Kind::Float).unwrap();
    let bs = 16;
    for (bits, axis) in [
        (4, Axis::PerChannel),
        (2, Axis::PerToken),
        (8, Axis::PerChannel),
    ] {
        let mut cache = PagedKvCache::new(&cfg, bs, 512, Device::Cpu, Kind::Half).unwrap();
        let quant = KvQuant {
            window: 32,
            sink: 16,
            key_axis: axis,
            bits,
            ..KvQuant::parse("int4").unwrap()
        };
        cache.set_cold_tier(Some(quant)).unwrap();
        assert!(cache.mirror_cold_tier(Device::Cpu));
        let mut seq = Sequence::default();
        let ids: Vec<u32> = (0..203u32).map(|i| (i * 37 + 11) % 97).collect();
        for chunk in ids.chunks(50) {
            let _ = model
                .forward(chunk, &mut cache.view(&mut seq), false)
                .unwrap();
        }
        let table = cache.table(&seq).unwrap();
        let kv = cache.tensors();
        let tier = kv.cold.unwrap();
        let view = StepView::new(&table, 1, bs, Some(tier), Device::Cpu).unwrap();
        let rows = kernel_table(&view.pages, bs);
        assert_eq!(rows.len(), view.keys());
        let cold_rows = rows.iter().filter(|r| **r < 0).count();
        assert!(cold_rows >= 100, "{cold_rows} cold rows");
        let mirror = tier.mirror().unwrap();
        let (kc, vc) = tier.configs();
        let c = cfg.n_kv_heads * cfg.head_dim;
        for layer in 0..cfg.n_layers {
            let t = mirror.layer(layer).unwrap();
            let bytes = |t: &Tensor| Vec::<u8>::try_from(t.f_flatten(0, -1).unwrap()).unwrap();
            let halves = |t: &Tensor| -> Vec<f16> {
                Vec::<i16>::try_from(t.f_flatten(0, -1).unwrap())
                    .unwrap()
                    .iter()
                    .map(|b| f16::from_bits(*b as u16))
                    .collect()
            };
            let pool = |i: usize| ColdPoolHost {
                codes: bytes(&t[i]),
                scales: halves(&t[i + 1]),
                mins: halves(&t[i + 2]),
            };
            for (values, qc, p) in [(false, kc, pool(0)), (true, vc, pool(3))] {
                let want = Vec::<f32>::try_from(
                    view.gather(&kv, layer, values, Kind::Float)
                        .unwrap()
                        .f_flatten(0, -1)
                        .unwrap(),
                )
                .unwrap();
                let hot = if values { &kv.v[layer] } else { &kv.k[layer] };
                let hot = Vec::<f32>::try_from(
                    hot.f_to_kind(Kind::Float)
                        .unwrap()
                        .f_flatten(0, -1)
                        .unwrap(),
                )
                .unwrap();
                for (j, &r) in rows.iter().enumerate() {
                    for ch in 0..c {
                        let got = if r >= 0 {
                            hot[r as usize * c + ch]
                        } else {
                            let r = (-1 - r) as usize;
                            p.element(&qc, bs, c, r / bs, r % bs, ch)
                        };
                        assert_eq!(
                            got.to_bits(),
                            want[j * c + ch].to_bits(),
                            "int{bits} {axis:?} layer {layer} values {values} key {j} channel {ch}"
                        );
                    }
                }
            }
        }
        drop(mirror);
        cache.free(&mut seq).unwrap();
    }
}
