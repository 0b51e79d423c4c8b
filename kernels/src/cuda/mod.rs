//! The paged decode kernel on CUDA: CUDA C compiled at run time by NVRTC
//! (each variant — hot dtype, head dim, keys ahead, group bound — when a
//! step first needs it) and launched through the driver API (`cudarc`,
//! loaded dynamically, so building needs no CUDA and a machine without it
//! gets an error, never a panic).
//!
//! The kernel (`paged_decode.cu`) attends one decode step over a table of
//! keys: `table[j] ≥ 0` is a row of the hot pool (f32, f16 or bf16 rows
//! `[kv_heads][head_dim]`), `table[j] < 0` row `-1 - table[j]` of the cold
//! pool (same-shape blocks quantized by `kvforge-quant`, laid out by
//! [`ColdPoolHost`]). Flash-decoding: one launch attends runs of keys per
//! KV head (a warp per key, an online softmax per warp), a second merges
//! the runs. On request it also writes every scaled logit (`[heads][keys]`)
//! — a softmax over them is the attention mass per key.
//!
//! Buffers are the caller's (in the engine, tensors that libtorch owns, in
//! the same primary context); launches go to the legacy default stream,
//! the one libtorch uses unless told otherwise, so they are ordered with
//! the caller's work without a synchronization.

mod checks;
mod cold_pool;
mod launch;
mod source;
pub mod testing;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, sys};
use kvforge_quant::QuantConfig;

use crate::{Dims, KernelError, Result};

pub use checks::check_cold_layout;
pub use cold_pool::ColdPoolHost;
use source::{PartKey, compile_source, part_key, part_name, require_nvrtc, source_with};
pub use source::{compile, driver_present, entry_points, full_source, has_kernel, nvrtc_present};

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("../paged_decode.cu");

/// Head dims with a kernel.
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The most query heads per KV head the kernel handles.
pub const MAX_GROUP: usize = 8;

/// Threads per block of the part kernel (4 warps).
const THREADS: u32 = 128;

/// The fewest keys one block attends before the context is split further.
const MIN_SPLIT: usize = 64;

/// How the hot pool's rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HotKind {
    /// f32.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl HotKind {
    fn tag(self) -> &'static str {
        match self {
            HotKind::F32 => "f32",
            HotKind::F16 => "f16",
            HotKind::Bf16 => "bf16",
        }
    }
}

/// Keys each warp loads ahead, with a kernel each.
pub const UNROLLS: [usize; 2] = [2, 4];

/// The launch shape: how many keys each warp loads before using them, and
/// how many blocks per multiprocessor the context is cut into. Bandwidth
/// on a GPU depends on both (bytes in flight against registers);
/// `gpu_check` sweeps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// 2 or 4 ([`UNROLLS`]).
    pub unroll: usize,
    /// Blocks of the part kernel per multiprocessor (at least 1).
    pub blocks_per_sm: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            unroll: 2,
            blocks_per_sm: 2,
        }
    }
}

impl Tuning {
    /// `self`, or an error for an unroll without a kernel or no blocks.
    pub fn check(self) -> Result<Self> {
        if !UNROLLS.contains(&self.unroll) || self.blocks_per_sm == 0 {
            return Err(KernelError::Unsupported(format!(
                "no CUDA kernel loads {} keys ahead with {} blocks per multiprocessor (unrolls: {UNROLLS:?})",
                self.unroll, self.blocks_per_sm
            )));
        }
        Ok(self)
    }
}

/// One quantized half (keys or values) of a device cold pool.
#[derive(Clone, Copy, Debug)]
pub struct DeviceQuant {
    /// Packed codes, `[blocks][block_tokens × kv_heads × head_dim × bits / 8]`.
    pub codes: u64,
    /// f16 group scales, `[blocks][groups]`.
    pub scales: u64,
    /// f16 group minima (affine formats; 0 for INT8).
    pub mins: u64,
    /// How the blocks were quantized.
    pub config: QuantConfig,
}

/// A cold pool on the device: `blocks` same-shape blocks.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCold {
    /// The keys' pool.
    pub keys: DeviceQuant,
    /// The values' pool.
    pub values: DeviceQuant,
    /// Rows per block.
    pub block_tokens: usize,
}

/// The buffers of one decode step, as device addresses (`u64`), and their
/// sizes. Every address is in the context of the [`CudaDecode`] that runs
/// it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceStep {
    /// Head counts and size.
    pub dims: Dims,
    /// How the hot pool is stored.
    pub hot: HotKind,
    /// Hot keys, `[slots][kv_heads][head_dim]` (0 if the table has no hot
    /// row).
    pub k_pool: u64,
    /// Hot values, same layout.
    pub v_pool: u64,
    /// `[keys]` i64: per key, its hot slot, or `-1 - r` for row `r` of the
    /// cold pool (block `r / block_tokens`, row `r % block_tokens`).
    pub table: u64,
    /// Keys attended, at least one.
    pub keys: usize,
    /// The cold pool, if the table has cold rows.
    pub cold: Option<DeviceCold>,
    /// `[heads][head_dim]` f32, already rotated by RoPE.
    pub q: u64,
    /// `[heads][head_dim]` f32 output.
    pub out: u64,
    /// f32 scratch of [`CudaDecode::scratch_floats`] elements.
    pub scratch: u64,
    /// Its length.
    pub scratch_floats: usize,
    /// `[heads][keys]` f32 to receive every scaled logit, or 0.
    pub scores: u64,
}

