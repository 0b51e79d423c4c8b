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

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::{CompileError, CompileOptions};
use half::f16;
use kvforge_quant::{Axis, QuantConfig, QuantizedBlock};

use crate::{Dims, KernelError, Result};

#[path = "cuda_testing.rs"]
pub mod testing;

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("paged_decode.cu");

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

/// The group bounds with a kernel: a lane holds the query and accumulator
/// of this many query heads (4 keeps the registers of GQA groups up to 4,
/// Llama-3's and SmolLM2's, low).
const GROUP_BOUNDS: [usize; 2] = [4, MAX_GROUP];

/// One part kernel: hot storage, head dim, keys ahead, group bound.
type PartKey = (HotKind, usize, usize, usize);

/// The name of a part kernel.
fn part_name((kind, head_dim, unroll, group): PartKey) -> String {
    format!(
        "paged_decode_part_{}_d{head_dim}_u{unroll}_g{group}",
        kind.tag()
    )
}

/// The part kernel for steps over `hot` rows at `dims`.
fn part_key(hot: HotKind, dims: Dims, unroll: usize) -> Result<PartKey> {
    dims.check()?;
    let group = dims.heads / dims.kv_heads;
    let bound = GROUP_BOUNDS.into_iter().find(|&b| group <= b);
    match bound {
        Some(b) if HEAD_DIMS.contains(&dims.head_dim) && UNROLLS.contains(&unroll) => {
            Ok((hot, dims.head_dim, unroll, b))
        }
        _ => Err(KernelError::Unsupported(format!(
            "no CUDA kernel for head dim {}, {group} query heads per KV head, {unroll} keys ahead",
            dims.head_dim
        ))),
    }
}

/// Whether a kernel exists for `dims` (head dim, query heads per KV
/// head), whatever the hot dtype and launch shape.
pub fn has_kernel(dims: Dims) -> bool {
    part_key(HotKind::F32, dims, Tuning::default().unroll).is_ok()
}

/// NVRTC loads, or the error that says it does not.
fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(KernelError::Unsupported(
            "NVRTC (libnvrtc) is not on the library path: CUDA kernels cannot be compiled".into(),
        ))
    }
}

/// Every part kernel, in the order of [`entry_points`].
fn part_keys() -> Vec<PartKey> {
    let mut keys = Vec::new();
    for kind in [HotKind::F32, HotKind::F16, HotKind::Bf16] {
        for d in HEAD_DIMS {
            for u in UNROLLS {
                for g in GROUP_BOUNDS {
                    keys.push((kind, d, u, g));
                }
            }
        }
    }
    keys
}

/// Every entry point of [`SOURCE`].
pub fn entry_points() -> Vec<String> {
    let mut names: Vec<String> = part_keys().into_iter().map(part_name).collect();
    names.push("paged_decode_merge".into());
    names
}

/// Whether NVRTC (`libnvrtc`) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to `dlopen` the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether the CUDA driver (`libcuda`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// [`SOURCE`] with the part kernels `parts` instantiated.
fn source_with(parts: &[PartKey]) -> String {
    let mut src = String::from(SOURCE);
    for &key in parts {
        let (kind, d, u, g) = key;
        let kind = match kind {
            HotKind::F32 => 0,
            HotKind::F16 => 1,
            HotKind::Bf16 => 2,
        };
        src.push_str(&format!(
            "PART({}, {kind}, {d}, {u}, {g})\n",
            part_name(key)
        ));
    }
    src
}

/// [`SOURCE`] with every part kernel instantiated: what [`compile`]
/// checks, and what the CPU emulator runs.
pub fn full_source() -> String {
    source_with(&part_keys())
}

/// Compiles [`full_source`] with NVRTC for `arch` (`compute_90`, …) and
/// checks that the PTX holds every entry point. Needs NVRTC, not a GPU.
pub fn compile(arch: &str) -> Result<String> {
    compile_source(arch, &full_source(), &entry_points())
}

