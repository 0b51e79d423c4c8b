//! The CUDA twin without a GPU: every kernel compiles with NVRTC (CI sets
//! `KVFORGE_REQUIRE_NVRTC=1` and puts the venv's NVRTC on the library
//! path, so a missing library fails there instead of skipping), the cold
//! pool's layout and the kernel's index arithmetic against
//! `kvforge-quant`'s decoder, malformed steps refused before any launch,
//! and a missing driver reported as an error. What runs on a GPU is
//! `cargo xtask gpu-check`.

use kvforge_kernels::cuda::{
    self, ColdPoolHost, CudaDecode, DeviceCold, DeviceQuant, DeviceStep, HotKind,
};
use kvforge_kernels::{Dims, KernelError};
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, Quantizer};

#[test]
fn nvrtc_compiles_every_kernel() {
    if !cuda::nvrtc_present() {
        assert!(
            std::env::var_os("KVFORGE_REQUIRE_NVRTC").is_none(),
            "KVFORGE_REQUIRE_NVRTC is set and NVRTC is not on the library path"
        );
        eprintln!("skipped: no libnvrtc on the library path");
        return;
    }
    // Hopper (the GPU machine) and Ampere.
    for arch in ["compute_90", "compute_80"] {
        let ptx = cuda::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for name in cuda::entry_points() {
            assert!(ptx.contains(&format!(".entry {name}(")), "{arch}: {name}");
        }
    }
}

#[test]
fn a_bad_architecture_is_an_error() {
    if !cuda::nvrtc_present() {
        return;
    }
    let e = cuda::compile("compute_1").unwrap_err();
    assert!(e.to_string().contains("NVRTC rejected"), "{e}");
}

