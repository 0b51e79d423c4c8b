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

use crate::error::{EngineError, Result};

mod dequant;
mod reader;

pub use dequant::dequantize;

use reader::Reader;
#[cfg(test)]
mod tests;

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

    /// The block format `kvforge-kernels` reads for this type, if it reads
    /// it (its quantized matmul, and the decoding of those blocks here).
    pub fn weight_format(self) -> Option<kvforge_kernels::WeightFormat> {
        use kvforge_kernels::WeightFormat as W;
        Some(match self {
            GgmlType::Q4_0 => W::Q4_0,
            GgmlType::Q4_1 => W::Q4_1,
            GgmlType::Q8_0 => W::Q8_0,
            GgmlType::Q4_K => W::Q4_K,
            GgmlType::Q5_K => W::Q5_K,
            GgmlType::Q6_K => W::Q6_K,
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

impl GgufFile {
    /// Opens and parses `path`. Every structural problem is an error naming it.
    pub fn open(path: &Path) -> Result<Self> {
        // A folder or a device would fail to map with a misleading error, a
        // FIFO would block the open.
        crate::input::regular_file(path)
            .map_err(|e| EngineError::Model(format!("cannot open model {e}")))?;
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

    /// A tensor as stored: its type, its bytes and its shape (row-major,
    /// as [`dequantize`](Self::dequantize) gives it: `[rows, cols]`).
    pub fn raw(&self, name: &str) -> Result<(GgmlType, &[u8], &[usize])> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::Model(format!("GGUF tensor {name} missing")))?;
        let bytes = &self.data[info.offset..info.offset + info.len];
        Ok((info.dtype, bytes, &info.shape))
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
