//! Sections 2 and 3: the CUDA decode kernel against the Rust one, and its
//! bandwidth against the device's copy and libtorch's gather + SDPA.

use std::time::Instant;

use anyhow::Result;
use kvforge_bench::median;
use kvforge_engine::{Device, Kind, Tensor};
use kvforge_kernels::Isa;
use kvforge_kernels::cuda::testing::{HostStep, StepSpec, max_rel_err};
use kvforge_kernels::cuda::{
    self, CudaDecode, DeviceCold, DeviceQuant, DeviceStep, HotKind, Tuning,
};
use kvforge_quant::{Axis, QuantConfig, f16};

use crate::{Report, to_vec};

/// A host step's buffers on the device, and the step that reads them.
struct OnDevice {
    step: DeviceStep,
    out: Tensor,
    scores: Option<Tensor>,
    _keep: Vec<Tensor>,
}

fn upload(h: &HostStep, kern: &CudaDecode, scores: bool) -> Result<OnDevice> {
    let dev = Device::Cuda(0);
    let mut keep = Vec::new();
    let mut put = |t: Tensor| -> Result<u64> {
        let t = t.f_to_device(dev)?;
        let p = if t.numel() == 0 {
            0
        } else {
            t.data_ptr() as u64
        };
        keep.push(t);
        Ok(p)
    };
    let bytes = |v: &[u8]| Tensor::from_slice(v);
    let halves =
        |v: &[f16]| Tensor::from_slice(&v.iter().map(|h| h.to_bits() as i16).collect::<Vec<_>>());
    let s = h.spec;
    let d = s.dims;
    let k_pool = put(bytes(&h.k_pool))?;
    let v_pool = put(bytes(&h.v_pool))?;
    let table = put(Tensor::from_slice(&h.table))?;
    let q = put(Tensor::from_slice(&h.q))?;
    let cold = match s.cold {
        None => None,
        Some((kc, vc)) => Some(DeviceCold {
            keys: DeviceQuant {
                codes: put(bytes(&h.k_cold.codes))?,
                scales: put(halves(&h.k_cold.scales))?,
                mins: put(halves(&h.k_cold.mins))?,
                config: kc,
            },
            values: DeviceQuant {
                codes: put(bytes(&h.v_cold.codes))?,
                scales: put(halves(&h.v_cold.scales))?,
                mins: put(halves(&h.v_cold.mins))?,
                config: vc,
            },
            block_tokens: s.block_tokens,
        }),
    };
    let floats = kern.scratch_floats(d, h.table.len());
    let scratch = Tensor::f_empty([floats as i64], (Kind::Float, dev))?;
    let out = Tensor::f_zeros([(d.heads * d.head_dim) as i64], (Kind::Float, dev))?;
    let sc = scores
        .then(|| Tensor::f_zeros([(d.heads * h.table.len()) as i64], (Kind::Float, dev)))
        .transpose()?;
    let step = DeviceStep {
        dims: d,
        hot: s.kind,
        k_pool,
        v_pool,
        table,
        keys: h.table.len(),
        cold,
        q,
        out: out.data_ptr() as u64,
        scratch: scratch.data_ptr() as u64,
        scratch_floats: floats,
        scores: sc.as_ref().map_or(0, |t| t.data_ptr() as u64),
    };
    keep.push(scratch);
    Ok(OnDevice {
        step,
        out,
        scores: sc,
        _keep: keep,
    })
}

fn qc(bits: u32, group: usize, axis: Axis) -> Result<QuantConfig> {
    Ok(QuantConfig::new(bits, group, axis)?)
}

