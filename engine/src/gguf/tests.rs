//! Unit tests of the module's private parts.
#![allow(clippy::unwrap_used)]

use half::{bf16, f16};

use super::*;

fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

#[test]
fn q4_0_q4_1_q8_0_follow_the_ggml_layout() {
    // One block each: low nibbles are elements 0..16, high nibbles 16..32.
    let qs: Vec<u8> = (0..16u8).map(|j| (15 - j) << 4 | j).collect();
    let mut q40 = f16b(0.5).to_vec();
    q40.extend(&qs);
    let x = dequantize(GgmlType::Q4_0, &q40);
    assert_eq!(x.len(), 32);
    assert_eq!(x[0], (0.0 - 8.0) * 0.5);
    assert_eq!(x[15], (15.0 - 8.0) * 0.5);
    assert_eq!(x[16], (15.0 - 8.0) * 0.5);
    assert_eq!(x[31], (0.0 - 8.0) * 0.5);
    let mut q41 = f16b(0.25).to_vec();
    q41.extend(f16b(-1.0));
    q41.extend(&qs);
    let x = dequantize(GgmlType::Q4_1, &q41);
    assert_eq!(x[3], 3.0 * 0.25 - 1.0);
    assert_eq!(x[16 + 3], 12.0 * 0.25 - 1.0);
    let mut q80 = f16b(2.0).to_vec();
    q80.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let x = dequantize(GgmlType::Q8_0, &q80);
    assert_eq!(x[0], -32.0);
    assert_eq!(x[31], 30.0);
}

#[test]
fn float_types_round_trip() {
    let v = [1.5f32, -2.25, 0.0, 65504.0];
    let f32b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(dequantize(GgmlType::F32, &f32b), v);
    let f16s: Vec<u8> = v.iter().flat_map(|&x| f16b(x)).collect();
    assert_eq!(dequantize(GgmlType::F16, &f16s), v);
    let bf: Vec<u8> = v[..3]
        .iter()
        .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
        .collect();
    assert_eq!(dequantize(GgmlType::BF16, &bf), &v[..3]);
}