/// The compiled kernels, loaded in a device's primary context.
#[derive(Clone)]
pub struct CudaDecode {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Each part kernel tried so far, with the merge kernel of its module
    /// or why it did not compile or load (shared by clones; a failure is
    /// not retried).
    parts: Arc<std::sync::Mutex<Vec<Variant>>>,
    sms: usize,
    arch: String,
    tuning: Tuning,
}

/// A part kernel tried: its module's kernels, or why not.
type Variant = (PartKey, Result<Kernels>);

/// One compiled module: a part kernel and the merge kernel.
#[derive(Clone)]
struct Kernels {
    part: CudaFunction,
    merge: CudaFunction,
}

impl std::fmt::Debug for CudaDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDecode")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("sms", &self.sms)
            .field("tuning", &self.tuning)
            .finish()
    }
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| KernelError::Unsupported(format!("CUDA {what}: {e}"))
}

impl CudaDecode {
    /// The kernels for GPU `ordinal`, in its primary context (libtorch's):
    /// each variant a step needs is compiled for the device's
    /// architecture and loaded the first time it runs (about 0.2 s). An
    /// error, never a panic, when the driver, NVRTC or the device is
    /// missing — or when the driver lacks a symbol `cudarc` expects (it
    /// panics then; caught here).
    pub fn new(ordinal: usize) -> Result<Self> {
        std::panic::catch_unwind(|| Self::load(ordinal)).unwrap_or_else(|p| {
            Err(KernelError::Unsupported(format!(
                "the CUDA driver API failed: {}",
                panic_text(&p)
            )))
        })
    }

    fn load(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(KernelError::Unsupported(
                "no CUDA driver (libcuda) on this machine".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(driver("device count"))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(KernelError::Unsupported(format!(
                "cuda:{ordinal} requested but {count} GPU(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("context"))?;
        let attr = |a| ctx.attribute(a).map_err(driver("device attribute"));
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        require_nvrtc()?;
        Ok(CudaDecode {
            stream: ctx.default_stream(),
            ctx,
            parts: Arc::default(),
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            arch: format!("compute_{major}{minor}"),
            tuning: Tuning::default(),
        })
    }

    /// The part kernel `key` and a merge kernel, compiled and loaded on
    /// first use.
    fn kernels(&self, key: PartKey) -> Result<Kernels> {
        let mut parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = parts.iter().find(|(k, _)| *k == key) {
            return k.clone();
        }
        let k = self.compile_and_load(key);
        parts.push((key, k.clone()));
        k
    }

    fn compile_and_load(&self, key: PartKey) -> Result<Kernels> {
        let names = [part_name(key), "paged_decode_merge".to_string()];
        let ptx = compile_source(&self.arch, &source_with(&[key]), &names)?;
        let load = || -> std::result::Result<Kernels, cudarc::driver::DriverError> {
            let module = self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?;
            Ok(Kernels {
                part: module.load_function(&names[0])?,
                merge: module.load_function(&names[1])?,
            })
        };
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(load))
            .map_err(|p| {
                KernelError::Unsupported(format!("loading CUDA kernels: {}", panic_text(&p)))
            })?
            .map_err(driver("module load"))
    }

    /// Compiles and loads the kernels for steps over `hot` rows at `dims`
    /// now rather than at the first such step (to time it, or to fail
    /// early).
    pub fn prepare(&self, hot: HotKind, dims: Dims) -> Result<()> {
        self.kernels(part_key(hot, dims, self.tuning.unroll)?)
            .map(|_| ())
    }

    /// Launches with `tuning` from now on; an error for an unroll without
    /// a kernel.
    pub fn with_tuning(mut self, tuning: Tuning) -> Result<Self> {
        self.tuning = tuning.check()?;
        Ok(self)
    }

    /// The launch shape in use.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// The context the kernels live in (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream launches go to (the legacy default stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The architecture the kernels were compiled for (`compute_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Waits for every launch so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// Keys per block run: enough runs for the tuning's blocks per
    /// multiprocessor, at least [`MIN_SPLIT`] keys each.
    fn split_len(&self, dims: Dims, keys: usize) -> usize {
        let blocks = self.tuning.blocks_per_sm * self.sms;
        let runs = blocks.div_ceil(dims.kv_heads).max(1);
        keys.div_ceil(runs).max(MIN_SPLIT)
    }

    /// f32 scratch a step over `keys` keys needs.
    pub fn scratch_floats(&self, dims: Dims, keys: usize) -> usize {
        let splits = keys.div_ceil(self.split_len(dims, keys)).max(1);
        splits * dims.heads * (2 + dims.head_dim)
    }

    /// Checks everything about `step` that can be checked without reading
    /// device memory: [`DeviceStep::validate`] and the scratch size.
    pub fn check(&self, step: &DeviceStep) -> Result<()> {
        step.validate()?;
        let need = self.scratch_floats(step.dims, step.keys);
        if step.scratch_floats < need {
            return Err(KernelError::Shape(format!(
                "a scratch of {} floats; this step needs {need}",
                step.scratch_floats
            )));
        }
        Ok(())
    }
}

/// A caught panic's message.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}
