//! [`RadixIndex`]: an SGLang-style radix tree at block granularity.
//!
//! Each edge holds a run of blocks and their tokens; a node's children are
//! keyed by the exact tokens of their first block. Branching happens only at
//! block boundaries, so a match is always a whole number of blocks.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use crate::{
    BlockId, BlockRef, ExtraKeys, Inserted, MatchStats, PrefixError, PrefixMatch, PrefixMatcher,
    Result, trace_block, validate_insert,
};

type NodeId = u32;
const NO_PARENT: NodeId = NodeId::MAX;

#[derive(Default)]
struct Node {
    parent: NodeId,
    /// The edge from `parent`: blocks and their concatenated tokens.
    blocks: Vec<BlockRef>,
    tokens: Vec<u32>,
    /// Children keyed by the tokens of their first block.
    children: HashMap<Box<[u32]>, NodeId, Xxh3DefaultBuilder>,
    /// Lengths of sealed (short) first blocks among the children, longest first.
    sealed: Vec<u32>,
}

impl Node {
    fn first_key(&self) -> &[u32] {
        let len = self.blocks.first().map_or(0, |b| b.len as usize);
        &self.tokens[..len]
    }
}

/// Prefix index as a radix tree over blocks (one tree per namespace).
///
/// Lookup hashes only the first block of each edge (to find the child) and
/// then compares tokens along the edge, so a long shared prefix costs one
/// `memcmp` per block instead of one hash per block.
pub struct RadixIndex {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    roots: HashMap<ExtraKeys, NodeId, Xxh3DefaultBuilder>,
    /// Block index -> (handle, node whose edge holds it).
    slots: Vec<Option<(BlockId, NodeId)>>,
    cached: u64,
    stats: MatchStats,
}

impl RadixIndex {
    /// An empty tree.
    pub fn new(block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(PrefixError::ZeroBlockSize);
        }
        Ok(RadixIndex {
            block_size,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::default(),
            slots: Vec::new(),
            cached: 0,
            stats: MatchStats::default(),
        })
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn set_slot(&mut self, b: BlockRef, node: NodeId) {
        let idx = b.block.index() as usize;
        if idx >= self.slots.len() {
            self.slots.resize(idx + 1, None);
        }
        self.slots[idx] = Some((b.block, node));
    }

    fn clear_slot(&mut self, b: BlockRef) {
        if let Some(slot) = self.slots.get_mut(b.block.index() as usize) {
            if matches!(*slot, Some((id, _)) if id == b.block) {
                *slot = None;
            }
        }
        self.cached -= 1;
        self.stats.forgotten_blocks += 1;
    }

    /// Recomputes a node's sealed-length list from its children's keys.
    fn refresh_sealed(&mut self, id: NodeId) {
        let bs = self.block_size;
        let n = self.node_mut(id);
        let mut lens: Vec<u32> = n
            .children
            .keys()
            .map(|k| k.len() as u32)
            .filter(|&l| (l as usize) < bs)
            .collect();
        lens.sort_unstable_by(|a, b| b.cmp(a));
        lens.dedup();
        n.sealed = lens;
    }

    /// Frees every node below `id` (not `id` itself) and their slots.
    fn drop_subtree(&mut self, id: NodeId) {
        let mut stack: Vec<NodeId> = self.node_mut(id).children.drain().map(|(_, c)| c).collect();
        self.node_mut(id).sealed.clear();
        while let Some(c) = stack.pop() {
            let node = std::mem::take(self.node_mut(c));
            stack.extend(node.children.into_values());
            for b in node.blocks {
                self.clear_slot(b);
            }
            self.free_nodes.push(c);
        }
    }

    /// Splits `child`'s edge after `j` blocks (`tok` tokens): a new node takes
    /// the head and becomes `child`'s parent. Returns the new node.
    fn split(&mut self, child: NodeId, j: usize, tok: usize) -> NodeId {
        let parent = self.node(child).parent;
        let key: Box<[u32]> = self.node(child).first_key().into();
        let (head_blocks, head_tokens) = {
            let c = self.node_mut(child);
            (
                c.blocks.drain(..j).collect::<Vec<_>>(),
                c.tokens.drain(..tok).collect::<Vec<_>>(),
            )
        };
        let tail_key: Box<[u32]> = self.node(child).first_key().into();
        let mut children = HashMap::default();
        children.insert(tail_key, child);
        let mid = self.alloc_node(Node {
            parent,
            blocks: head_blocks,
            tokens: head_tokens,
            children,
            sealed: Vec::new(),
        });
        self.refresh_sealed(mid);
        self.node_mut(child).parent = mid;
        if let Some(slot) = self.node_mut(parent).children.get_mut(&key) {
            *slot = mid;
        }
        for b in self.node(mid).blocks.clone() {
            self.set_slot(b, mid);
        }
        mid
    }
}

