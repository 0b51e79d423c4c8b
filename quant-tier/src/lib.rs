//! Group-wise quantization of KV blocks for a cold tier.
//!
//! The newest tokens of a sequence stay in the compute dtype; whole blocks
//! that leave that hot window are quantized here and their full-precision
//! blocks freed ([`TierPlan`]). Pure Rust, no tensors: a block is a flat
//! `tokens × heads × head_dim` slab of `f32` (or `f16` / `bf16` via `half`),
//! and comes back as packed bytes plus per-group scales.
//!
//! # Formats
//!
//! * INT8, symmetric: one f16 scale per group, `q = round(x / s)`, `|q| ≤ 127`.
//! * INT4 and INT2, affine: f16 scale and minimum per group,
//!   `q = round((x − m) / s)`, `0 ≤ q < 2^bits`; INT4 packs two values per
//!   byte, INT2 four.
//!
//! Groups run along the head dimension of each token ([`Axis::PerToken`],
//! for values) or along the tokens of each channel ([`Axis::PerChannel`],
//! KIVI's layout for keys, whose outliers sit in fixed channels). Bytes per
//! block equal `kvforge_pool::KvLayout`'s for the same format (tested).
//!
//! Codes are packed in bit planes so that unpacking is a few contiguous,
//! vectorizable passes: in a run of `n` codes packed into `n·bits/8` bytes,
//! code `j` sits in byte `j mod (n·bits/8)` at bit `⌊j / (n·bits/8)⌋·bits`
//! (INT4: first half in the low nibbles, second half in the high ones). A
//! run is one group per token; per channel, codes are stored token-major and
//! a run is one token's row of channels (so dequantizing needs no
//! transpose), with the group parameters channel-major. Dequantization uses
//! AVX2 code when the CPU has it (runtime detection).
//!
//! [`Rotated`] applies a normalized Walsh–Hadamard transform to each head
//! vector before quantizing: orthogonal, so attention scores are unchanged
//! when queries are rotated the same way, and outliers are spread over the
//! channels.
//!
//! # Parameters and error bounds (per element, checked by property tests)
//!
//! Group parameters are f16, rounded so that they never shrink the range:
//! INT8's scale is `max|x| / 127` rounded up; the affine minimum is the
//! group's minimum rounded toward −∞, and the scale is
//! `(max − stored minimum) / (2^bits − 1)` rounded up. Codes are rounded to
//! nearest (ties to even). So, with `s` the stored scale of the element's
//! group, every format guarantees `|x − x̂| ≤ s / 2` (plus f32 rounding of
//! the arithmetic, a few ulps of `x`); f16 subnormal scales (groups with
//! `max|x|` below about 1e-2) are coarser, but never 0 for a nonzero group.
//!
//! # Range
//!
//! A group is quantized only when its parameters are finite in f16:
//! INT8 needs `max|x| ≤ 65504 · 127` (about 8.3e6); INT4 and INT2 need the
//! minimum `≥ −65504` and `max − min ≤ 65504 · (2^bits − 1)` (INT4: 982,560;
//! INT2: 196,512). A finite value outside is [`QuantError::OutOfRange`],
//! naming the element; the caller keeps the block unquantized. With
//! [`Rotated`], the limits apply after the rotation, which can grow one
//! element by up to `√head_dim`.
//!
//! # Bad input
//!
//! NaN or ±inf is reported ([`QuantError::NonFinite`]), never quantized into
//! a group it would poison; so is a finite value out of range. Group sizes
//! must divide their axis and keep groups byte-aligned; shapes (with checked
//! size arithmetic) and lengths are checked, on `quantize` and on
//! `dequantize` alike (a [`QuantizedBlock`]'s fields are public, so a block
//! is validated before it is read: [`QuantError::Corrupt`]).

#![deny(missing_docs)]

mod error;
mod group;
mod hadamard;
mod plan;
pub mod testing;

pub use error::{QuantError, Result};
pub use group::GroupQuantizer;
pub use hadamard::{Rotated, hadamard_in_place};
pub use half::{bf16, f16};
pub use plan::{TierPlan, TierPolicy};

use std::mem::MaybeUninit;

/// Which axis the quantization groups run along.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Along `head_dim` within each token and head (values; KIVI values).
    PerToken,
    /// Along the tokens of each (head, channel) (KIVI keys).
    PerChannel,
}

/// Bits, group size and axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantConfig {
    bits: u32,
    group_size: usize,
    axis: Axis,
}

impl QuantConfig {
    /// Checks `bits` ∈ {8, 4, 2} and `group_size > 0` with byte-aligned
    /// groups (`group_size × bits` a multiple of 8). Divisibility of the
    /// axis is checked per block.
    pub fn new(bits: u32, group_size: usize, axis: Axis) -> Result<Self> {
        if !matches!(bits, 8 | 4 | 2) {
            return Err(QuantError::Bits { bits });
        }
        if group_size == 0 || (group_size * bits as usize) % 8 != 0 {
            return Err(QuantError::GroupSize {
                group_size,
                axis: "byte-aligned group",
                len: 8,
            });
        }
        Ok(QuantConfig {
            bits,
            group_size,
            axis,
        })
    }