pub(crate) fn kernel_vs_cpu(r: &mut Report, kern: &CudaDecode) -> Result<()> {
    let int4 = Some((qc(4, 32, Axis::PerChannel)?, qc(4, 32, Axis::PerToken)?));
    let int8 = Some((qc(8, 32, Axis::PerChannel)?, qc(8, 32, Axis::PerToken)?));
    let int2 = Some((qc(2, 16, Axis::PerChannel)?, qc(2, 32, Axis::PerToken)?));
    let with = |mut s: StepSpec, cold| {
        s.cold = cold;
        s
    };
    let llama = (32, 8, 128);
    let cases = [
        with(StepSpec::new(HotKind::F16, llama, 33_000), int4),
        with(StepSpec::new(HotKind::Bf16, llama, 4_096), None),
        with(StepSpec::new(HotKind::F32, llama, 1), None),
        with(StepSpec::new(HotKind::F16, (9, 3, 64), 1_000), int2),
        with(StepSpec::new(HotKind::F32, (9, 3, 64), 777), int8),
        with(StepSpec::new(HotKind::Bf16, (16, 2, 256), 5_000), int4),
        with(StepSpec::new(HotKind::F16, (8, 8, 64), 3_000), None),
    ];
    r.line("\n## The CUDA kernel against the Rust kernel\n");
    r.line("| hot | heads / KV heads / dim | keys | cold | output err | mass err | |");
    r.line("|---|---|---:|---|---:|---:|---|");
    for s in cases {
        let h = HostStep::random(s)?;
        let (want, want_mass) = h.reference(Isa::detect(), 8)?;
        let dev = upload(&h, kern, true)?;
        // SAFETY: `upload` allocated every buffer at the size `DeviceStep`
        // documents, and the table indexes the pools it uploaded.
        unsafe { kern.run(&dev.step) }?;
        kern.synchronize()?;
        let got = to_vec(&dev.out)?;
        let mass = match &dev.scores {
            Some(t) => h.mass_from_scores(&to_vec(t)?),
            None => Vec::new(),
        };
        let (e_out, e_mass) = (max_rel_err(&got, &want), max_rel_err(&mass, &want_mass));
        let d = s.dims;
        let cold = s.cold.map_or("none".into(), |(k, v)| {
            format!("INT{} keys / INT{} values", k.bits(), v.bits())
        });
        let what = format!(
            "{:?} {}/{}/{} {} keys {cold}",
            s.kind, d.heads, d.kv_heads, d.head_dim, s.keys
        );
        let verdict = r.check(e_out <= 1e-3 && e_mass <= 1e-3, what);
        r.line(format!(
            "| {:?} | {}/{}/{} | {} | {cold} | {e_out:.2e} | {e_mass:.2e} | {verdict} |",
            s.kind, d.heads, d.kv_heads, d.head_dim, s.keys
        ));
    }
    Ok(())
}

