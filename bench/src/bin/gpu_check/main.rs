//! The one prepared run for a lent GPU (`cargo xtask gpu-check` builds,
//! strips and stages it with its launcher; DESIGN.md "The GPU machine").
//! Everything in one go, a Markdown report on stdout and in
//! `--out DIR/gpu-check.md`:
//!
//! 1. NVRTC compiles the kernels for the device and the driver loads them.
//! 2. The CUDA kernel against the Rust one (`PagedDecode`) on random mixed
//!    tables (f32 / f16 / bf16 hot rows, INT8 / INT4 / INT2 cold blocks,
//!    ragged entries, aliases, up to 33k keys): output and attention mass.
//! 3. Bandwidth at 32k keys of a Llama-3-8B layer (32 query / 8 KV heads,
//!    head dim 128): the kernel's KV bytes per second against the device's
//!    copy bandwidth, hot f16 and mixed with INT4, beside libtorch's
//!    gather + SDPA on the same pool.
//! 4. The engine's logits on CUDA against the CPU's (f32, SmolLM2-135M's
//!    shape with random weights — the real model does not fit the 64 MiB
//!    carry): prefill, then decode steps through the CUDA kernel.
//! 5. Decode throughput of a Llama-3-8B-shaped random model (bf16) at 4k
//!    and 32k, unquantized and with the INT4 tier, the fused backend (the
//!    CUDA kernel; cold rows from the tier's device copy) against the
//!    reference, interleaved (the reference dequantizes cold blocks on the
//!    host: not run for INT4 at 32k).
//!
//! Exits non-zero if a check fails. `--dry-run 1` runs sections 4 and 5 on
//! the CPU at toy sizes (no GPU needed) to check the harness itself.

#![allow(clippy::print_stdout)] // a report printer

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvforge_bench::median;
use kvforge_bench::output::Output;
use kvforge_engine::ppl::greedy_token;
use kvforge_engine::{
    AttentionBackend, Device, FusedBackend, Kind, KvQuant, Llama, LlamaConfig, PagedKvCache,
    ReferenceBackend, Sequence, Tensor,
};
use kvforge_kernels::Isa;
use kvforge_kernels::cuda::testing::{HostStep, StepSpec, max_rel_err};
use kvforge_kernels::cuda::{
    self, CudaDecode, DeviceCold, DeviceQuant, DeviceStep, HotKind, Tuning,
};
use kvforge_quant::{Axis, QuantConfig, f16};

/// The report, and what failed.
#[derive(Default)]
struct Report {
    md: String,
    failed: Vec<String>,
}

impl Report {
    fn line(&mut self, s: impl AsRef<str>) {
        println!("{}", s.as_ref());
        let _ = writeln!(self.md, "{}", s.as_ref());
    }

    /// Records a check; a failed one is listed at the end.
    fn check(&mut self, ok: bool, what: String) -> &'static str {
        if !ok {
            self.failed.push(what);
        }
        if ok { "ok" } else { "**FAILED**" }
    }
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("gpu-check", run)
}

/// The GPU checks of `cargo xtask gpu-check`: the CUDA decode kernel
/// against the reference, the engine's logits and throughput on the GPU.
#[derive(Parser)]
#[command(name = "gpu-check")]
struct Args {
    /// Where the report goes.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// 1: the harness at toy sizes on the CPU, not the GPU.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    dry_run: u8,
}