/// Compiles `src` for `arch` and checks that the PTX holds `names`.
fn compile_source(arch: &str, src: &str, names: &[String]) -> Result<String> {
    require_nvrtc()?;
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("paged_decode.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| {
        let why = match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        KernelError::Unsupported(format!("NVRTC rejected the CUDA kernels: {why}"))
    })?;
    let text = ptx.to_src();
    for name in names {
        if !text.contains(&format!(".entry {name}(")) {
            return Err(KernelError::Unsupported(format!(
                "the compiled PTX has no entry point {name}"
            )));
        }
    }
    Ok(text)
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

    /// Attends one decode step.
    ///
    /// # Safety
    ///
    /// Every address of `step` is a live allocation of this context of at
    /// least the size its field documents; every table entry names a slot
    /// inside the hot pool or a row inside the cold pool; nothing else
    /// writes `q`, the pools or the table, or reads `out`, `scratch` or
    /// `scores`, until the launches have run (they are queued on the
    /// legacy default stream).
    pub unsafe fn run(&self, step: &DeviceStep) -> Result<()> {
        self.check(step)?;
        let d = step.dims;
        let kernels = self.kernels(part_key(step.hot, d, self.tuning.unroll)?)?;
        let f = &kernels.part;
        let split_len = self.split_len(d, step.keys);
        let splits = step.keys.div_ceil(split_len);
        let int = |x: usize, what: &str| {
            i32::try_from(x).map_err(|_| KernelError::Shape(format!("{what} {x} exceeds i32")))
        };
        let (keys, heads, kv_heads) = (
            int(step.keys, "keys")?,
            int(d.heads, "heads")?,
            int(d.kv_heads, "KV heads")?,
        );
        let (split_len_i, splits_i, head_dim) = (
            int(split_len, "split")?,
            int(splits, "splits")?,
            int(d.head_dim, "head dim")?,
        );
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let part_ml = step.scratch;
        let part_acc = step.scratch + (2 * splits * d.heads * 4) as u64;
        let none = DeviceQuant {
            codes: 0,
            scales: 0,
            mins: 0,
            config: QuantConfig::new(8, 32, Axis::PerToken)?,
        };
        let (ck, cv, cold_tokens) = match step.cold {
            Some(c) => (c.keys, c.values, int(c.block_tokens, "cold block tokens")?),
            None => (none, none, 1),
        };
        let quant = |c: &QuantConfig| -> Result<(i32, i32, i32)> {
            Ok((
                int(c.bits() as usize, "bits")?,
                int(c.group_size(), "group")?,
                i32::from(c.axis() == Axis::PerChannel),
            ))
        };
        let ((kb, kg, kp), (vb, vg, vp)) = (quant(&ck.config)?, quant(&cv.config)?);
        let cfg = LaunchConfig {
            grid_dim: (d.kv_heads as u32, splits as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&step.q)
            .arg(&step.k_pool)
            .arg(&step.v_pool)
            .arg(&step.table)
            .arg(&keys)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&split_len_i)
            .arg(&scale)
            .arg(&part_ml)
            .arg(&part_acc)
            .arg(&step.scores)
            .arg(&ck.codes)
            .arg(&ck.scales)
            .arg(&ck.mins)
            .arg(&kb)
            .arg(&kg)
            .arg(&kp)
            .arg(&cv.codes)
            .arg(&cv.scales)
            .arg(&cv.mins)
            .arg(&vb)
            .arg(&vg)
            .arg(&vp)
            .arg(&cold_tokens);
        // SAFETY: the arguments match the kernel's parameters one for one
        // (types and order, see `paged_decode.cu`); the buffers are the
        // caller's contract.
        launch(|| unsafe { b.launch(cfg) })?;
        let stats = 0u64;
        let cfg = LaunchConfig {
            grid_dim: (d.heads as u32, 1, 1),
            block_dim: (d.head_dim.min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&kernels.merge);
        b.arg(&part_ml)
            .arg(&part_acc)
            .arg(&splits_i)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&step.out)
            .arg(&stats);
        // SAFETY: as above.
        launch(|| unsafe { b.launch(cfg) })?;
        Ok(())
    }
}

