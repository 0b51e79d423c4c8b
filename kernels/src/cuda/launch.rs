//! Launching one decode step: the part kernel over runs of keys, then the
//! merge.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use kvforge_quant::{Axis, QuantConfig};

use super::source::part_key;
use super::{CudaDecode, DeviceQuant, DeviceStep, THREADS, driver, panic_text};
use crate::{KernelError, Result};

impl CudaDecode {
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