fn run() -> Result<()> {
    let a: Args = kvforge_bench::cli::parse()?;
    let (out_dir, dry) = (a.out, a.dry_run == 1);
    let mut out = Output::create(&out_dir)?;
    let mut r = Report::default();
    r.line("# gpu-check");
    if dry {
        r.line("\nDry run on the CPU at toy sizes: the harness, not the GPU.");
        engine_logits(&mut r, Device::Cpu, true)?;
        throughput(&mut r, Device::Cpu, true)?;
    } else {
        if kvforge_engine::cuda_devices() == 0 {
            bail!("libtorch sees no CUDA device (LD_LIBRARY_PATH must hold torch/lib)");
        }
        let kern = CudaDecode::new(0).context("opening the GPU")?;
        let name = kern.context().name().unwrap_or_else(|_| "?".into());
        let t = Instant::now();
        let llama = kvforge_kernels::Dims {
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
        };
        kern.prepare(HotKind::F16, llama)
            .context("compiling the CUDA kernels")?;
        r.line(format!(
            "\nDevice: {name}; one kernel variant (f16, head dim 128, groups of 4) compiled by NVRTC for {} and loaded in {:.2} s.",
            kern.arch(),
            t.elapsed().as_secs_f64()
        ));
        // A section that errors is a failed check; the others still run.
        let gpu = Device::Cuda(0);
        let sections: [(&str, &Section<'_>); 4] = [
            ("kernel against the CPU", &|r| kernel_vs_cpu(r, &kern)),
            ("bandwidth", &|r| bandwidth(r, &kern)),
            ("engine logits", &|r| engine_logits(r, gpu, false)),
            ("throughput", &|r| throughput(r, gpu, false)),
        ];
        for (name, section) in sections {
            if let Err(e) = section(&mut r) {
                r.line(format!(
                    "
**{name}: error: {e:#}**"
                ));
                r.check(false, format!("{name}: {e:#}"));
            }
        }
    }
    let path = out.report_as("gpu-check.md", &r.md)?;
    if !r.failed.is_empty() {
        bail!(
            "{} check(s) failed: {}",
            r.failed.len(),
            r.failed.join("; ")
        );
    }
    println!("\ngpu-check: all checks passed ({})", path.display());
    Ok(())
}

/// One part of the report.
type Section<'a> = dyn Fn(&mut Report) -> Result<()> + 'a;

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

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(
        t.f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?
            .f_flatten(0, -1)?,
    )?)
}

fn qc(bits: u32, group: usize, axis: Axis) -> Result<QuantConfig> {
    Ok(QuantConfig::new(bits, group, axis)?)
}