/// Seconds per call of `f`, the median of `reps` timed after `warm`
/// untimed calls, with the device synchronized around each.
fn time_it(warm: usize, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    kvforge_engine::synchronize(Device::Cuda(0));
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        kvforge_engine::synchronize(Device::Cuda(0));
        v.push(t.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

pub(crate) fn bandwidth(r: &mut Report, kern: &CudaDecode) -> Result<()> {
    let dev = Device::Cuda(0);
    let n: i64 = 1 << 28; // 1 GiB of f32
    let src = Tensor::f_ones([n], (Kind::Float, dev))?;
    let mut dst = Tensor::f_empty([n], (Kind::Float, dev))?;
    let copy = time_it(2, 10, || {
        dst.f_copy_(&src)?;
        Ok(())
    })?;
    let copy_bw = 2.0 * (n * 4) as f64 / copy; // read + write
    drop((src, dst));
    r.line(format!(
        "\n## Bandwidth at 32k keys (Llama-3-8B layer: 32 / 8 heads, dim 128)\n\nDevice copy (1 GiB, read + write): {:.0} GB/s.\n",
        copy_bw / 1e9
    ));
    r.line("| pages | KV MB read | kernel µs | GB/s | × copy | with mass µs | gather + SDPA µs |");
    r.line("|---|---:|---:|---:|---:|---:|---:|");
    let llama = (32, 8, 128);
    let full = |kind, cold| {
        let mut s = StepSpec::new(kind, llama, 32_768);
        s.ragged = false;
        s.cold = cold;
        s
    };
    let int4 = Some((qc(4, 32, Axis::PerChannel)?, qc(4, 32, Axis::PerToken)?));
    // The f16 table, drawn and uploaded once: its row, then the sweep.
    let f16 = HostStep::random(full(HotKind::F16, None))?;
    let f16_dev = upload(&f16, kern, true)?;
    for (label, s) in [
        ("f16", None),
        ("bf16", Some(full(HotKind::Bf16, None))),
        (
            "f16 + INT4 (half the entries)",
            Some(full(HotKind::F16, int4)),
        ),
    ] {
        let drawn = s.map(HostStep::random).transpose()?;
        let h = drawn.as_ref().unwrap_or(&f16);
        let uploaded = drawn.as_ref().map(|h| upload(h, kern, true)).transpose()?;
        let dv = uploaded.as_ref().unwrap_or(&f16_dev);
        let s = h.spec;
        let plain = DeviceStep {
            scores: 0,
            ..dv.step
        };
        // SAFETY: as in `kernel_vs_cpu`.
        let secs = time_it(3, 50, || Ok(unsafe { kern.run(&plain) }?))?;
        // SAFETY: as above.
        let with_mass = time_it(3, 50, || Ok(unsafe { kern.run(&dv.step) }?))?;
        let bytes = h.kv_bytes() as f64;
        let gbs = bytes / secs;
        let sdpa = if s.cold.is_none() {
            format!("{:.1}", gather_sdpa(h)? * 1e6)
        } else {
            "—".into()
        };
        let ok = r.check(
            s.cold.is_some() || gbs >= 0.7 * copy_bw,
            format!(
                "{label}: {:.0} GB/s is under 70% of the copy bandwidth",
                gbs / 1e9
            ),
        );
        r.line(format!(
            "| {label} | {:.1} | {:.1} | {:.0} | {:.2} {ok} | {:.1} | {sdpa} |",
            bytes / 1e6,
            secs * 1e6,
            gbs / 1e9,
            gbs / copy_bw,
            with_mass * 1e6
        ));
    }
    r.line("\n(The 70% goal is checked on hot pages with the default launch shape; the mixed row reads codes and group parameters, and dequantizes per element.)");
    launch_shapes(r, kern, &f16, &f16_dev, copy_bw)
}

/// The launch shape: keys each warp loads ahead × blocks per
/// multiprocessor, on the f16 table `f16` (on the device: `dev`).
fn launch_shapes(
    r: &mut Report,
    kern: &CudaDecode,
    f16: &HostStep,
    dev: &OnDevice,
    copy_bw: f64,
) -> Result<()> {
    r.line(format!(
        "\nLaunch shapes, f16 at 32k keys (default: {:?}):\n\n| keys ahead | blocks per SM | kernel µs | GB/s | × copy |\n|---:|---:|---:|---:|---:|",
        kern.tuning()
    ));
    for unroll in cuda::UNROLLS {
        for blocks_per_sm in [1, 2, 4, 8] {
            let k = kern.clone().with_tuning(Tuning {
                unroll,
                blocks_per_sm,
            })?;
            // Only the scratch depends on the launch shape.
            let floats = k.scratch_floats(f16.spec.dims, f16.table.len());
            let scratch = Tensor::f_empty([floats as i64], (Kind::Float, Device::Cuda(0)))?;
            let step = DeviceStep {
                scores: 0,
                scratch: scratch.data_ptr() as u64,
                scratch_floats: floats,
                ..dev.step
            };
            // SAFETY: as in `kernel_vs_cpu`; `scratch` is sized for `k`.
            let secs = time_it(3, 50, || Ok(unsafe { k.run(&step) }?))?;
            let gbs = f16.kv_bytes() as f64 / secs;
            r.line(format!(
                "| {unroll} | {blocks_per_sm} | {:.1} | {:.0} | {:.2} |",
                secs * 1e6,
                gbs / 1e9,
                gbs / copy_bw
            ));
        }
    }
    Ok(())
}

/// libtorch's gather + SDPA over the same hot pool and table.
fn gather_sdpa(h: &HostStep) -> Result<f64> {
    let dev = Device::Cuda(0);
    let d = h.spec.dims;
    let kind = match h.spec.kind {
        HotKind::F32 => Kind::Float,
        HotKind::F16 => Kind::Half,
        HotKind::Bf16 => Kind::BFloat16,
    };
    let rows = |b: &[u8]| -> Result<Tensor> {
        let t = Tensor::from_slice(b).f_to_device(dev)?;
        Ok(t.f_view_dtype(kind)?
            .f_view([-1, d.kv_heads as i64, d.head_dim as i64])?)
    };
    let (k, v) = (rows(&h.k_pool)?, rows(&h.v_pool)?);
    let table = Tensor::from_slice(&h.table).f_to_device(dev)?;
    let q = Tensor::from_slice(&h.q)
        .f_to_device(dev)?
        .f_to_kind(kind)?
        .f_view([1, d.heads as i64, 1, d.head_dim as i64])?;
    time_it(3, 50, || {
        let prep = |t: &Tensor| -> Result<Tensor> {
            Ok(t.f_index_select(0, &table)?
                .f_transpose(0, 1)?
                .f_unsqueeze(0)?)
        };
        let _ = Tensor::f_scaled_dot_product_attention(
            &q,
            &prep(&k)?,
            &prep(&v)?,
            None::<&Tensor>,
            0.0,
            false,
            None::<f64>,
            true,
        )?;
        Ok(())
    })
}
