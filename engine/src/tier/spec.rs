//! [`KvQuant`]: how a cache quantizes the blocks that leave its hot
//! window (bits, groups, key axis, rotation, window, sink).

use kvforge_quant::{Axis, QuantConfig};

use crate::error::Result;

/// How a cache quantizes blocks that leave the hot window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvQuant {
    /// Bits per element: 8 (symmetric), 4 or 2 (affine).
    pub bits: u32,
    /// Elements per group along the head dim (values; per-token keys).
    /// Per-channel key groups span one block's tokens.
    pub group_size: usize,
    /// Newest tokens kept in full precision: a whole number of blocks
    /// (rejected otherwise).
    pub window: usize,
    /// Hadamard-rotate keys before quantizing.
    pub rotate: bool,
    /// Key groups per channel (KIVI) or per token. Values are always
    /// quantized per token.
    pub key_axis: Axis,
    /// The first tokens of the sequence kept in full precision (attention
    /// sinks, as in StreamingLLM): a whole number of blocks.
    pub sink: usize,
}

impl KvQuant {
    /// What a quantized block's bytes depend on — bits, group, key axis,
    /// rotation (not the window or sink): `int4-g32-kc`.
    pub fn content_name(&self) -> String {
        let axis = match self.key_axis {
            Axis::PerChannel => "kc",
            Axis::PerToken => "kt",
        };
        let rot = if self.rotate { "+rot" } else { "" };
        format!("int{}-g{}-{axis}{rot}", self.bits, self.group_size)
    }

    /// `int4` etc. with defaults: group 32, window 128, per-channel keys,
    /// no rotation, a 32-token sink.
    pub fn parse(format: &str) -> Result<Self> {
        Ok(KvQuant {
            bits: QuantConfig::parse_bits(format)?,
            group_size: 32,
            window: 128,
            rotate: false,
            key_axis: Axis::PerChannel,
            sink: 32,
        })
    }

    /// A short label: `int4-g32-w128-kc` (`+rot` when rotated, `-s32`
    /// with a 32-token sink).
    pub fn name(&self) -> String {
        let axis = match self.key_axis {
            Axis::PerChannel => "kc",
            Axis::PerToken => "kt",
        };
        let rot = if self.rotate { "+rot" } else { "" };
        let sink = if self.sink > 0 {
            format!("-s{}", self.sink)
        } else {
            String::new()
        };
        format!(
            "int{}-g{}-w{}{sink}-{axis}{rot}",
            self.bits, self.group_size, self.window
        )
    }
}
