//! The inputs of the ablation and the experiments: data files read with a
//! bound, the chitchat conversations, the longest article of a text, a
//! median, and a seeded generator.

use anyhow::{Context, bail};

/// The text of a data file: a regular file of at most 256 MiB, UTF-8
/// (`/dev/zero`, a folder or a FIFO is one line, not a hang).
pub fn read_text(path: &std::path::Path) -> anyhow::Result<String> {
    kvforge_engine::input::read_text(path, kvforge_engine::input::MAX_TEXT_BYTES)
        .map_err(anyhow::Error::msg)
}

/// Conversations of `chitchat-dataset` (`dataset.json`) whose number of
/// messages is in `lengths` and at least `turns`, in file order, cut to
/// `turns` user messages (each message's fragments joined by newlines);
/// an error if fewer than `n` qualify.
pub fn load_chats(
    path: &std::path::Path,
    turns: usize,
    n: usize,
    lengths: std::ops::RangeInclusive<usize>,
) -> anyhow::Result<Vec<Vec<String>>> {
    let text = match read_text(path) {
        Ok(t) => t,
        Err(e) if !path.exists() => bail!("{e} (run `cargo xtask setup`)"),
        Err(e) => return Err(e),
    };
    let all: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let map = all
        .as_object()
        .with_context(|| format!("{}: not a JSON object", path.display()))?;
    let mut out = Vec::new();
    for conv in map.values() {
        let Some(msgs) = conv["messages"].as_array() else {
            continue;
        };
        if !lengths.contains(&msgs.len()) || msgs.len() < turns {
            continue;
        }
        let chat: Vec<String> = msgs[..turns]
            .iter()
            .map(|t| {
                let parts = t.as_array().map(Vec::as_slice).unwrap_or(&[]);
                parts
                    .iter()
                    .filter_map(|m| m["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect();
        out.push(chat);
        if out.len() == n {
            return Ok(out);
        }
    }
    bail!(
        "{}: only {} conversations with {turns}+ turns",
        path.display(),
        out.len()
    )
}

/// The median of the finite values of `v` (NaN if there are none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The longest article of a text file (`<doc …>` files such as the setup's
/// `wiki.utf8` are split into articles; plain text is one).
pub fn longest_article(path: &std::path::Path) -> anyhow::Result<String> {
    Ok(kvforge_engine::ppl::longest_article(&read_text(path)?))
}

/// SplitMix64: a tiny, fast, seeded generator for synthetic workloads.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % u64::from(hi - lo + 1)) as u32
    }
}
