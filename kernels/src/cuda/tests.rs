//! Unit tests of the CUDA kernel variants and their compilation.

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