    /// Parses `int8`, `int4` or `int2` into bits.
    pub fn parse_bits(name: &str) -> Result<u32> {
        match name.to_ascii_lowercase().as_str() {
            "int8" => Ok(8),
            "int4" => Ok(4),
            "int2" => Ok(2),
            _ => Err(QuantError::UnknownFormat(name.to_string())),
        }
    }

    /// Bits per stored element.
    pub fn bits(&self) -> u32 {
        self.bits
    }
    /// Elements per group.
    pub fn group_size(&self) -> usize {
        self.group_size
    }
    /// Group axis.
    pub fn axis(&self) -> Axis {
        self.axis
    }
    /// Symmetric (INT8) or affine (INT4, INT2).
    pub fn symmetric(&self) -> bool {
        self.bits == 8
    }
}

/// The shape of one K or V slab of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockShape {
    /// Tokens in the block.
    pub tokens: usize,
    /// KV heads.
    pub heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
}

impl BlockShape {
    /// Elements in the slab (saturating at `usize::MAX`, which no real slab
    /// has; [`checked_len`](Self::checked_len) tells overflow apart).
    pub fn len(&self) -> usize {
        self.checked_len().unwrap_or(usize::MAX)
    }

    /// Elements in the slab, or `None` if the product overflows.
    pub fn checked_len(&self) -> Option<usize> {
        self.tokens
            .checked_mul(self.heads)?
            .checked_mul(self.head_dim)
    }

    /// Whether the slab is empty (a zero dimension).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A quantized slab: packed codes and per-group parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedBlock {
    /// The slab's shape.
    pub shape: BlockShape,
    /// How it was quantized.
    pub config: QuantConfig,
    /// Packed codes, groups in storage order.
    pub packed: Vec<u8>,
    /// One scale per group.
    pub scales: Vec<f16>,
    /// One minimum per group (affine formats; empty for INT8).
    pub mins: Vec<f16>,
}

impl QuantizedBlock {
    /// Bytes this block occupies: codes plus group parameters.
    pub fn bytes(&self) -> usize {
        self.packed.len() + 2 * (self.scales.len() + self.mins.len())
    }
}

/// Quantizes and dequantizes KV slabs.
///
/// Run [`testing::check_quantizer`] against any implementation.
pub trait Quantizer: Send + Sync {
    /// A short name for reports (`int4-g64-token`, `hadamard+int4-…`).
    fn name(&self) -> String;

    /// The configuration.
    fn config(&self) -> QuantConfig;

    /// Quantizes `x` (`shape.len()` elements, `tokens × heads × head_dim`).
    fn quantize(&self, shape: BlockShape, x: &[f32]) -> Result<QuantizedBlock>;

    /// Writes the dequantized slab into `out` (`block.shape.len()` elements).
    fn dequantize(&self, block: &QuantizedBlock, out: &mut [f32]) -> Result<()>;

    /// [`dequantize`](Self::dequantize) into memory that may be
    /// uninitialized (a fresh tensor): returns `out` as initialized `f32`s.
    /// The default zero-fills first; implementations that write every
    /// element override it to skip that pass.
    fn dequantize_uninit<'a>(
        &self,
        block: &QuantizedBlock,
        out: &'a mut [MaybeUninit<f32>],
    ) -> Result<&'a mut [f32]> {
        for o in out.iter_mut() {
            o.write(0.0);
        }
        // SAFETY: every element was written just above.
        let out = unsafe { assume_init(out) };
        self.dequantize(block, out)?;
        Ok(out)
    }

    /// [`quantize`](Self::quantize) from f16 data.
    fn quantize_f16(&self, shape: BlockShape, x: &[f16]) -> Result<QuantizedBlock> {
        let v: Vec<f32> = x.iter().map(|h| h.to_f32()).collect();
        self.quantize(shape, &v)
    }

    /// [`quantize`](Self::quantize) from bf16 data.
    fn quantize_bf16(&self, shape: BlockShape, x: &[bf16]) -> Result<QuantizedBlock> {
        let v: Vec<f32> = x.iter().map(|h| h.to_f32()).collect();
        self.quantize(shape, &v)
    }
}

/// Views fully written `MaybeUninit` storage as initialized.
///
/// # Safety
///
/// Every element of `out` must have been written.
pub(crate) unsafe fn assume_init(out: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and the caller
    // guarantees every element is initialized.
    unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<f32>(), out.len()) }
}

/// Views initialized `f32`s as `MaybeUninit` storage (always sound: writing
/// `f32`s through it keeps it initialized).
pub(crate) fn as_uninit(out: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: same layout; the view only allows writing valid `f32`s or
    // reading through `MaybeUninit`, and the borrow ends before `out` is
    // used as `f32` again.
    unsafe {
        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<MaybeUninit<f32>>(), out.len())
    }
}

/// Checks a shape and a data length against each other.
pub(crate) fn check_len(shape: BlockShape, len: usize) -> Result<()> {
    if shape.checked_len().is_none() {
        return Err(QuantError::Shape(format!(
            "block shape {shape:?} overflows the element count"
        )));
    }
    if shape.is_empty() {
        return Err(QuantError::Shape(format!(
            "block shape {shape:?} has a zero dimension"
        )));
    }
    if len != shape.len() {
        return Err(QuantError::Shape(format!(
            "{len} elements given for a {}x{}x{} block ({} expected)",
            shape.tokens,
            shape.heads,
            shape.head_dim,
            shape.len()
        )));
    }
    Ok(())
}

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
