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

mod kernel;
mod model;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvforge_bench::output::Output;
use kvforge_engine::{Device, Kind, Tensor};
use kvforge_kernels::cuda::{CudaDecode, HotKind};

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
        model::engine_logits(&mut r, Device::Cpu, true)?;
        model::throughput(&mut r, Device::Cpu, true)?;
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
            ("kernel against the CPU", &|r| {
                kernel::kernel_vs_cpu(r, &kern)
            }),
            ("bandwidth", &|r| kernel::bandwidth(r, &kern)),
            ("engine logits", &|r| model::engine_logits(r, gpu, false)),
            ("throughput", &|r| model::throughput(r, gpu, false)),
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

pub(crate) fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(
        t.f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?
            .f_flatten(0, -1)?,
    )?)
}
