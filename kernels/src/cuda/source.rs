//! The CUDA C source of each kernel variant, and compiling it with NVRTC.

use cudarc::nvrtc::{CompileError, CompileOptions};

use super::{HEAD_DIMS, HotKind, MAX_GROUP, SOURCE, Tuning, UNROLLS};
use crate::{Dims, KernelError, Result};

/// The group bounds with a kernel: a lane holds the query and accumulator
/// of this many query heads (4 keeps the registers of GQA groups up to 4,
/// Llama-3's and SmolLM2's, low).
const GROUP_BOUNDS: [usize; 2] = [4, MAX_GROUP];

/// One part kernel: hot storage, head dim, keys ahead, group bound.
pub(super) type PartKey = (HotKind, usize, usize, usize);

/// The name of a part kernel.
pub(super) fn part_name((kind, head_dim, unroll, group): PartKey) -> String {
    format!(
        "paged_decode_part_{}_d{head_dim}_u{unroll}_g{group}",
        kind.tag()
    )
}

/// The part kernel for steps over `hot` rows at `dims`.
pub(super) fn part_key(hot: HotKind, dims: Dims, unroll: usize) -> Result<PartKey> {
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
pub(super) fn require_nvrtc() -> Result<()> {
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
pub(super) fn source_with(parts: &[PartKey]) -> String {
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
pub(super) fn compile_source(arch: &str, src: &str, names: &[String]) -> Result<String> {
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
