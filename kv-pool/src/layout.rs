//! Model dimensions × storage format → exact bytes per block.

use crate::error::{PoolError, Result};

/// How the elements of a K or V block are stored.
///
/// Quantized formats keep, per group of `group_size` consecutive elements,
/// an f16 scale (INT8, symmetric) or an f16 scale and an f16 minimum (INT4 /
/// INT2, affine). Groups run over the flattened `tokens × heads × head_dim`
/// slab, so the same byte count holds for per-token and per-channel (KIVI)
/// grouping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageFormat {
    /// 4 bytes per element.
    F32,
    /// 2 bytes per element.
    F16,
    /// 2 bytes per element.
    BF16,
    /// 1 byte per element + one f16 scale per group.
    Int8 {
        /// Elements per scale.
        group_size: u32,
    },
    /// Half a byte per element + f16 scale and minimum per group.
    Int4 {
        /// Elements per scale/minimum pair.
        group_size: u32,
    },
    /// A quarter byte per element + f16 scale and minimum per group.
    Int2 {
        /// Elements per scale/minimum pair.
        group_size: u32,
    },
}

impl StorageFormat {
    /// Bits per stored element (excluding group parameters).
    pub const fn bits(self) -> u32 {
        match self {
            StorageFormat::F32 => 32,
            StorageFormat::F16 | StorageFormat::BF16 => 16,
            StorageFormat::Int8 { .. } => 8,
            StorageFormat::Int4 { .. } => 4,
            StorageFormat::Int2 { .. } => 2,
        }
    }

    /// `(group_size, parameter bytes per group)` for quantized formats.
    pub const fn group(self) -> Option<(u32, u32)> {
        match self {
            StorageFormat::F32 | StorageFormat::F16 | StorageFormat::BF16 => None,
            StorageFormat::Int8 { group_size } => Some((group_size, 2)),
            StorageFormat::Int4 { group_size } | StorageFormat::Int2 { group_size } => {
                Some((group_size, 4))
            }
        }
    }
}

/// The shape of the KV cache of one model, cut into blocks of `block_size`
/// tokens. Built only through [`KvLayout::new`], which checks every field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    format: StorageFormat,
    value_format: StorageFormat,
    block_bytes: u64,
}

impl KvLayout {
    /// Validates the dimensions and computes the bytes of one block:
    /// `layers × 2 (K and V) × slab`, where a slab is
    /// `block_size × kv_heads × head_dim` elements plus group parameters.
    pub fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        format: StorageFormat,
    ) -> Result<Self> {
        Self::new_split(layers, kv_heads, head_dim, block_size, format, format)
    }

    /// [`KvLayout::new`] with keys and values stored differently (KIVI
    /// quantizes keys per channel, in groups of one block's tokens, and
    /// values per token in smaller groups): `layers × (key slab + value
    /// slab)` bytes per block.
    pub fn new_split(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_size: u32,
        format: StorageFormat,
        value_format: StorageFormat,
    ) -> Result<Self> {
        for (field, v) in [
            ("layers", layers),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ] {
            if v == 0 {
                return Err(PoolError::ZeroDimension { field });
            }
        }
        let overflow = |what| PoolError::Overflow { what };
        let elements = u64::from(block_size)
            .checked_mul(u64::from(kv_heads))
            .and_then(|x| x.checked_mul(u64::from(head_dim)))
            .ok_or(overflow("elements per block"))?;
        let k = slab_bytes(elements, format)?;
        let v = slab_bytes(elements, value_format)?;
        let block_bytes = k
            .checked_add(v)
            .and_then(|x| x.checked_mul(u64::from(layers)))
            .ok_or(overflow("bytes per block"))?;
        Ok(KvLayout {
            layers,
            kv_heads,
            head_dim,
            block_size,
            format,
            value_format,
            block_bytes,
        })
    }

    /// Same model and block size, another storage format (e.g. the cold tier).
    pub fn with_format(&self, format: StorageFormat) -> Result<Self> {
        KvLayout::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            format,
        )
    }

    /// Same model and block size, keys and values in their own formats.
    pub fn with_kv_formats(&self, key: StorageFormat, value: StorageFormat) -> Result<Self> {
        KvLayout::new_split(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            key,
            value,
        )
    }

    /// Transformer layers.
    pub const fn layers(&self) -> u32 {
        self.layers
    }
    /// Key/value heads per layer.
    pub const fn kv_heads(&self) -> u32 {
        self.kv_heads
    }
    /// Elements per head vector.
    pub const fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Tokens per block.
    pub const fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Element storage (of keys, when keys and values differ).
    pub const fn format(&self) -> StorageFormat {
        self.format
    }
    /// Element storage of values.
    pub const fn value_format(&self) -> StorageFormat {
        self.value_format
    }
    /// Exact bytes of one block (all layers, K and V, group parameters).
    pub const fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Blocks needed for `tokens` tokens (the last one partially filled).
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.block_size))
    }

    /// Bytes of `blocks` blocks, overflow-checked.
    pub fn bytes_for_blocks(&self, blocks: u64) -> Result<u64> {
        blocks
            .checked_mul(self.block_bytes)
            .ok_or(PoolError::Overflow {
                what: "bytes for blocks",
            })
    }
}