#[test]
fn a_missing_driver_is_an_error_not_a_panic() {
    if cuda::driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let e = CudaDecode::new(0).unwrap_err();
    assert!(matches!(e, KernelError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("no CUDA driver"), "{e}");
}

/// splitmix64.
fn rng(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Every element the kernel's `cold_at` arithmetic reads equals what
/// `GroupQuantizer` decodes, for every format the cold tier writes.
#[test]
fn cold_pool_layout_and_indexing_match_the_quantizer() {
    let shape = BlockShape {
        tokens: 32,
        heads: 3,
        head_dim: 64,
    };
    let c = shape.heads * shape.head_dim;
    let configs = [
        (8, 32, Axis::PerToken),
        (4, 32, Axis::PerToken),
        (4, 64, Axis::PerToken),
        (2, 32, Axis::PerToken),
        (8, 32, Axis::PerChannel),
        (4, 16, Axis::PerChannel),
        (4, 32, Axis::PerChannel),
        (2, 32, Axis::PerChannel),
    ];
    let mut state = 7u64;
    for (bits, group, axis) in configs {
        let cfg = QuantConfig::new(bits, group, axis).unwrap();
        let qz = GroupQuantizer::new(cfg);
        let blocks: Vec<_> = (0..3)
            .map(|_| {
                let x: Vec<f32> = (0..shape.len()).map(|_| rng(&mut state) * 3.0).collect();
                qz.quantize(shape, &x).unwrap()
            })
            .collect();
        let refs: Vec<_> = blocks.iter().collect();
        let pool = ColdPoolHost::from_blocks(&refs).unwrap();
        for (b, block) in blocks.iter().enumerate() {
            let mut want = vec![0f32; shape.len()];
            qz.dequantize(block, &mut want).unwrap();
            for t in 0..shape.tokens {
                for ch in 0..c {
                    let got = pool.element(&cfg, shape.tokens, c, b, t, ch);
                    assert_eq!(
                        got.to_bits(),
                        want[t * c + ch].to_bits(),
                        "{cfg:?} block {b} row {t} channel {ch}"
                    );
                }
            }
        }
    }
}

#[test]
fn cold_layouts_the_kernel_cannot_decode_are_named() {
    let shape = |tokens, head_dim| BlockShape {
        tokens,
        heads: 3,
        head_dim,
    };
    let q = |bits, group, axis| QuantConfig::new(bits, group, axis).unwrap();
    let v = q(4, 32, Axis::PerToken);
    cuda::check_cold_layout(q(4, 32, Axis::PerChannel), v, shape(32, 64)).unwrap();
    for (k, sh, says) in [
        (
            q(4, 32, Axis::PerChannel),
            shape(16, 64),
            "cold keys on CUDA",
        ),
        (
            q(4, 32, Axis::PerChannel),
            shape(32, 96),
            "no CUDA kernel for head dim 96",
        ),
        (
            q(4, 128, Axis::PerToken),
            shape(32, 64),
            "per-token groups of 128",
        ),
    ] {
        let e = cuda::check_cold_layout(k, v, sh).unwrap_err();
        assert!(e.to_string().contains(says), "{says}: {e}");
    }
}

#[test]
fn a_pool_of_mismatched_blocks_is_refused() {
    let cfg = QuantConfig::new(4, 32, Axis::PerToken).unwrap();
    let qz = GroupQuantizer::new(cfg);
    let shape = |tokens| BlockShape {
        tokens,
        heads: 1,
        head_dim: 64,
    };
    let a = qz.quantize(shape(16), &[0.5; 16 * 64]).unwrap();
    let b = qz.quantize(shape(32), &[0.5; 32 * 64]).unwrap();
    let e = ColdPoolHost::from_blocks(&[&a, &b]).unwrap_err();
    assert!(e.to_string().contains("cold block 1"), "{e}");
    let mut cut = a.clone();
    cut.packed.pop();
    let e = ColdPoolHost::from_blocks(&[&a, &cut]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
}

#[test]
fn launch_shapes_without_a_kernel_are_refused() {
    use kvforge_kernels::cuda::Tuning;
    Tuning::default().check().unwrap();
    for (unroll, blocks_per_sm) in [(3, 2), (8, 2), (2, 0)] {
        let e = Tuning {
            unroll,
            blocks_per_sm,
        }
        .check()
        .unwrap_err();
        assert!(e.to_string().contains("no CUDA kernel loads"), "{e}");
    }
}

fn step() -> DeviceStep {
    DeviceStep {
        dims: Dims {
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
        },
        hot: HotKind::F16,
        k_pool: 0x1000,
        v_pool: 0x2000,
        table: 0x3000,
        keys: 4096,
        cold: None,
        q: 0x4000,
        out: 0x5000,
        scratch: 0x6000,
        scratch_floats: 1 << 20,
        scores: 0,
    }
}

#[test]
fn malformed_steps_are_refused_before_any_launch() {
    step().validate().unwrap();
    let bad = |f: &dyn Fn(&mut DeviceStep), says: &str| {
        let mut s = step();
        f(&mut s);
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains(says), "{says}: {e}");
    };
    bad(&|s| s.dims.head_dim = 96, "no CUDA kernel for head dim 96");
    bad(&|s| s.dims.kv_heads = 2, "16 query heads per KV head");
    bad(&|s| s.dims.kv_heads = 5, "not a multiple");
    bad(&|s| s.keys = 0, "no keys");
    bad(&|s| s.q = 0, "no query buffer");
    bad(&|s| s.table = 0, "no table buffer");
    bad(&|s| s.k_pool = 0, "no hot key buffer");
    let cold = |bits, group, axis, mins| DeviceCold {
        keys: DeviceQuant {
            codes: 0x7000,
            scales: 0x8000,
            mins,
            config: QuantConfig::new(bits, group, axis).unwrap(),
        },
        values: DeviceQuant {
            codes: 0x9000,
            scales: 0xa000,
            mins: 0xb000,
            config: QuantConfig::new(4, 32, Axis::PerToken).unwrap(),
        },
        block_tokens: 32,
    };
    let mut s = step();
    s.cold = Some(cold(4, 32, Axis::PerChannel, 0xc000));
    s.validate().unwrap();
    bad(
        &|s| s.cold = Some(cold(4, 32, Axis::PerChannel, 0)),
        "cold keys: a missing buffer",
    );
    bad(
        &|s| s.cold = Some(cold(4, 64, Axis::PerChannel, 0xc000)),
        "do not tile blocks of 32 tokens",
    );
    bad(
        &|s| s.cold = Some(cold(4, 256, Axis::PerToken, 0xc000)),
        "per-token groups of 256",
    );
}

/// Compiles `paged_decode.cu` with the host C++ compiler against the
/// emulator in `tests/cuda_emu`; `None` (the test skips) when there is no
/// compiler and `KVFORGE_REQUIRE_NVRTC` is unset.
fn emulator() -> Option<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("paged_decode_emu");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    // The kernel source with every part kernel instantiated, unchanged.
    let src = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("paged_decode_all.cu");
    std::fs::write(&src, cuda::full_source()).unwrap();
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing"])
        .args(["-DKVFORGE_HOST_EMULATION", "-include"])
        .arg(root.join("tests/cuda_emu/emu.h"))
        .args(["-x", "c++"])
        .arg(&src)
        .arg(root.join("tests/cuda_emu/main.cpp"))
        .arg("-o")
        .arg(&exe)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!(
            "the kernel does not compile under the emulator:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            assert!(
                std::env::var_os("KVFORGE_REQUIRE_NVRTC").is_none(),
                "KVFORGE_REQUIRE_NVRTC is set and {cxx} cannot run: {e}"
            );
            eprintln!("skipped: no C++ compiler ({cxx}: {e})");
            None
        }
    }
}

