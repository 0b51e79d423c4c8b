//! Blocks from the remote tier into a sequence just opened: the full
//! blocks of the prompt after its local prefix hit are asked for in one
//! round ([`RemoteLookup::fetch`], on whatever thread can wait for the
//! store — a server asks while the request waits for admission) and
//! imported (verified) into the sequence's own blocks when it opens
//! ([`PagedKvCache::open_with`]), at the positions they were fetched for.

use std::ops::Range;
use std::sync::Arc;

use kvforge_coordinator::{COLD, HOT, SeqId, TieredPool};
use kvforge_pool::StorageFormat;
use kvforge_prefix::ExtraKeys;
use kvforge_remote::{RemoteCache, Scope};

use super::remote::Part;
use super::*;

impl PagedKvCache {
    /// What the remote tier could add to a request for `tokens` now: the
    /// full blocks of `tokens[..len - 1]` after the prefix the local index
    /// holds (`None`: no remote tier, or nothing to ask). Ask it
    /// ([`RemoteLookup::fetch`]) where waiting for the store holds up
    /// nothing else — while the request waits for admission — and hand
    /// the answer to [`open_with`](Self::open_with).
    pub fn remote_lookup(&self, tokens: &[u32], extra: &ExtraKeys) -> Option<RemoteLookup> {
        self.remote.as_ref()?;
        let cached = self.coordinator().cached_prefix(tokens, extra);
        self.lookup_after(cached, tokens, extra)
    }

    /// The lookup of the full blocks of `tokens[..len - 1]` after the
    /// first `cached` positions.
    pub(super) fn lookup_after(
        &self,
        cached: usize,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Option<RemoteLookup> {
        let r = self.remote.as_ref()?;
        let bs = self.block_size;
        let full = tokens.len().saturating_sub(1) / bs;
        if cached % bs != 0 || cached / bs >= full {
            return None;
        }
        let runs = r
            .runs(cached / bs..full)
            .into_iter()
            .map_while(|(part, run)| Some((part, run, r.cache(part)?.clone())))
            .collect();
        Some(RemoteLookup {
            first: cached / bs,
            runs,
            tokens: tokens[..full * bs].to_vec(),
            extra: extra.clone(),
            bs,
        })
    }

    /// Imports into `seq`, just opened on `tokens`, what `fetched` brought
    /// after the blocks `seq` holds: the leading blocks that fit the budget
    /// and the tiers' room, in order, at their own positions. Blocks the
    /// sequence already holds (the local prefix grew since the lookup) are
    /// skipped; a sequence shorter than where the lookup began (its prefix
    /// was reclaimed meanwhile), or an answer for other tokens or another
    /// namespace, imports nothing. A run cut short (by room, a miss, a
    /// block that did not verify) ends the import: the blocks after it
    /// would not follow on. An answer that came through another remote
    /// link (another scope: model, layout, block size) imports nothing,
    /// and neither does one covering every token of `tokens` (the last
    /// is always computed, for its logits). Anything that fails leaves
    /// `seq` as opened (closed and opened again on the local prefix).
    pub(super) fn import_fetched(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        extra: &ExtraKeys,
        fetched: RemoteFetched,
    ) {
        let (Some(id), Some(link), bs) = (seq.id, &self.remote, self.block_size) else {
            return;
        };
        let same_link = fetched
            .runs
            .iter()
            .all(|(part, scope, ..)| link.cache(*part).is_some_and(|c| c.scope() == scope));
        if !same_link
            || fetched.extra != *extra
            || fetched.tokens.len() >= tokens.len()
            || !tokens.starts_with(&fetched.tokens)
            || seq.len % bs != 0
            || seq.len / bs < fetched.first
        {
            return;
        }
        let have = seq.len / bs;
        let mut added = 0;
        for (part, _, run, payloads) in fetched.runs {
            let skip = (have + added).saturating_sub(run.start).min(payloads.len());
            let new = &payloads[skip..];
            if !new.is_empty() {
                let tier = if part == Part::Hot { HOT } else { COLD };
                let room = self.coordinator().import_room(id, tier);
                let at = (run.start + skip) * bs;
                match self.fill(id, part, at, &new[..new.len().min(room)]) {
                    Ok(n) => {
                        added += n;
                        if n < new.len() {
                            break;
                        }
                    }
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
            if payloads.len() < run.len() {
                break;
            }
        }
        seq.len += added * bs;
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

/// What a request may find in the remote tier: the runs of blocks after
/// its local hit, with the caches they travel through.
/// [`fetch`](Self::fetch) asks the store (it waits for it, at most its
/// deadline: call it off any loop others wait on), and
/// [`PagedKvCache::open_with`] takes the answer in.
pub struct RemoteLookup {
    /// The first block asked for.
    first: usize,
    runs: Vec<(Part, Range<usize>, Arc<RemoteCache>)>,
    /// The prompt's full blocks.
    tokens: Vec<u32>,
    extra: ExtraKeys,
    bs: usize,
}

/// The verified leading blocks a [`RemoteLookup`] found, per run.
pub struct RemoteFetched {
    first: usize,
    /// The full blocks' tokens and the namespace they were asked for.
    tokens: Vec<u32>,
    extra: ExtraKeys,
    runs: Vec<FetchedRun>,
}

/// One run of a [`RemoteFetched`]: its part, the scope of the cache it
/// came through, the blocks it covers, the leading payloads that verified.
type FetchedRun = (Part, Scope, Range<usize>, Vec<Vec<u8>>);

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
            runs.push((part, cache.scope().clone(), run, got));
            if short {
                break;
            }
        }
        RemoteFetched {
            first: self.first,
            tokens: self.tokens,
            extra: self.extra,
            runs,
        }
    }
}