impl PrefixMatcher for RadixIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn match_prefix(&mut self, tokens: &[u32], extra: &ExtraKeys) -> PrefixMatch {
        let bs = self.block_size;
        self.stats.queries += 1;
        self.stats.query_tokens += tokens.len() as u64;
        let mut m = PrefixMatch::default();
        let Some(&root) = self.roots.get(extra) else {
            trace_block(0, None, false);
            return m;
        };
        let mut node = self.node(root);
        let mut p = 0;
        'walk: loop {
            let rest = &tokens[p..];
            let full = (rest.len() >= bs).then_some(bs as u32);
            let child = full
                .into_iter()
                .chain(
                    node.sealed
                        .iter()
                        .copied()
                        .filter(|&l| l as usize <= rest.len()),
                )
                .find_map(|len| node.children.get(&rest[..len as usize]));
            trace_block(m.blocks.len(), None, child.is_some());
            let Some(&c) = child else { break };
            node = self.node(c);
            let mut off = 0;
            for (j, b) in node.blocks.iter().enumerate() {
                let l = b.len as usize;
                // The first block was verified by the child lookup.
                let same = j == 0
                    || (rest.len() >= off + l && rest[off..off + l] == node.tokens[off..off + l]);
                if j > 0 {
                    trace_block(m.blocks.len(), None, same);
                }
                if !same {
                    p += off;
                    break 'walk;
                }
                m.blocks.push(*b);
                off += l;
            }
            p += off;
        }
        m.tokens = p;
        self.stats.hit_tokens += p as u64;
        self.stats.hit_blocks += m.blocks.len() as u64;
        m
    }

    fn insert(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
        blocks: &[BlockRef],
    ) -> Result<Inserted> {
        validate_insert(tokens, blocks, self.block_size)?;
        // Slots handed out again since they were indexed: their old content is gone.
        for b in blocks {
            if let Some(Some((old, _))) = self.slots.get(b.block.index() as usize) {
                if *old != b.block {
                    let old = *old;
                    self.forget(old);
                }
            }
        }
        let mut out = Inserted::default();
        let mut node = match self.roots.get(extra) {
            Some(&r) => r,
            None => {
                let r = self.alloc_node(Node {
                    parent: NO_PARENT,
                    ..Node::default()
                });
                self.roots.insert(extra.clone(), r);
                r
            }
        };
        let (mut i, mut p) = (0, 0);
        while i < blocks.len() {
            let len = blocks[i].len as usize;
            let child = self.node(node).children.get(&tokens[p..p + len]).copied();
            let Some(c) = child else {
                // A new leaf with every remaining block.
                let rest = &blocks[i..];
                let end = p + rest.iter().map(|b| b.len as usize).sum::<usize>();
                let leaf = self.alloc_node(Node {
                    parent: node,
                    blocks: rest.to_vec(),
                    tokens: tokens[p..end].to_vec(),
                    ..Node::default()
                });
                self.node_mut(node)
                    .children
                    .insert(tokens[p..p + len].into(), leaf);
                if len < self.block_size {
                    self.refresh_sealed(node);
                }
                for &b in rest {
                    self.set_slot(b, leaf);
                }
                out.new += rest.len();
                self.cached += rest.len() as u64;
                break;
            };
            // Follow the edge while blocks agree (length and tokens).
            let (mut j, mut off) = (0, 0);
            {
                let cn = self.node(c);
                while j < cn.blocks.len() && i < blocks.len() {
                    let l = blocks[i].len as usize;
                    if cn.blocks[j].len as usize != l || tokens[p..p + l] != cn.tokens[off..off + l]
                    {
                        break;
                    }
                    (i, j, p, off) = (i + 1, j + 1, p + l, off + l);
                    out.already_cached += 1;
                }
            }
            if j == self.node(c).blocks.len() {
                node = c;
            } else if i < blocks.len() {
                node = self.split(c, j, off);
            } else {
                break;
            }
        }
        self.stats.inserted_blocks += out.new as u64;
        self.stats.duplicate_blocks += out.already_cached as u64;
        Ok(out)
    }

    fn forget(&mut self, block: BlockId) -> bool {
        let Some(&Some((id, node))) = self.slots.get(block.index() as usize) else {
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
            self.node_mut(parent).children.remove(&key);
            self.refresh_sealed(parent);
            *self.node_mut(node) = Node::default();
            self.free_nodes.push(node);
        }
        true
    }

    fn stats(&self) -> MatchStats {
        MatchStats {
            cached_blocks: self.cached,
            ..self.stats
        }
    }
}
