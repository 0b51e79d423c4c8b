//! The one error type of `kvforge-quant`.

/// Invalid configurations and inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// Bits other than 8, 4 or 2.
    #[error("quant: {bits}-bit storage is not supported (use 8, 4 or 2)")]
    Bits {
        /// Requested bits.
        bits: u32,
    },
    /// A zero or non-dividing group size.
    #[error("quant: group size {group_size} must be positive and divide the {axis} length {len}")]
    GroupSize {
        /// Requested group size.
        group_size: usize,
        /// Which axis the groups run along.
        axis: &'static str,
        /// That axis' length.
        len: usize,
    },
    /// A block shape with a zero dimension, or data of the wrong length.
    #[error("quant: {0}")]
    Shape(String),
    /// NaN or infinity in the input; the block is not quantized.
    #[error("quant: non-finite value {value} at element {index}; refusing to poison its group")]
    NonFinite {
        /// Flat index of the first bad element.
        index: usize,
        /// The value (as text: NaN, inf or -inf).
        value: String,
    },
    /// A finite value whose group's f16 parameters cannot hold it (see the
    /// crate docs for each format's range); the block is not quantized.
    #[error(
        "quant: value {value} at element {index} is outside what {format} f16 group parameters can hold ({limit}); refusing to quantize its group"
    )]
    OutOfRange {
        /// Flat index of the element (in the rotated block, for a rotated
        /// quantizer).
        index: usize,
        /// The value.
        value: String,
        /// The format (`int8`, `int4`, `int2`).
        format: &'static str,
        /// The limit it broke.
        limit: &'static str,
    },
    /// A quantized block whose shape, configuration or parameters are not
    /// consistent (its fields are public).
    #[error("quant: inconsistent quantized block: {0}")]
    Corrupt(String),
    /// The Hadamard rotation needs a power-of-two head dimension.
    #[error("quant: Hadamard rotation needs a power-of-two head dim, got {head_dim}")]
    Hadamard {
        /// The head dimension.
        head_dim: usize,
    },
    /// A hot window or sink that is not a whole number of blocks.
    #[error("quant: {what} of {tokens} tokens is not a multiple of the block size {block_size}")]
    Window {
        /// What is not: "hot window" or "sink".
        what: &'static str,
        /// Its length.
        tokens: usize,
        /// Block size.
        block_size: usize,
    },
    /// A block size of 0 tokens.
    #[error("quant: the block size must be at least 1 token")]
    BlockSize,
    /// An unknown format name.
    #[error("quant: unknown format {0:?}; use int8, int4 or int2")]
    UnknownFormat(String),
}

/// `Result` with [`QuantError`].
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
