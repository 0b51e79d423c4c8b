//! [`Isa`]: the instruction sets the CPU kernel is built for, and which
//! of them this CPU runs.

use crate::{KernelError, Result};

/// The instruction set a kernel runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, one lane: the reference every fast path is tested
    /// against.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW) beside AVX2, FMA and F16C: the quantized
    /// matmul's 512-bit kernel; the attention kernel runs its AVX2 path.
    /// Chosen by name only (see [`Isa::detect`]).
    Avx512,
    /// AArch64 Advanced SIMD (NEON).
    Neon,
}

impl Isa {
    /// Every instruction set, the scalar twin first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// The set the kernels run with: the one `KVFORGE_ISA` names
    /// (`scalar`, `avx2`, `avx512`, `neon`) when this CPU has it, else
    /// AVX2, NEON or the scalar twin. AVX-512 is chosen by name only: on
    /// the one AVX-512 CPU measured (an AMD EPYC, which splits 512-bit
    /// operations in two) its quantized matmul was not faster than AVX2's
    /// (kernels/README.md).
    pub fn detect() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let named = std::env::var("KVFORGE_ISA").ok();
            let forced = Isa::ALL
                .into_iter()
                .find(|i| named.as_deref() == Some(i.name()) && i.supported());
            forced.unwrap_or_else(|| {
                [Isa::Avx2, Isa::Neon]
                    .into_iter()
                    .find(|i| i.supported())
                    .unwrap_or(Isa::Scalar)
            })
        })
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
            Isa::Avx512 => avx512_supported(),
            Isa::Neon => cfg!(target_arch = "aarch64"),
        }
    }

    /// `self`, or an error if this CPU lacks it.
    pub fn check(self) -> Result<Isa> {
        if self.supported() {
            Ok(self)
        } else {
            Err(KernelError::Unsupported(format!(
                "this CPU does not support {}",
                self.name()
            )))
        }
    }

    /// `scalar`, `avx2`, `avx512` or `neon`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    avx2_supported()
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}
