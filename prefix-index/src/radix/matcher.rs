//! [`PrefixMatcher`] for [`RadixIndex`]: match, insert, extend, forget.

use super::{Frame, NO_PARENT, Node, RadixIndex};
use crate::check::validate_insert;
use crate::error::Result;
use crate::slots;
use crate::walk::Walk;
use crate::{BlockRef, ExtraKeys, Inserted, MatchStats, PrefixMatch, PrefixMatcher, trace_block};
use kvforge_pool::BlockId;

impl PrefixMatcher for RadixIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        let bs = self.block_size;
        self.stats.queries += 1;
        self.stats.query_tokens += tokens.len() as u64;
        let Some(&root) = self.roots.get(extra) else {
            trace_block(0, None, false);
            return PrefixMatch::default();
        };
        let mut walk = Walk::default();
        let mut stack = vec![Frame {
            node: root,
            pos: 0,
            depth: 0,
            next: 0,
        }];
        'frames: while let Some(f) = stack.last_mut() {
            let node = self.node(f.node);
            let rest = &tokens[f.pos..];
            let Some((len, after)) = node.sealed.candidate(rest.len(), bs, f.next) else {
                stack.pop();
                continue;
            };
            f.next = after;
            let child = node.children.get(&rest[..len as usize]).copied();
            trace_block(f.depth, None, child.is_some());
            let Some(c) = child else { continue };
            let (start, depth0) = (f.pos, f.depth);
            let more = node.sealed.candidate(rest.len(), bs, after).is_some();
            let edge = self.node(c);
            let mut off = 0;
            let mut matched = edge.blocks.len();
            for (j, b) in edge.blocks.iter().enumerate() {
                let l = b.len as usize;
                // The first block was verified by the child lookup.
                let same = j == 0
                    || (rest.len() >= off + l && rest[off..off + l] == edge.tokens[off..off + l]);
                if j > 0 {
                    trace_block(depth0 + j, None, same);
                }
                if !same {
                    matched = j;
                    break;
                }
                off += l;
            }
            walk.descend(depth0, &edge.blocks[..matched], start + off);
            if matched < edge.blocks.len() {
                continue 'frames;
            }
            if start + off == tokens.len() {
                break;
            }
            if !more {
                stack.pop();
            }
            stack.push(Frame {
                node: c,
                pos: start + off,
                depth: depth0 + edge.blocks.len(),
                next: 0,
            });
        }
        let m = walk.finish();
        self.stats.hit_tokens += m.tokens as u64;
        self.stats.hit_blocks += m.blocks.len() as u64;
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
        let root = match self.roots.get(extra) {
            Some(&r) => r,
            None => {
                let r = self.alloc_node(Node {
                    parent: NO_PARENT,
                    namespace: Some(Box::new(extra.clone())),
                    ..Node::default()
                });
                self.roots.insert(extra.clone(), r);
                r
            }
        };
        self.insert_below(root, 0, 0, tokens, blocks, &mut out);
        if self.node(root).children.is_empty() {
            // Nothing was added to a new namespace.
            self.roots.remove(extra);
            self.free_node(root);
        }
        self.stats.inserted_blocks += out.new as u64;
        self.stats.duplicate_blocks += out.already_cached as u64;
        Ok(out)
    }

    fn extend(
        &mut self,
        parent: BlockRef,
        end: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
    ) -> Result<Option<Inserted>> {
        let Some(node) = slots::extend_from(self, parent.block, tokens, blocks)? else {
            return Ok(None);
        };
        let Some(j) = self
            .node(node)
            .blocks
            .iter()
            .position(|b| b.block == parent.block)
        else {
            return Ok(None);
        };
        let mut off: usize = self.node(node).blocks[..=j]
            .iter()
            .map(|b| b.len as usize)
            .sum();
        // The parent must be the caller's: that length, ending at `end`.
        if self.node(node).blocks[j].len != parent.len || self.edge_start(node) + off != end {
            return Ok(None);
        }
        let mut out = Inserted::default();
        // Follow the rest of the parent's edge while the blocks agree.
        let (mut jj, mut i, mut p) = (j + 1, 0, 0);
        let mut examined = 0;
        {
            let n = self.node(node);
            while jj < n.blocks.len() && i < blocks.len() {
                let l = blocks[i].len as usize;
                examined += l as u64;
                if n.blocks[jj].len as usize != l || tokens[p..p + l] != n.tokens[off..off + l] {
                    break;
                }
                (i, jj, p, off) = (i + 1, jj + 1, p + l, off + l);
                out.already_cached += 1;
            }
        }
        self.stats.insert_tokens += examined;
        self.stats.duplicate_blocks += out.already_cached as u64;
        if i < blocks.len() {
            let below = if jj < self.node(node).blocks.len() {
                self.split(node, jj, off)
            } else {
                node
            };
            let before = out.already_cached;
            self.insert_below(below, i, p, tokens, blocks, &mut out);
            // insert_below counted its own duplicates into `out` only.
            self.stats.duplicate_blocks += (out.already_cached - before) as u64;
        }
        self.stats.inserted_blocks += out.new as u64;
        Ok(Some(out))
    }

    fn forget(&mut self, block: BlockId) -> bool {
        let Some(&(id, node)) = self.slots.get(&block.index()) else {
            return false;
        };
        if id != block {
            return false;
        }
        let Some(pos) = self.node(node).blocks.iter().position(|b| b.block == block) else {
            return false;
        };
        self.drop_subtree(node);
        let key: Box<[u32]> = self.node(node).first_key().into();
        let cut: usize = self.node(node).blocks[..pos]
            .iter()
            .map(|b| b.len as usize)
            .sum();
        let removed: Vec<BlockRef> = {
            let n = self.node_mut(node);
            n.tokens.truncate(cut);
            n.blocks.drain(pos..).collect()
        };
        for b in removed {
            self.clear_slot(b);
        }
        if pos == 0 {
            let parent = self.node(node).parent;
            self.free_node(node);
            self.detach(parent, &key);
        }
        true
    }

    fn relocate(&mut self, old: BlockId, new: BlockId) -> bool {
        slots::relocate(self, old, new)
    }

    fn stats(&self) -> MatchStats {
        MatchStats {
            cached_blocks: self.cached,
            namespaces: self.roots.len() as u64,
            ..self.stats
        }
    }
}
