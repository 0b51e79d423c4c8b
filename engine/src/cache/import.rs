//! Blocks from the remote tier into a sequence just opened: after a local
//! prefix hit, the next full blocks of the prompt are asked for in one
//! round ([`RemoteLookup::fetch`], on whatever thread can wait for the
//! store) and imported (verified) into the sequence's own blocks
//! ([`PagedKvCache::import_fetched`]), at the positions they were fetched
//! for.

use std::ops::Range;
use std::sync::Arc;

use kvforge_coordinator::{COLD, HOT, SeqId, TieredPool};
use kvforge_pool::StorageFormat;
use kvforge_prefix::ExtraKeys;
use kvforge_remote::RemoteCache;

use super::remote::Part;
use super::*;

impl PagedKvCache {
    /// After a local open of `seq` on `tokens`: what to ask the remote
    /// tier for — the full blocks of `tokens[..len - 1]` after the local
    /// hit (`None`: no remote tier, or nothing to ask).
    pub(super) fn remote_lookup(
        &self,
        seq: &Sequence,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Option<RemoteLookup> {
        let (Some(r), Some(id)) = (&self.remote, seq.id) else {
            return None;
        };
        let bs = self.block_size;
        let full = tokens.len().saturating_sub(1) / bs;
        if seq.len % bs != 0 || seq.len / bs >= full {
            return None;
        }
        let runs = r
            .runs(seq.len / bs..full)
            .into_iter()
            .map_while(|(part, run)| Some((part, run, r.cache(part)?.clone())))
            .collect();
        Some(RemoteLookup {
            seq: id,
            at: seq.len,
            runs,
            tokens: tokens[..full * bs].to_vec(),
            extra: extra.clone(),
            bs,
        })
    }

    /// Imports what `fetched` brought into `seq`, still as opened (its
    /// length where the lookup began): the leading blocks that fit the
    /// budget and the tiers' room, in order, at their own positions. A run
    /// cut short (by room, a miss, a block that did not verify) ends the
    /// import: the blocks after it would not follow on. Anything that
    /// fails leaves `seq` as opened (closed and opened again on the local
    /// prefix).
    pub fn import_fetched(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        extra: &ExtraKeys,
        fetched: RemoteFetched,
    ) {
        if seq.id != Some(fetched.seq) || seq.len != fetched.at {
            return;
        }
        let id = fetched.seq;
        let mut added = 0;
        for (part, run, payloads) in fetched.runs {
            let tier = if part == Part::Hot { HOT } else { COLD };
            let room = self.coordinator().import_room(id, tier);
            let take = payloads.len().min(room);
            match self.fill(id, part, run.start * self.block_size, &payloads[..take]) {
                Ok(n) if n < run.len() => {
                    added += n;
                    break;
                }
                Ok(n) => added += n,
                Err(e) => {
                    // Cut the imported blocks off again: close, reopen locally.
                    tracing::warn!("remote blocks not imported: {e}");
                    if self.free(seq).is_ok() {
                        if let Ok(s) = self.coordinator().open(tokens, extra) {
                            *seq = Sequence {
                                id: Some(s.seq),
                                len: s.reused,
                            };
                        }
                    }
                    return;
                }
            }
        }
        seq.len += added * self.block_size;
    }

    /// Appends fresh blocks for `payloads` (the KV of positions `at..`) to
    /// `id` and writes them, all under the coordinator's lock (no other
    /// step can take them before they hold their KV). Returns how many the
    /// budget let in.
    fn fill(&self, id: SeqId, part: Part, at: usize, payloads: &[Vec<u8>]) -> Result<usize> {
        if payloads.is_empty() {
            return Ok(0);
        }
        let mut c = self.coordinator();
        let tier = if part == Part::Hot { HOT } else { COLD };
        let blocks = c.import(id, tier, at as u64, payloads.len())?;
        for (&b, p) in blocks.iter().zip(payloads) {
            match (&self.cold, part) {
                (Some(t), Part::Cold) => {
                    t.put(b, Arc::new(t.block_of_content(self.k.len(), p)?))?
                }
                _ => self.write_hot(TieredPool::slot_of(b) as usize, p)?,
            }
        }
        Ok(blocks.len())
    }

    /// Writes `bytes` ([`read_hot`](Self::read_hot)'s layout) into hot
    /// block `slot`, which only the importing sequence holds; refuses
    /// values that are not finite (a verified blob's numbers are checked
    /// too: nothing non-finite reaches attention).
    fn write_hot(&self, slot: usize, bytes: &[u8]) -> Result<()> {
        if !all_finite(self.hot_layout.format(), bytes) {
            return Err(EngineError::Request(
                "a remote block with values that are not finite".into(),
            ));
        }
        let bs = self.block_size as i64;
        let per = self.hot_layout.block_bytes() as usize / (2 * self.k.len());
        let dims = [bs, self.shape.heads as i64, self.shape.head_dim as i64];
        for (i, t) in self
            .k
            .iter()
            .zip(&self.v)
            .flat_map(|(k, v)| [k, v])
            .enumerate()
        {
            let src = Tensor::f_from_data_size(&bytes[i * per..(i + 1) * per], &dims, t.kind())?
                .f_to_device(t.device())?;
            t.f_narrow(0, slot as i64 * bs, bs)?.f_copy_(&src)?;
        }
        Ok(())
    }
}

/// Whether every value of `bytes` (little-endian, in `format`) is finite:
/// its exponent bits are not all ones. A format that is not a float is
/// not a hot tier's (the link refuses it).
pub(super) fn all_finite(format: StorageFormat, bytes: &[u8]) -> bool {
    let half = |exp: u16| {
        bytes
            .chunks_exact(2)
            .all(|c| u16::from_le_bytes([c[0], c[1]]) & exp != exp)
    };
    match format {
        StorageFormat::F16 => half(0x7c00),
        StorageFormat::BF16 => half(0x7f80),
        StorageFormat::F32 => bytes
            .chunks_exact(4)
            .all(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 != 0x7f80_0000),
        _ => false,
    }
}

/// What an opened sequence may find in the remote tier: the runs of
/// blocks after its local hit, with the caches they travel through.
/// [`fetch`](Self::fetch) asks the store (it waits for it, at most its
/// deadline: call it off any loop others wait on), and
/// [`PagedKvCache::import_fetched`] takes the answer in.
pub struct RemoteLookup {
    seq: SeqId,
    /// The sequence's length when it was opened.
    at: usize,
    runs: Vec<(Part, Range<usize>, Arc<RemoteCache>)>,
    /// The prompt's full blocks.
    tokens: Vec<u32>,
    extra: ExtraKeys,
    bs: usize,
}

/// The verified leading blocks a [`RemoteLookup`] found, per run.
pub struct RemoteFetched {
    seq: SeqId,
    at: usize,
    runs: Vec<(Part, Range<usize>, Vec<Vec<u8>>)>,
}

impl RemoteLookup {
    /// Asks the store, run by run, for the leading blocks that verify; a
    /// run that comes back short ends the lookup.
    pub fn fetch(self) -> RemoteFetched {
        let bs = self.bs;
        let mut runs = Vec::new();
        for (part, run, cache) in self.runs {
            let links = cache.chain(&self.tokens[..run.end * bs], &self.extra);
            let got = cache.fetch(
                &links[run.clone()],
                &self.tokens[run.start * bs..run.end * bs],
            );
            let short = got.len() < run.len();
            runs.push((part, run, got));
            if short {
                break;
            }
        }
        RemoteFetched {
            seq: self.seq,
            at: self.at,
            runs,
        }
    }
}
