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
    /// AArch64 Advanced SIMD (NEON).
    Neon,
}

impl Isa {
    /// Every instruction set, the scalar twin first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Neon];

    /// The fastest set this CPU supports.
    pub fn detect() -> Isa {
        [Isa::Avx2, Isa::Neon]
            .into_iter()
            .find(|i| i.supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Whether this CPU runs it.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
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

    /// `scalar`, `avx2` or `neon`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
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
