//! A small GGUF reader: header, metadata, tensor table, and dequantization of
//! F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 and the K-quants
//! (Q4_K, Q5_K, Q6_K, Q8_K) to f32.
//!
//! Written here rather than pulled in: the format is a few hundred lines, the
//! maintained Rust readers either tie us to another tensor library (candle)
//! or lag behind the spec, and owning it lets every malformed file become a
//! precise [`EngineError`] instead of a panic.
//!
//! Spec: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md> (v2/v3).

use std::collections::BTreeMap;
use std::path::Path;

use half::{bf16, f16};

use crate::error::{EngineError, Result};

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian

/// Largest `general.alignment` accepted (writers use 32).
const MAX_ALIGNMENT: usize = 1 << 20;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    /// As an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// As a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// GGML tensor types this reader can dequantize (named as GGML names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 32 x i8 with one f16 scale.
    Q8_0,
    /// 32 x 4-bit with one f16 scale, offset -8.
    Q4_0,
    /// 32 x 4-bit with f16 scale and minimum.
    Q4_1,
    /// 32 x 5-bit with one f16 scale, offset -16.
    Q5_0,
    /// 32 x 5-bit with f16 scale and minimum.
    Q5_1,
    /// 256 x 4-bit in 8 sub-blocks with 6-bit scales and minimums.
    Q4_K,
    /// 256 x 5-bit in 8 sub-blocks with 6-bit scales and minimums.
    Q5_K,
    /// 256 x 6-bit in 16 sub-blocks with 8-bit scales.
    Q6_K,
    /// 256 x i8 with one f32 scale (and block sums, unused here).
    Q8_K,
}

impl GgmlType {
    /// The type with GGML id `id`, if this reader supports it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
            GgmlType::Q8_K => (256, 292),
        }
    }
}

