//! Near-duplicate sharing: random-hyperplane signatures (SimHash), exact
//! cosine verification.

use kvforge_pool::BlockId;

use crate::{Candidates, Content, Deduplicator, ShareError, ShareStats};

/// The widest signature of one table.
pub const MAX_BITS: u32 = 64;

/// How [`SimHashDedup`] hashes and what it accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimHashConfig {
    /// The least cosine at which two blocks are shared, in (0, 1].
    pub threshold: f32,
    /// Hyperplanes (signature bits) per table, 1..=64: more bits, fewer
    /// and closer candidates.
    pub bits: u32,
    /// Tables: a near-duplicate is found when its signature agrees with
    /// the candidate's in any one table.
    pub tables: u32,
    /// Seed of the hyperplanes.
    pub seed: u64,
}

impl Default for SimHashConfig {
    fn default() -> Self {
        SimHashConfig {
            threshold: 0.95,
            bits: 16,
            tables: 4,
            seed: 0x5eed,
        }
    }
}

impl SimHashConfig {
    /// A clear error for a parameter that cannot work.
    pub fn validate(&self) -> Result<(), ShareError> {
        let bad = |m: String| Err(ShareError::Config(m));
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            return bad(format!(
                "a cosine threshold of {} is outside (0, 1]",
                self.threshold
            ));
        }
        if self.bits == 0 || self.tables == 0 {
            return bad(format!(
                "{} bits × {} tables is zero hyperplanes",
                self.bits, self.tables
            ));
        }
        if self.bits > MAX_BITS {
            return bad(format!(
                "{} signature bits per table; at most {MAX_BITS} are supported",
                self.bits
            ));
        }
        Ok(())
    }
}

/// The cosine of `a` and `b` (accumulated in f64); 0 when either is zero
/// or their lengths differ.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return 0.0;
    }
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// [`SimHashDedup`]'s test: the vectors' cosine reaches `threshold`.
fn near(a: &Content, b: &Content, threshold: f32) -> bool {
    cosine(&a.vector, &b.vector) >= f64::from(threshold)
}

/// Shares blocks whose dequantized vectors have a cosine of at least the
/// threshold, found through random-hyperplane signatures.
///
/// Hyperplanes have ±1 entries (Rademacher, from the seed), stored as sign
/// bits: `bits × tables × dim / 8` bytes, fixed by the first vector
/// offered. Signing a vector costs `bits × tables × dim` additions.
pub struct SimHashDedup {
    cfg: SimHashConfig,
    dim: usize,
    /// Sign bits, plane after plane, `words` u64 each.
    planes: Vec<u64>,
    words: usize,
    index: Candidates<(u32, u64)>,
}

impl SimHashDedup {
    /// An empty deduplicator; an error for a configuration that cannot work.
    pub fn new(cfg: SimHashConfig) -> Result<Self, ShareError> {
        cfg.validate()?;
        Ok(SimHashDedup {
            cfg,
            dim: 0,
            planes: Vec::new(),
            words: 0,
            index: Candidates::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> SimHashConfig {
        self.cfg
    }

    fn planes_for(&mut self, dim: usize) -> Result<(), ShareError> {
        if self.dim == dim {
            return Ok(());
        }
        if self.dim != 0 {
            return Err(ShareError::Content(format!(
                "a vector of {dim} elements; this deduplicator signs {}",
                self.dim
            )));
        }
        if dim == 0 {
            return Err(ShareError::Content("an empty vector".into()));
        }
        self.dim = dim;
        self.words = dim.div_ceil(64);
        let n = (self.cfg.bits * self.cfg.tables) as usize * self.words;
        let mut s = self.cfg.seed;
        self.planes = (0..n).map(|_| split_mix(&mut s)).collect();
        Ok(())
    }

    /// One key per table: `(table, signature bits)`.
    fn keys(&self, x: &[f32]) -> Vec<(u32, u64)> {
        let mut keys = Vec::with_capacity(self.cfg.tables as usize);
        for t in 0..self.cfg.tables {
            let mut sig = 0u64;
            for b in 0..self.cfg.bits {
                let p = (t * self.cfg.bits + b) as usize;
                let plane = &self.planes[p * self.words..(p + 1) * self.words];
                if signed_sum(plane, x) >= 0.0 {
                    sig |= 1 << b;
                }
            }
            keys.push((t, sig));
        }
        keys
    }
}

/// Σ ± x_i, the sign of each term from a bit of `plane` (set = +).
fn signed_sum(plane: &[u64], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (w, chunk) in plane.iter().zip(x.chunks(64)) {
        for (j, &v) in chunk.iter().enumerate() {
            // Flip the sign bit where the plane's bit is clear.
            let flip = (!(w >> j) & 1) as u32;
            acc[j % 8] += f32::from_bits(v.to_bits() ^ (flip << 31));
        }
    }
    acc.iter().sum()
}

fn split_mix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Deduplicator for SimHashDedup {
    fn name(&self) -> String {
        format!(
            "simhash-{}x{}-cos{}",
            self.cfg.bits, self.cfg.tables, self.cfg.threshold
        )
    }

    fn wants_vectors(&self) -> bool {
        true
    }

    fn matches(&self, a: &Content, b: &Content) -> bool {
        near(a, b, self.cfg.threshold)
    }

    fn offer(
        &mut self,
        block: BlockId,
        content: &Content,
        stored: &mut dyn FnMut(BlockId) -> Option<Content>,
    ) -> Result<Option<BlockId>, ShareError> {
        let x = &content.vector;
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            return Err(ShareError::Content(format!(
                "element {i} of the vector is {}",
                x[i]
            )));
        }
        self.planes_for(x.len())?;
        let keys = self.keys(x);
        let t = self.cfg.threshold;
        Ok(self
            .index
            .offer(block, keys, content, stored, |a, b| near(a, b, t)))
    }

    fn forget(&mut self, block: BlockId) {
        self.index.remove(block);
    }

    fn stats(&self) -> ShareStats {
        self.index.stats
    }
}
