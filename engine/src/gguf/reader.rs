//! A bounds-checked little-endian reader over a GGUF buffer: every
//! truncated or oversized field is an error naming what was read.

use crate::error::{EngineError, Result};

use super::*;

pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
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
    pub(super) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        // Every element takes at least one byte: a longer length is corrupt.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len() - self.pos)
            .ok_or_else(|| {
                EngineError::Model(format!("corrupt GGUF: {what} length {n} exceeds the file"))
            })
    }
    pub(super) fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| EngineError::Model(format!("corrupt GGUF: {what} is not UTF-8")))
    }
    pub(super) fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
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
