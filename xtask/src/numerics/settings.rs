//! The kernel settings a comparison runs under: `MKL_CBWR` × `ATEN_CPU_CAPABILITY`,
//! as far as this CPU has the instructions.

use std::process::Command;

/// Tests that compare floats but take long (seconds of real-model work or
/// many turns): run under the baseline and one more setting, not all.
pub(super) const SLOW: &[&str] = &[
    "manager::real_model_reuse_matches_a_full_recompute_within_rounding_over_16_turns",
    "manager::reuse_matches_recomputing_every_prompt_over_16_turns",
    "compose::real_model_reuse_with_a_cold_tier_gives_the_outputs_of_the_same_schedule",
    "batch::generate_batch_follows_generate_one_by_one",
    "real_model_matches_transformers_logits_greedy_and_tokens",
    "f16_weights_with_f32_compute_stay_close_to_transformers",
    "lifecycle::a_long_segment_is_summarised_by_the_real_model",
    "tests/test_hf.py::test_smollm2_int4_keeps_perplexity_within_one_percent",
];

/// The setting the slow tests run under besides the baseline: the farthest
/// from it (MKL's compatible code path, libtorch's scalar kernels).
pub(super) const SLOW_SETTING: Setting = Setting {
    mkl: Some("COMPATIBLE"),
    aten: Some("default"),
};

/// One kernel setting: `MKL_CBWR` and `ATEN_CPU_CAPABILITY` (`None`: unset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Setting {
    pub(super) mkl: Option<&'static str>,
    pub(super) aten: Option<&'static str>,
}

impl Setting {
    pub(super) fn name(&self) -> String {
        format!(
            "MKL_CBWR={} ATEN_CPU_CAPABILITY={}",
            self.mkl.unwrap_or("unset"),
            self.aten.unwrap_or("unset")
        )
    }

    pub(super) fn file(&self) -> String {
        format!(
            "{}-{}.tsv",
            self.mkl.unwrap_or("unset"),
            self.aten.unwrap_or("unset")
        )
    }

    pub(super) fn apply(&self, cmd: &mut Command) {
        for (var, v) in [("MKL_CBWR", self.mkl), ("ATEN_CPU_CAPABILITY", self.aten)] {
            match v {
                Some(v) => cmd.env(var, v),
                None => cmd.env_remove(var),
            };
        }
    }
}

pub(super) const BASELINE: Setting = Setting {
    mkl: None,
    aten: None,
};

/// Every setting this CPU can run: `MKL_CBWR` ∈ {COMPATIBLE, AVX2, AVX512}
/// × `ATEN_CPU_CAPABILITY` ∈ {unset, default, avx2}, as far as the CPU has
/// the instructions (AArch64 has no MKL: libtorch's capability only).
pub(super) fn settings() -> Vec<Setting> {
    let (avx2, avx512) = cpu();
    let mkl: Vec<Option<&'static str>> = if cfg!(target_arch = "x86_64") {
        let mut m = vec![None, Some("COMPATIBLE")];
        if avx2 {
            m.push(Some("AVX2"));
        }
        if avx512 {
            m.push(Some("AVX512"));
        }
        m
    } else {
        vec![None]
    };
    let mut aten = vec![None, Some("default")];
    if avx2 {
        aten.push(Some("avx2"));
    }
    let mut out = Vec::new();
    for &m in &mkl {
        for &a in &aten {
            out.push(Setting { mkl: m, aten: a });
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn cpu() -> (bool, bool) {
    (
        std::arch::is_x86_feature_detected!("avx2"),
        std::arch::is_x86_feature_detected!("avx512f"),
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu() -> (bool, bool) {
    (false, false)
}