/// Runs one launch, its error or `cudarc`'s panic (a driver without a
/// symbol it expects) as an error.
fn launch<T>(
    f: impl FnOnce() -> std::result::Result<T, cudarc::driver::DriverError>,
) -> Result<()> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map(|_| ()).map_err(driver("launch")),
        Err(p) => Err(KernelError::Unsupported(format!(
            "the CUDA launch failed: {}",
            panic_text(&p)
        ))),
    }
}

/// A caught panic's message.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

impl DeviceStep {
    /// Checks what needs no device and no memory read: dimensions a kernel
    /// exists for, at least one key, no missing buffer, a cold layout the
    /// kernel decodes. The table's contents are the caller's to check.
    pub fn validate(&self) -> Result<()> {
        check_step(self)
    }
}

fn check_step(step: &DeviceStep) -> Result<()> {
    let d = step.dims;
    d.check()?;
    if !HEAD_DIMS.contains(&d.head_dim) {
        return Err(KernelError::Unsupported(format!(
            "no CUDA kernel for head dim {} (kernels exist for {HEAD_DIMS:?})",
            d.head_dim
        )));
    }
    if d.heads / d.kv_heads > MAX_GROUP {
        return Err(KernelError::Unsupported(format!(
            "{} query heads per KV head; the CUDA kernel handles up to {MAX_GROUP}",
            d.heads / d.kv_heads
        )));
    }
    if step.keys == 0 {
        return Err(KernelError::Shape("no keys to attend over".into()));
    }
    let null = |what: &str, p: u64| {
        if p == 0 {
            Err(KernelError::Shape(format!("no {what} buffer")))
        } else {
            Ok(())
        }
    };
    null("query", step.q)?;
    null("output", step.out)?;
    null("table", step.table)?;
    null("scratch", step.scratch)?;
    if let Some(c) = step.cold {
        check_cold(c, d)?;
    } else {
        null("hot key", step.k_pool)?;
        null("hot value", step.v_pool)?;
    }
    Ok(())
}

fn check_cold(c: DeviceCold, d: Dims) -> Result<()> {
    let shape = kvforge_quant::BlockShape {
        tokens: c.block_tokens,
        heads: d.kv_heads,
        head_dim: d.head_dim,
    };
    check_cold_layout(c.keys.config, c.values.config, shape)?;
    for (what, q) in [("keys", c.keys), ("values", c.values)] {
        if q.codes == 0 || q.scales == 0 || (q.config.bits() != 8 && q.mins == 0) {
            return Err(KernelError::Shape(format!("cold {what}: a missing buffer")));
        }
    }
    Ok(())
}

/// Whether the kernel decodes cold blocks of `shape` whose keys and
/// values were quantized as `keys` and `values` (unrotated): an error
/// saying why not.
pub fn check_cold_layout(
    keys: QuantConfig,
    values: QuantConfig,
    shape: kvforge_quant::BlockShape,
) -> Result<()> {
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(KernelError::Unsupported(format!(
            "no CUDA kernel for head dim {} (kernels exist for {HEAD_DIMS:?})",
            shape.head_dim
        )));
    }
    for (what, q) in [("keys", keys), ("values", values)] {
        check_layout(&q, shape)
            .map_err(|e| KernelError::Unsupported(format!("cold {what} on CUDA: {e}")))?;
    }
    Ok(())
}

/// What the CUDA dequantization assumes of a block's layout.
fn check_layout(cfg: &QuantConfig, shape: kvforge_quant::BlockShape) -> Result<()> {
    let c = shape.heads * shape.head_dim;
    let g = cfg.group_size();
    let ok = match cfg.axis() {
        Axis::PerChannel => shape.tokens % g == 0 && c * cfg.bits() as usize % 8 == 0,
        Axis::PerToken => shape.head_dim % g == 0,
    };
    if ok && shape.tokens > 0 {
        Ok(())
    } else {
        Err(KernelError::Shape(format!(
            "{} groups of {g} do not tile blocks of {} tokens × {c} channels",
            if cfg.axis() == Axis::PerChannel {
                "per-channel"
            } else {
                "per-token"
            },
            shape.tokens
        )))
    }
}

