//! The bench README's worked example of a new eviction policy: StreamingLLM's
//! sink and recent window, and of the whole blocks between them one in
//! `stride` kept (a sparse sample of the past instead of none of it).

use kvforge_engine::mechanisms::PolicyParams;
use kvforge_evict::{EvictError, EvictionPolicy, Pressure, SeqKey};
use kvforge_pool::{BlockTable, Slot};

/// Keeps `sink` leading and `window` trailing tokens, and every entry in
/// between whose first position falls on a `stride`-block grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    sink: u64,
    window: u64,
    stride: u64,
    block: u64,
}

impl Strided {
    /// `block` is the cache's block size (the grid the stride counts in).
    pub fn new(
        sink: usize,
        window: usize,
        stride: usize,
        block: usize,
    ) -> Result<Self, EvictError> {
        if window == 0 || stride == 0 || block == 0 {
            return Err(EvictError::Config(
                "strided: window, stride and block size must be at least 1".into(),
            ));
        }
        Ok(Strided {
            sink: sink as u64,
            window: window as u64,
            stride: stride as u64,
            block: block as u64,
        })
    }
}

/// Its parameters in a mechanisms file: `eviction = { policy = "strided",
/// sink = 32, window = 512, stride = 4 }`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    sink: usize,
    window: usize,
    stride: usize,
}

/// Builds it from a mechanisms file's parameters (what the registry
/// calls: `Registry::builtin().with_eviction("strided", strided::build)`).
pub fn build(p: &PolicyParams<'_>) -> Result<Box<dyn EvictionPolicy>, String> {
    let Params {
        sink,
        window,
        stride,
    } = p.parse()?;
    let s = Strided::new(sink, window, stride, p.block_size).map_err(|e| e.to_string())?;
    Ok(Box::new(s))
}

impl EvictionPolicy for Strided {
    fn name(&self) -> String {
        format!(
            "strided{}-sink{}-window{}",
            self.stride, self.sink, self.window
        )
    }

    fn victims(&mut self, _seq: SeqKey, table: &BlockTable, _p: Pressure, out: &mut Vec<usize>) {
        let recent = table.positions().saturating_sub(self.window);
        for (i, e) in table.entries().iter().enumerate() {
            if e.first() >= recent {
                break;
            }
            let kept = (e.first() / self.block) % self.stride == 0;
            if e.slot() != Slot::Dropped && !kept && e.first() >= self.sink && e.end() <= recent {
                out.push(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_passes_the_eviction_conformance_suite() {
        for (sink, window, stride) in [(0, 1, 1), (4, 8, 2), (16, 40, 3)] {
            let mut p = Strided::new(sink, window, stride, 4).unwrap();
            kvforge_evict::testing::check_policy(&mut p, 4);
        }
        assert!(Strided::new(4, 8, 0, 4).is_err());
    }

    #[test]
    fn strided_keeps_one_block_in_stride_between_sink_and_window() {
        let mut t = BlockTable::new(4).unwrap();
        for b in 0..10u32 {
            t.push(Slot::Hot(kvforge_pool::BlockId::new(b, 1)), 4, false)
                .unwrap();
        }
        let mut p = Strided::new(4, 8, 2, 4).unwrap();
        let mut out = Vec::new();
        let pressure = Pressure::new(0.5, 1);
        p.victims(1, &t, pressure, &mut out);
        // Blocks 0 (sink) and 8, 9 (window) stay; of 1..8 the even ones stay.
        assert_eq!(out, [1, 3, 5, 7]);
    }
}