fn kernel_vs_cpu(r: &mut Report, kern: &CudaDecode) -> Result<()> {
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

fn bandwidth(r: &mut Report, kern: &CudaDecode) -> Result<()> {
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
    // The launch shape: keys each warp loads ahead × blocks per
    // multiprocessor, on the f16 table.
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
                ..f16_dev.step
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

/// SmolLM2-135M's shape (or a toy one for the dry run).
fn smollm2(dry: bool) -> LlamaConfig {
    if dry {
        return LlamaConfig {
            max_ctx: 1024,
            head_dim: 64,
            n_heads: 4,
            n_kv_heads: 2,
            d_model: 128,
            ..LlamaConfig::tiny()
        };
    }
    LlamaConfig {
        vocab: 49_152,
        d_model: 576,
        n_layers: 30,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        ffn: 1536,
        rms_eps: 1e-5,
        rope_theta: 100_000.0,
        max_ctx: 8192,
    }
}

/// Deterministic token ids below `vocab`.
fn ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Prefills `prompt` in chunks of `chunk` and returns the last logits.
fn prefill(
    model: &Llama,
    cache: &PagedKvCache,
    seq: &mut Sequence,
    prompt: &[u32],
    chunk: usize,
) -> Result<Tensor> {
    let mut last = None;
    for c in prompt.chunks(chunk) {
        last = Some(model.forward(c, &mut cache.view(seq), false)?);
    }
    last.context("empty prompt")
}

fn engine_logits(r: &mut Report, dev: Device, dry: bool) -> Result<()> {
    let cfg = smollm2(dry);
    let (prompt_len, steps) = if dry { (100, 4) } else { (600, 24) };
    let status = match dev {
        Device::Cuda(n) => FusedBackend::cuda_status(n),
        _ => Err("the CPU".into()),
    };
    r.line(format!(
        "\n## Engine logits, {dev:?} against the CPU (f32, SmolLM2-135M's shape, random weights)\n\nDecode attention on {dev:?}: {}.\n",
        match &status {
            Ok(arch) => format!("the CUDA kernel ({arch})"),
            Err(why) => format!("the reference ({why})"),
        }
    ));
    if !dry {
        r.check(
            status.is_ok(),
            format!("the engine's CUDA kernel did not load: {status:?}"),
        );
    }
    let prompt = ids(prompt_len, cfg.vocab, 42);
    let cpu = Llama::random(cfg.clone(), 3, Device::Cpu, Kind::Float)?;
    let gpu = Llama::random(cfg.clone(), 3, dev, Kind::Float)?;
    type Logits = Vec<Vec<f32>>;
    let run = |m: &Llama,
               backend: Box<dyn AttentionBackend>,
               tier: Option<KvQuant>,
               feed: Option<&[u32]>|
     -> Result<(Logits, Vec<u32>)> {
        let mut cache =
            PagedKvCache::new(&m.cfg, 16, prompt_len + steps + 16, m.device(), Kind::Float)?;
        cache.set_cold_tier(tier)?;
        cache.set_backend(backend);
        let mut seq = Sequence::default();
        let mut last = prefill(m, &cache, &mut seq, &prompt, 256)?;
        let (mut all, mut toks) = (vec![to_vec(&last)?], Vec::new());
        for i in 0..steps {
            let t = match feed {
                Some(f) => f[i],
                None => greedy_token(&last)?,
            };
            toks.push(t);
            last = m.forward(&[t], &mut cache.view(&mut seq), false)?;
            all.push(to_vec(&last)?);
        }
        cache.free(&mut seq)?;
        Ok((all, toks))
    };
    let diff = |a: &Logits, b: &Logits, from: usize| {
        a[from..]
            .iter()
            .zip(&b[from..])
            .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
            .fold(0f32, f32::max)
    };
    r.line(
        "| KV cache | on the device | against | max abs diff, prefill | max abs diff, decode | |",
    );
    r.line("|---|---|---|---:|---:|---|");
    let int4 = KvQuant {
        window: 64,
        sink: 16,
        ..KvQuant::parse("int4")?
    };
    for tier in [None, Some(int4)] {
        let label = tier.map_or_else(|| "f32 unquantized".to_string(), |q| q.name());
        let (cpu_l, toks) = run(&cpu, Box::<FusedBackend>::default(), tier, None)?;
        let (fused, _) = run(&gpu, Box::<FusedBackend>::default(), tier, Some(&toks))?;
        let (reference, _) = run(&gpu, Box::new(ReferenceBackend), tier, Some(&toks))?;
        // Quantized blocks may round differently from the GPU's hot rows
        // than from the CPU's (a code one step apart): against the CPU the
        // INT4 rows are reported, not checked; fused against reference on
        // the device reads the very same codes.
        for (name, got, against, base, checked) in [
            ("fused", &fused, "CPU", &cpu_l, tier.is_none()),
            ("reference", &reference, "CPU", &cpu_l, tier.is_none()),
            ("fused", &fused, "reference on the device", &reference, true),
        ] {
            let (pre, dec) = (
                diff(&got[..1].to_vec(), &base[..1].to_vec(), 0),
                diff(got, base, 1),
            );
            let ok = if checked {
                r.check(
                    pre <= 1e-3 && dec <= 1e-3,
                    format!(
                        "{label}, {name} against {against}: logits differ by {pre:.2e} / {dec:.2e}"
                    ),
                )
            } else {
                "(reported)"
            };
            r.line(format!(
                "| {label} | {name} | {against} | {pre:.2e} | {dec:.2e} | {ok} |"
            ));
        }
    }
    Ok(())
}

fn throughput(r: &mut Report, dev: Device, dry: bool) -> Result<()> {
    let cfg = if dry {
        LlamaConfig {
            max_ctx: 2048,
            head_dim: 64,
            n_heads: 8,
            n_kv_heads: 2,
            d_model: 128,
            ..LlamaConfig::tiny()
        }
    } else {
        LlamaConfig {
            vocab: 128_256,
            d_model: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            ffn: 14_336,
            rms_eps: 1e-5,
            rope_theta: 500_000.0,
            max_ctx: 32_768 + 256,
        }
    };
    let kind = if dev == Device::Cpu {
        Kind::Float
    } else {
        Kind::BFloat16
    };
    let t = Instant::now();
    let model = Llama::random_on_device(cfg.clone(), 1, dev, kind)?;
    r.line(format!(
        "\n## Decode throughput, Llama-3-8B shape (random weights, {kind:?} weights and KV, blocks of 16)\n\nModel drawn in {:.1} s. Rounds interleave the backends on the same cache; medians.\n",
        t.elapsed().as_secs_f64()
    ));
    r.line("| context | KV cache | backend | decode tok/s | × reference |");
    r.line("|---:|---|---|---:|---:|");
    let (contexts, steps, rounds) = if dry {
        (vec![256, 1024], 4, 2)
    } else {
        (vec![4096, 32_768], 16, 3)
    };
    for ctx in contexts {
        for tier in [None, Some(KvQuant::parse("int4")?)] {
            // The reference dequantizes cold blocks on the host: seconds
            // per step at 32k; the fused kernel reads the device copy.
            let names: &[&str] = if tier.is_some() && ctx > 4096 {
                &["fused"]
            } else {
                &["fused", "reference"]
            };
            let mut cache =
                PagedKvCache::new(&model.cfg, 16, ctx + steps * rounds * 2 + 16, dev, kind)?;
            cache.set_cold_tier(tier)?;
            let mut seq = Sequence::default();
            let prompt = ids(ctx, cfg.vocab, ctx as u64);
            let t = Instant::now();
            let mut last = prefill(&model, &cache, &mut seq, &prompt, 2048)?;
            let prefill_s = t.elapsed().as_secs_f64();
            let mut rates = vec![Vec::new(); names.len()];
            for _ in 0..rounds {
                for (b, name) in names.iter().enumerate() {
                    cache.set_backend(if *name == "fused" {
                        Box::new(FusedBackend::default())
                    } else {
                        Box::new(ReferenceBackend)
                    });
                    if dev != Device::Cpu {
                        kvforge_engine::synchronize(Device::Cuda(0));
                    }
                    // The reference over a cold tier dequantizes on the
                    // host (about a second per step): fewer steps, the
                    // same per-step rate.
                    let n = if tier.is_some() && *name == "reference" {
                        steps.min(4)
                    } else {
                        steps
                    };
                    let t = Instant::now();
                    for _ in 0..n {
                        let next = greedy_token(&last)?;
                        last = model.forward(&[next], &mut cache.view(&mut seq), false)?;
                    }
                    let _ = greedy_token(&last)?; // waits for the device
                    rates[b].push(n as f64 / t.elapsed().as_secs_f64());
                }
            }
            let label = tier.map_or_else(|| "unquantized".to_string(), |q| q.name());
            let reference = rates.get(1).map(|v| median(v.clone()));
            for (b, name) in names.iter().enumerate() {
                let rate = median(rates[b].clone());
                let ratio = reference.map_or("—".into(), |x| format!("{:.2}", rate / x));
                r.line(format!(
                    "| {ctx} | {label} | {name} | {rate:.1} | {ratio} |"
                ));
            }
            r.line(format!(
                "| {ctx} | {label} | (prefill {:.1} s) | | |",
                prefill_s
            ));
            cache.free(&mut seq)?;
        }
    }
    Ok(())
}
