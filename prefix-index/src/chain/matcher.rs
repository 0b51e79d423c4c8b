//! [`PrefixMatcher`] for [`HashChainIndex`]: match, insert, extend, forget.

use super::{Frame, HashChainIndex};
use crate::check::validate_insert;
use crate::error::Result;
use crate::hash::{BlockHash, BlockHasher};
use crate::hash::{block_key, root_key};
use crate::slots;
use crate::walk::Walk;
use crate::{BlockRef, ExtraKeys, Inserted, MatchStats, PrefixMatch, PrefixMatcher, trace_block};
use kvforge_pool::BlockId;

impl<H: BlockHasher> PrefixMatcher for HashChainIndex<H> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        let HashChainIndex {
            block_size,
            hasher,
            entries,
            roots,
            stats,
            scratch,
            ..
        } = self;
        let bs = *block_size;
        stats.queries += 1;
        stats.query_tokens += tokens.len() as u64;
        let rk = root_key(hasher, extra);
        let Some(root) = roots.get(&rk).filter(|r| r.extra == *extra) else {
            trace_block(0, Some(rk), false);
            return PrefixMatch::default();
        };
        let mut walk = Walk::default();
        let mut stack = vec![Frame {
            key: rk,
            serial: root.serial,
            sealed: &root.sealed,
            pos: 0,
            depth: 0,
            next: 0,
        }];
        while let Some(f) = stack.last_mut() {
            let rest = &tokens[f.pos..];
            let Some((len, after)) = f.sealed.candidate(rest.len(), bs, f.next) else {
                stack.pop();
                continue;
            };
            f.next = after;
            let toks = &rest[..len as usize];
            let key = block_key(hasher, f.key, toks, scratch);
            let hit = entries
                .get(&key)
                .filter(|e| e.parent_serial == f.serial && *e.tokens == *toks);
            trace_block(f.depth, Some(key), hit.is_some());
            let Some(e) = hit else { continue };
            let (pos, depth) = (f.pos + len as usize, f.depth + 1);
            walk.descend(f.depth, &[BlockRef::new(e.block, len)], pos);
            if pos == tokens.len() {
                break;
            }
            let child = Frame {
                key,
                serial: e.serial,
                sealed: &e.sealed,
                pos,
                depth,
                next: 0,
            };
            // No alternative left here: do not come back (a plain chain
            // keeps one frame, replaced in place).
            if f.sealed.candidate(rest.len(), bs, after).is_none() {
                *f = child;
            } else {
                stack.push(child);
            }
        }
        let m = walk.finish();
        stats.hit_tokens += m.tokens as u64;
        stats.hit_blocks += m.blocks.len() as u64;
        m
    }

    fn peek_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        let counted = self.stats;
        let m = self.match_prefix(tokens, extra);
        self.stats = counted;
        m
    }

    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> Result<Inserted> {
        validate_insert(tokens, blocks, self.block_size)?;
        slots::forget_stale(self, blocks);
        let mut out = Inserted::default();
        let rk = root_key(&self.hasher, extra);
        // The parent's (key, serial); `None` while the root does not exist.
        let parent: (BlockHash, Option<u64>) = match self.roots.get(&rk) {
            Some(r) if r.extra != *extra => {
                out.collisions += 1;
                self.stats.collisions += 1;
                return Ok(out);
            }
            Some(r) => (rk, Some(r.serial)),
            None => (rk, None),
        };
        self.insert_below(Some((rk, extra)), parent, 0, tokens, blocks, &mut out);
        Ok(out)
    }

    fn extend(
        &mut self,
        parent: BlockRef,
        end: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
    ) -> Result<Option<Inserted>> {
        let Some(key) = slots::extend_from(self, parent.block, tokens, blocks)? else {
            return Ok(None);
        };
        let Some(serial) = self
            .entries
            .get(&key)
            .filter(|e| e.tokens.len() == parent.len as usize && e.end == end as u64)
            .map(|e| e.serial)
        else {
            return Ok(None);
        };
        let mut out = Inserted::default();
        self.insert_below(
            None,
            (key, Some(serial)),
            end as u64,
            tokens,
            blocks,
            &mut out,
        );
        Ok(Some(out))
    }

    fn forget(&mut self, block: BlockId) -> bool {
        match self.slots.get(&block.index()) {
            Some(&(id, key)) if id == block => {
                self.remove_subtree(key);
                true
            }
            _ => false,
        }
    }

    fn relocate(&mut self, old: BlockId, new: BlockId) -> bool {
        slots::relocate(self, old, new)
    }

    fn stats(&self) -> MatchStats {
        MatchStats {
            cached_blocks: self.entries.len() as u64,
            namespaces: self.roots.len() as u64,
            ..self.stats
        }
    }
}