/// The kernel source itself, run by the emulator on random mixed tables
/// (hot and cold entries in random order, ragged lengths, cold blocks
/// read twice as aliases, several splits), against the Rust scalar twin:
/// the output and the attention mass per entry.
#[test]
fn the_kernel_source_matches_the_cpu_twin_under_emulation() {
    use kvforge_kernels::Isa;
    use kvforge_kernels::cuda::testing::{HostStep, StepSpec, max_rel_err};

    let Some(emu) = emulator() else {
        return;
    };
    let q = |bits, group, axis| QuantConfig::new(bits, group, axis).unwrap();
    let spec = |kind, shape, keys, cold| StepSpec {
        block_tokens: 16,
        cold,
        ..StepSpec::new(kind, shape, keys)
    };
    // (step, keys per split, scores asked)
    let cases = [
        (spec(HotKind::F32, (4, 2, 64), 100, None), 32, true),
        (
            spec(
                HotKind::F16,
                (9, 3, 64),
                300,
                Some((q(4, 8, Axis::PerChannel), q(4, 32, Axis::PerToken))),
            ),
            64,
            true,
        ),
        (
            spec(
                HotKind::Bf16,
                (8, 1, 128),
                200,
                Some((q(8, 16, Axis::PerChannel), q(8, 32, Axis::PerToken))),
            ),
            64,
            false,
        ),
        (spec(HotKind::F16, (2, 2, 256), 1, None), 64, true),
        (
            spec(
                HotKind::F32,
                (32, 8, 128),
                150,
                Some((q(2, 8, Axis::PerChannel), q(2, 32, Axis::PerToken))),
            ),
            64,
            true,
        ),
    ];
    for (ci, (spec, split_len, scores)) in cases.into_iter().enumerate() {
        let step = HostStep::random(spec).unwrap();
        let want = step.reference(Isa::Scalar, 1).unwrap();
        // Every case through the kernels loading 2 and 4 keys ahead.
        for unroll in cuda::UNROLLS {
            let case = format!("case {ci}, {unroll} keys ahead");
            let (got, logits) = emulate(&emu, &step, split_len, scores, unroll);
            let err = max_rel_err(&got, &want.0);
            assert!(err <= 1e-5, "{case}: output off by {err}");
            if scores {
                let n = spec.dims.heads * step.table.len();
                assert_eq!(logits.len(), n, "{case}");
                let err = max_rel_err(&step.mass_from_scores(&logits), &want.1);
                assert!(err <= 1e-5, "{case}: mass off by {err}");
            }
        }
    }
}

/// Runs `step` through the emulated kernel: the output, and the scaled
/// logits when `scores`.
fn emulate(
    emu: &std::path::Path,
    step: &kvforge_kernels::cuda::testing::HostStep,
    split_len: usize,
    scores: bool,
    unroll: usize,
) -> (Vec<f32>, Vec<f32>) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let tag = format!("{}-{unroll}", std::process::id());
    let (inp, outp) = (
        dir.join(format!("emu-in-{tag}")),
        dir.join(format!("emu-out-{tag}")),
    );
    std::fs::write(&inp, emulator_input(step, split_len, scores, unroll)).unwrap();
    let st = std::process::Command::new(emu)
        .arg(&inp)
        .arg(&outp)
        .status()
        .unwrap();
    assert!(st.success(), "the emulator failed");
    let mut floats: Vec<f32> = std::fs::read(&outp)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let logits = floats.split_off(step.q.len());
    (floats, logits)
}

/// The emulator's input file for `step` (see `tests/cuda_emu/main.cpp`).
fn emulator_input(
    step: &kvforge_kernels::cuda::testing::HostStep,
    split_len: usize,
    scores: bool,
    unroll: usize,
) -> Vec<u8> {
    let s = step.spec;
    let d = s.dims;
    let none = QuantConfig::new(8, 32, Axis::PerToken).unwrap();
    let (kc, vc) = s.cold.unwrap_or((none, none));
    let kind = match s.kind {
        HotKind::F32 => 0,
        HotKind::F16 => 1,
        HotKind::Bf16 => 2,
    };
    let axis = |c: QuantConfig| i32::from(c.axis() == Axis::PerChannel);
    let mut input: Vec<u8> = Vec::new();
    for x in [
        kind,
        d.head_dim as i32,
        d.heads as i32,
        d.kv_heads as i32,
        step.table.len() as i32,
        split_len as i32,
        i32::from(scores),
        s.block_tokens as i32,
        kc.bits() as i32,
        kc.group_size() as i32,
        axis(kc),
        vc.bits() as i32,
        vc.group_size() as i32,
        axis(vc),
        i32::from(s.cold.is_some()),
        unroll as i32,
    ] {
        input.extend(x.to_le_bytes());
    }
    let f16s = |v: &[kvforge_quant::f16]| -> Vec<u8> {
        v.iter().flat_map(|h| h.to_bits().to_le_bytes()).collect()
    };
    let arrays: [Vec<u8>; 10] = [
        step.q.iter().flat_map(|x| x.to_le_bytes()).collect(),
        step.k_pool.clone(),
        step.v_pool.clone(),
        step.table.iter().flat_map(|x| x.to_le_bytes()).collect(),
        step.k_cold.codes.clone(),
        f16s(&step.k_cold.scales),
        f16s(&step.k_cold.mins),
        step.v_cold.codes.clone(),
        f16s(&step.v_cold.scales),
        f16s(&step.v_cold.mins),
    ];
    for a in &arrays {
        input.extend((a.len() as u64).to_le_bytes());
        input.extend(a);
    }
    input
}