/// One tensor's entry in the table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Dimensions in PyTorch order (outermost first).
    pub shape: Vec<usize>,
    /// Storage type.
    pub dtype: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Bytes of data.
    pub len: usize,
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    /// Metadata key -> value.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor name -> info.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The whole file: a private read-only map, or bytes in memory.
    data: Box<dyn std::ops::Deref<Target = [u8]> + Send + Sync>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                EngineError::Model(format!(
                    "truncated GGUF file while reading {what} at byte {}",
                    self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        // Every element takes at least one byte: a longer length is corrupt.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len() - self.pos)
            .ok_or_else(|| {
                EngineError::Model(format!("corrupt GGUF: {what} length {n} exceeds the file"))
            })
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| EngineError::Model(format!("corrupt GGUF: {what} is not UTF-8")))
    }
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U64(u64::from(self.u8(key)?)),
            1 => Value::I64(i64::from(self.u8(key)? as i8)),
            2 => {
                let b = self.take(2, key)?;
                Value::U64(u64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.take(2, key)?;
                Value::I64(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => Value::U64(u64::from(self.u32(key)?)),
            5 => Value::I64(i64::from(self.u32(key)? as i32)),
            6 => Value::F64(f64::from(f32::from_bits(self.u32(key)?))),
            7 => Value::Bool(self.u8(key)? != 0),
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth > 4 {
                    return Err(EngineError::Model(format!(
                        "corrupt GGUF: {key} nests arrays too deep"
                    )));
                }
                let inner = self.u32(key)?;
                let n = self.len(key)?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            t => {
                return Err(EngineError::Model(format!(
                    "corrupt GGUF: {key} has unknown value type {t}"
                )));
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path`. Every structural problem is an error naming it.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| {
            EngineError::Model(format!("cannot open model {}: {e}", path.display()))
        })?;
        // SAFETY: the file is opened read-only and mapped privately; we never
        // hand out references that outlive the map, and a concurrent writer
        // could only corrupt values, which are all bounds-checked on use.
        let data = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| EngineError::Model(format!("cannot map model {}: {e}", path.display())))?;
        let (metadata, tensors) = Self::parse(&data).map_err(|e| match e {
            EngineError::Unsupported(s) => {
                EngineError::Unsupported(format!("{}: {s}", path.display()))
            }
            e => EngineError::Model(format!("{}: {}", path.display(), e.detail())),
        })?;
        Ok(GgufFile {
            metadata,
            tensors,
            data: Box::new(data),
        })
    }

    /// Parses a GGUF file held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let (metadata, tensors) = Self::parse(&bytes)?;
        Ok(GgufFile {
            metadata,
            tensors,
            data: Box::new(bytes),
        })
    }

    #[allow(clippy::type_complexity)]
    fn parse(buf: &[u8]) -> Result<(BTreeMap<String, Value>, BTreeMap<String, TensorInfo>)> {
        let mut r = Reader { buf, pos: 0 };
        if buf.len() < 4 || r.u32("magic")? != MAGIC {
            return Err(EngineError::Model("not a GGUF file (bad magic)".into()));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(EngineError::Model(format!(
                "unsupported GGUF version {version} (need 2 or 3)"
            )));
        }
        let n_tensors = r.len("tensor count")?;
        let n_kv = r.len("metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32(&key)?;
            let v = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(EngineError::Model(format!(
                    "corrupt GGUF: metadata key {key} appears twice"
                )));
            }
        }
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(EngineError::Model(format!(
                    "tensor {name}: {n_dims} dimensions"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64(&name)? as usize);
            }
            let ty = r.u32(&name)?;
            let offset = r.u64(&name)? as usize;
            raw.push((name, dims, ty, offset));
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        if align == 0 || !align.is_power_of_two() || align > MAX_ALIGNMENT {
            return Err(EngineError::Model(format!(
                "bad general.alignment {align} (a power of two up to {MAX_ALIGNMENT})"
            )));
        }
        let data_start = r.pos.div_ceil(align) * align;
        let mut tensors = BTreeMap::new();
        for (name, dims, ty, offset) in raw {
            let elements = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| EngineError::Model(format!("tensor {name}: size overflows")))?;
            let shape: Vec<usize> = dims.into_iter().rev().collect();
            let Some(dtype) = GgmlType::from_id(ty) else {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has GGML type {ty}; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_K"
                )));
            };
            let (per, bytes) = dtype.block();
            if elements % per != 0 {
                return Err(EngineError::Model(format!(
                    "tensor {name}: {elements} elements is not a multiple of the {per}-element block"
                )));
            }
            let len = (elements / per)
                .checked_mul(bytes)
                .ok_or_else(|| EngineError::Model(format!("tensor {name}: size overflows")))?;
            let start = data_start
                .checked_add(offset)
                .filter(|s| s.checked_add(len).is_some_and(|e| e <= buf.len()))
                .ok_or_else(|| {
                    EngineError::Model(format!(
                        "truncated GGUF file: tensor {name} ends past the end of the file"
                    ))
                })?;
            if start % align != 0 {
                return Err(EngineError::Model(format!(
                    "corrupt GGUF: tensor {name} data offset {offset} is not aligned to {align} bytes"
                )));
            }
            let info = TensorInfo {
                shape,
                dtype,
                offset: start,
                len,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(EngineError::Model(format!(
                    "corrupt GGUF: tensor {name} appears twice"
                )));
            }
        }
        check_tiling(&tensors, data_start, align)?;
        Ok((metadata, tensors))
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required unsigned integer.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.get(key).and_then(Value::as_u64).ok_or_else(|| {
            EngineError::Model(format!("GGUF metadata {key} missing or not an integer"))
        })
    }

    /// Dequantizes a tensor to f32, row-major in `info.shape`.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::Model(format!("GGUF tensor {name} missing")))?;
        let bytes = &self.data[info.offset..info.offset + info.len];
        Ok((dequantize(info.dtype, bytes), info.shape.clone()))
    }
}

/// Tensor data must tile the data section: in offset order, each tensor
/// starts exactly where the previous one ends, rounded up to the alignment
/// (what every GGUF writer produces). So a moved offset, an overlap, or a type
/// swapped for one of another size is an error, not garbage weights.
fn check_tiling(
    tensors: &BTreeMap<String, TensorInfo>,
    data_start: usize,
    align: usize,
) -> Result<()> {
    let mut by_offset: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    by_offset.sort_by_key(|(_, t)| t.offset);
    let mut expect = data_start;
    for (name, t) in by_offset {
        if t.offset != expect {
            let how = if t.offset < expect {
                "overlaps the tensor before it"
            } else {
                "leaves a gap after the tensor before it"
            };
            return Err(EngineError::Model(format!(
                "corrupt GGUF: tensor {name}'s data {how} (at byte {}, expected {expect}); its offset or type is wrong",
                t.offset
            )));
        }
        expect = (t.offset + t.len).div_ceil(align) * align;
    }
    Ok(())
}

/// Dequantizes raw GGML data. `bytes` holds whole blocks.
pub fn dequantize(dtype: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let h = |b: &[u8]| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    match dtype {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(h).collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        GgmlType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * 32);
            for blk in bytes.chunks_exact(34) {
                let d = h(&blk[..2]);
                out.extend(blk[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
            out
        }
        GgmlType::Q4_0 => {
            let mut out = vec![0f32; bytes.len() / 18 * 32];
            for (blk, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
                let d = h(&blk[..2]);
                for (j, &q) in blk[2..].iter().enumerate() {
                    o[j] = (f32::from(q & 0x0f) - 8.0) * d;
                    o[j + 16] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
            out
        }
        GgmlType::Q4_1 => {
            let mut out = vec![0f32; bytes.len() / 20 * 32];
            for (blk, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
                let (d, m) = (h(&blk[..2]), h(&blk[2..4]));
                for (j, &q) in blk[4..].iter().enumerate() {
                    o[j] = f32::from(q & 0x0f) * d + m;
                    o[j + 16] = f32::from(q >> 4) * d + m;
                }
            }
            out
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (size, affine) = if dtype == GgmlType::Q5_0 {
                (22, false)
            } else {
                (24, true)
            };
            let mut out = vec![0f32; bytes.len() / size * 32];
            for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(32)) {
                let d = h(&blk[..2]);
                let (m, rest) = if affine {
                    (h(&blk[2..4]), &blk[4..])
                } else {
                    (-16.0 * d, &blk[2..])
                };
                let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                for (j, &q) in rest[4..20].iter().enumerate() {
                    let lo = u32::from(q & 0x0f) | ((qh >> j) & 1) << 4;
                    let hi = u32::from(q >> 4) | ((qh >> (j + 16)) & 1) << 4;
                    o[j] = lo as f32 * d + m;
                    o[j + 16] = hi as f32 * d + m;
                }
            }
            out
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (size, five) = if dtype == GgmlType::Q4_K {
                (144, false)
            } else {
                (176, true)
            };
            let mut out = vec![0f32; bytes.len() / size * 256];
            for (blk, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(256)) {
                let (d, dmin) = (h(&blk[..2]), h(&blk[2..4]));
                let scales = &blk[4..16];
                let (qh, qs) = if five {
                    (&blk[16..48], &blk[48..176])
                } else {
                    (&blk[16..16], &blk[16..144])
                };
                // Four chunks of 64: the low nibbles of 32 bytes (sub-block
                // 2j), then their high nibbles (2j + 1); Q5_K takes bit 2j or
                // 2j + 1 of `qh` as the fifth bit.
                for j in 0..4 {
                    let q = &qs[32 * j..32 * j + 32];
                    for (half, shift) in [(0usize, 0u32), (1, 4)] {
                        let sub = 2 * j + half;
                        let (sc, mn) = scale_min_k4(sub, scales);
                        let (d1, m1) = (d * f32::from(sc), dmin * f32::from(mn));
                        let base = 64 * j + 32 * half;
                        for l in 0..32 {
                            let mut v = u32::from((q[l] >> shift) & 0x0f);
                            if five && (qh[l] >> sub) & 1 == 1 {
                                v += 16;
                            }
                            o[base + l] = d1 * v as f32 - m1;
                        }
                    }
                }
            }
            out
        }
        GgmlType::Q6_K => {
            let mut out = vec![0f32; bytes.len() / 210 * 256];
            for (blk, o) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
                let d = h(&blk[208..210]);
                for n in 0..2 {
                    let ql = &blk[64 * n..64 * n + 64];
                    let qh = &blk[128 + 32 * n..128 + 32 * n + 32];
                    let sc = &blk[192 + 8 * n..192 + 8 * n + 8];
                    let y = &mut o[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q = |lo: u8, shift: u32| {
                            (i32::from(lo & 0x0f) | i32::from((qh[l] >> shift) & 3) << 4) - 32
                        };
                        let s = |k: usize| d * f32::from(sc[is + k] as i8);
                        y[l] = s(0) * q(ql[l], 0) as f32;
                        y[l + 32] = s(2) * q(ql[l + 32], 2) as f32;
                        y[l + 64] = s(4) * q(ql[l] >> 4, 4) as f32;
                        y[l + 96] = s(6) * q(ql[l + 32] >> 4, 6) as f32;
                    }
                }
            }
            out
        }
        GgmlType::Q8_K => {
            let mut out = Vec::with_capacity(bytes.len() / 292 * 256);
            for blk in bytes.chunks_exact(292) {
                let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                out.extend(blk[4..260].iter().map(|&q| f32::from(q as i8) * d));
            }
            out
        }
    }
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K / Q5_K block
/// (llama.cpp's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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
}