/// Bytes of one K or V slab of `elements` elements: packed data (an odd
/// element count with 4- or 2-bit packing rounds up to a whole byte) plus
/// group parameters.
fn slab_bytes(elements: u64, format: StorageFormat) -> Result<u64> {
    let overflow = |what| PoolError::Overflow { what };
    let data_bits = elements
        .checked_mul(u64::from(format.bits()))
        .ok_or(overflow("bits per slab"))?;
    let mut slab = data_bits.div_ceil(8);
    if let Some((group_size, param_bytes)) = format.group() {
        if group_size == 0 {
            return Err(PoolError::ZeroDimension {
                field: "group_size",
            });
        }
        if elements % u64::from(group_size) != 0 {
            return Err(PoolError::GroupSize {
                group_size,
                elements,
            });
        }
        let params = (elements / u64::from(group_size))
            .checked_mul(u64::from(param_bytes))
            .ok_or(overflow("group parameter bytes"))?;
        slab = slab.checked_add(params).ok_or(overflow("bytes per slab"))?;
    }
    Ok(slab)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_f16_block_matches_hand_count() {
        // 30 layers x 2 x 3 heads x 64 dims x 2 B = 23,040 B per token.
        let l = KvLayout::new(30, 3, 64, 16, StorageFormat::F16).unwrap();
        assert_eq!(l.block_bytes(), 23_040 * 16);
    }

    #[test]
    fn int4_counts_packed_nibbles_and_group_params() {
        let l = KvLayout::new(1, 1, 64, 1, StorageFormat::Int4 { group_size: 32 }).unwrap();
        // K and V: 64 elements -> 32 bytes + 2 groups x 4 B = 40 B each.
        assert_eq!(l.block_bytes(), 80);
        let l = KvLayout::new(1, 1, 64, 1, StorageFormat::Int8 { group_size: 64 }).unwrap();
        assert_eq!(l.block_bytes(), 2 * (64 + 2));
        let l = KvLayout::new(1, 1, 64, 1, StorageFormat::Int2 { group_size: 64 }).unwrap();
        assert_eq!(l.block_bytes(), 2 * (16 + 4));
    }

    #[test]
    fn keys_and_values_can_be_stored_differently() {
        let k = StorageFormat::Int4 { group_size: 16 };
        let v = StorageFormat::Int4 { group_size: 32 };
        let l = KvLayout::new_split(2, 1, 64, 1, k, v).unwrap();
        // Keys: 32 B + 4 groups x 4 B; values: 32 B + 2 x 4 B; two layers.
        assert_eq!(l.block_bytes(), 2 * ((32 + 16) + (32 + 8)));
        assert_eq!((l.format(), l.value_format()), (k, v));
        assert!(
            KvLayout::new_split(1, 1, 64, 1, k, StorageFormat::Int4 { group_size: 48 }).is_err()
        );
    }

    #[test]
    fn zero_dimensions_are_rejected_by_name() {
        let e = KvLayout::new(1, 1, 64, 0, StorageFormat::F16).unwrap_err();
        assert_eq!(
            e,
            PoolError::ZeroDimension {
                field: "block_size"
            }
        );
        let e = KvLayout::new(0, 1, 64, 1, StorageFormat::F16).unwrap_err();
        assert_eq!(e, PoolError::ZeroDimension { field: "layers" });
        let e = KvLayout::new(1, 1, 64, 1, StorageFormat::Int8 { group_size: 0 }).unwrap_err();
        assert_eq!(
            e,
            PoolError::ZeroDimension {
                field: "group_size"
            }
        );
    }

    #[test]
    fn group_size_must_divide_the_slab() {
        let e = KvLayout::new(1, 1, 64, 1, StorageFormat::Int4 { group_size: 48 }).unwrap_err();
        assert!(matches!(
            e,
            PoolError::GroupSize {
                group_size: 48,
                elements: 64
            }
        ));
        assert!(e.to_string().contains("does not divide"));
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        let e =
            KvLayout::new(u32::MAX, u32::MAX, u32::MAX, u32::MAX, StorageFormat::F32).unwrap_err();
        assert!(matches!(e, PoolError::Overflow { .. }));
        let l = KvLayout::new(1, 1, 1, 1, StorageFormat::F32).unwrap();
        assert!(l.bytes_for_blocks(u64::MAX).is_err());
        // 2^62 groups of one element, 4 parameter bytes each: 2^64 bytes.
        let e = KvLayout::new(
            1,
            1 << 31,
            1 << 31,
            1,
            StorageFormat::Int2 { group_size: 1 },
        )
        .unwrap_err();
        assert!(matches!(e, PoolError::Overflow { .. }), "{e:?}");
    }
}
