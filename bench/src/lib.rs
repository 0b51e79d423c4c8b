//! Shared pieces of the kvforge benchmarks and experiment workloads.
//!
//! * [`smollm2_layout`], [`synthetic_tokens`], [`cached_index`]: fixtures for
//!   the criterion benches in `benches/`.
//! * [`sealing`]: the turn-tail experiment (hit rate gained against memory
//!   spent: tails skipped, sealed or copied), run by
//!   `cargo run -p kvforge-bench --release --bin sealing`.
//! * `cli` (feature `engine`): the experiment binaries' command lines on
//!   clap, one line per error, the flags they share; [`count`],
//!   [`positive`]; their inputs, output folder and PNGs come from
//!   `kvforge-ablate` (re-exported: `read_text`, `load_chats`,
//!   `longest_article`, `median`, `SplitMix`, `output`, `plot`, `ablate`).
//!
//! Feature `engine` (default) adds the libtorch-backed experiments and the
//! ablation harness; the crate does not build without it today (the
//! fixtures and `sealing` use the harness's generator and output folder).

#[cfg(feature = "engine")]
pub mod cli;
pub mod sealing;
#[cfg(feature = "engine")]
pub mod serve_load;

use anyhow::{Context, bail};
#[cfg(feature = "engine")]
pub use kvforge_ablate::inputs::{SplitMix, load_chats, longest_article, median, read_text};
/// The ablation harness (`kvforge-ablate`), and the output folder and
/// plots the experiment binaries share with it.
#[cfg(feature = "engine")]
pub use kvforge_ablate::{self as ablate, output, plot};
use kvforge_pool::{BlockId, KvLayout, StorageFormat};
use kvforge_prefix::{BlockRef, ExtraKeys, PrefixMatcher};

/// `main` for the experiment binaries: runs `run`, prints an error as one
/// line prefixed with the program's name, and sets the exit code.
pub fn main_with(name: &str, run: impl FnOnce() -> anyhow::Result<()>) -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `value`, given for `flag`, as a count.
pub fn count(flag: &str, value: &str) -> anyhow::Result<usize> {
    value
        .parse()
        .with_context(|| format!("{flag}: {value:?} is not a count"))
}

/// `value`, given for `flag`, as a count of at least 1.
pub fn positive(flag: &str, value: &str) -> anyhow::Result<usize> {
    let v = count(flag, value)?;
    if v == 0 {
        bail!("{flag} must be at least 1");
    }
    Ok(v)
}

/// SmolLM2-135M's KV cache in f16 (30 layers, 3 KV heads, head dim 64).
pub fn smollm2_layout(block_size: u32) -> KvLayout {
    match KvLayout::new(30, 3, 64, block_size, StorageFormat::F16) {
        Ok(l) => l,
        Err(e) => panic!("block size {block_size}: {e}"),
    }
}

/// `n` token ids in SmolLM2's vocabulary (49,152), from `seed`.
pub fn synthetic_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut r = SplitMix::new(seed);
    (0..n).map(|_| r.range(3, 49_151)).collect()
}

/// Indexes every full block of `tokens` under made-up block ids (slot `i`
/// holds block `i`), as if a pool had handed them out.
pub fn cached_index<M: PrefixMatcher + ?Sized>(m: &mut M, tokens: &[u32], extra: &ExtraKeys) {
    let bs = m.block_size();
    let blocks: Vec<BlockRef> = (0..tokens.len() / bs)
        .map(|i| BlockRef::new(BlockId::new(i as u32, 1), bs as u32))
        .collect();
    if let Err(e) = m.insert(tokens, extra, &blocks) {
        panic!("indexing synthetic tokens: {e}");
    }
}