/// Cold blocks of one layer's keys or values, laid back to back as the
/// CUDA kernel reads them (upload each vector as is).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ColdPoolHost {
    /// Codes, block after block.
    pub codes: Vec<u8>,
    /// Group scales, block after block.
    pub scales: Vec<f16>,
    /// Group minima, block after block (empty for INT8).
    pub mins: Vec<f16>,
}

impl ColdPoolHost {
    /// Lays out `blocks`, which must share one shape and configuration.
    pub fn from_blocks(blocks: &[&QuantizedBlock]) -> Result<Self> {
        let Some(first) = blocks.first() else {
            return Ok(ColdPoolHost::default());
        };
        check_layout(&first.config, first.shape)?;
        let mut pool = ColdPoolHost::default();
        for (i, b) in blocks.iter().enumerate() {
            if b.shape != first.shape || b.config != first.config {
                return Err(KernelError::Shape(format!(
                    "cold block {i} is {:?} / {:?}, the pool's first {:?} / {:?}",
                    b.shape, b.config, first.shape, first.config
                )));
            }
            let groups = first.shape.len() / first.config.group_size();
            let mins = if first.config.bits() == 8 { 0 } else { groups };
            if b.packed.len() != first.shape.len() * first.config.bits() as usize / 8
                || b.scales.len() != groups
                || b.mins.len() != mins
            {
                return Err(KernelError::Shape(format!(
                    "cold block {i}: codes or group parameters truncated"
                )));
            }
            pool.codes.extend_from_slice(&b.packed);
            pool.scales.extend_from_slice(&b.scales);
            pool.mins.extend_from_slice(&b.mins);
        }
        Ok(pool)
    }

    /// Element (row `t` of block `b`, channel `c`) as the CUDA kernel's
    /// `cold_at` computes it — its index arithmetic, line for line, so the
    /// CPU tests can check it against `kvforge-quant`'s decoder.
    pub fn element(
        &self,
        cfg: &QuantConfig,
        block_tokens: usize,
        channels: usize,
        b: usize,
        t: usize,
        c: usize,
    ) -> f32 {
        let (bits, group) = (cfg.bits() as usize, cfg.group_size());
        let block_bytes = block_tokens * channels * bits / 8;
        let block_groups = block_tokens * channels / group;
        let (byte, plane, gi) = if cfg.axis() == Axis::PerChannel {
            let row_bytes = channels * bits / 8;
            (
                t * row_bytes + c % row_bytes,
                c / row_bytes,
                c * (block_tokens / group) + t / group,
            )
        } else {
            let idx = t * channels + c;
            let bpg = group * bits / 8;
            let gi = idx / group;
            let within = idx % group;
            (gi * bpg + within % bpg, within / bpg, gi)
        };
        let code = self.codes[b * block_bytes + byte];
        let s = self.scales[b * block_groups + gi].to_f32();
        if bits == 8 {
            return f32::from(code as i8) * s;
        }
        let q = (code >> (plane * bits)) & ((1u8 << bits) - 1);
        f32::from(q) * s + self.mins[b * block_groups + gi].to_f32()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// What a GPU compiles for one step: that part kernel and the merge,
    /// nothing else.
    #[test]
    fn one_variant_compiles_alone() {
        let dims = Dims {
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
        };
        let key = part_key(HotKind::Bf16, dims, 4).unwrap();
        let bad = Dims {
            head_dim: 96,
            ..dims
        };
        assert!(part_key(HotKind::F16, bad, 2).is_err());
        assert!(part_key(HotKind::F16, dims, 3).is_err());
        assert!(has_kernel(dims) && !has_kernel(bad));
        if !nvrtc_present() {
            assert!(std::env::var_os("KVFORGE_REQUIRE_NVRTC").is_none());
            return;
        }
        let names = [part_name(key), "paged_decode_merge".to_string()];
        let ptx = compile_source("compute_90", &source_with(&[key]), &names).unwrap();
        assert!(ptx.contains(".entry paged_decode_part_bf16_d128_u4_g4("));
        assert_eq!(ptx.matches(".entry ").count(), 2);
    }
}
