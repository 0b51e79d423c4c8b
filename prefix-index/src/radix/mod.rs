//! [`RadixIndex`]: an SGLang-style radix tree at block granularity.
//!
//! Each edge holds a run of blocks and their tokens; a node's children are
//! keyed by the exact tokens of their first block. Branching happens only at
//! block boundaries, so a match is always a whole number of blocks.

mod matcher;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use crate::check::check_block_size;
use crate::error::Result;
use crate::slots::{SlotMap, Slotted};
use crate::walk::SealedLens;
use crate::{BlockRef, ExtraKeys, Inserted, MatchStats, PrefixMatcher};
use kvforge_pool::BlockId;

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
    /// Lengths of sealed (short) first blocks among the children.
    sealed: SealedLens,
    /// For a root: its namespace (to remove it once it has no children).
    namespace: Option<Box<ExtraKeys>>,
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
    /// Block slot index -> (handle, node whose edge holds it).
    slots: SlotMap<NodeId>,
    cached: u64,
    stats: MatchStats,
}

/// One node of the depth-first match: reached at `pos` tokens, `depth`
/// blocks deep, trying its candidate `next`.
struct Frame {
    node: NodeId,
    pos: usize,
    depth: usize,
    next: usize,
}

impl RadixIndex {
    /// An empty tree.
    pub fn new(block_size: usize) -> Result<Self> {
        check_block_size(block_size)?;
        Ok(RadixIndex {
            block_size,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::default(),
            slots: HashMap::default(),
            cached: 0,
            stats: MatchStats::default(),
        })
    }

    /// Nodes in use (roots included): bounded by the indexed blocks plus the
    /// namespaces that have any.
    pub fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
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

    fn free_node(&mut self, id: NodeId) {
        *self.node_mut(id) = Node::default();
        self.free_nodes.push(id);
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Tokens on the path from the root to the start of `id`'s edge.
    fn edge_start(&self, id: NodeId) -> usize {
        let mut n = self.node(id).parent;
        let mut at = 0;
        while n != NO_PARENT {
            at += self.node(n).tokens.len();
            n = self.node(n).parent;
        }
        at
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn set_slot(&mut self, b: BlockRef, node: NodeId) {
        self.slots.insert(b.block.index(), (b.block, node));
    }

    fn clear_slot(&mut self, b: BlockRef) {
        if matches!(self.slots.get(&b.block.index()), Some(&(id, _)) if id == b.block) {
            self.slots.remove(&b.block.index());
        }
        self.cached -= 1;
        self.stats.forgotten_blocks += 1;
    }

    /// Adds `child` (whose first block has `len` tokens) under `parent`.
    fn attach(&mut self, parent: NodeId, key: Box<[u32]>, child: NodeId) {
        let (bs, len) = (self.block_size, key.len());
        let p = self.node_mut(parent);
        p.children.insert(key, child);
        if len < bs {
            p.sealed.add(len as u32);
        }
    }

    /// Removes the child keyed `key` from `parent`; a root left without
    /// children is removed too.
    fn detach(&mut self, parent: NodeId, key: &[u32]) {
        let bs = self.block_size;
        let p = self.node_mut(parent);
        if p.children.remove(key).is_some() && key.len() < bs {
            p.sealed.remove(key.len() as u32);
        }
        if p.parent == NO_PARENT && p.children.is_empty() {
            if let Some(ns) = p.namespace.take() {
                self.roots.remove(&*ns);
            }
            self.free_node(parent);
        }
    }

    /// Frees every node below `id` (not `id` itself) and their slots.
    fn drop_subtree(&mut self, id: NodeId) {
        let mut stack: Vec<NodeId> = self.node_mut(id).children.drain().map(|(_, c)| c).collect();
        self.node_mut(id).sealed = SealedLens::default();
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
        let mid = self.alloc_node(Node {
            parent,
            blocks: head_blocks,
            tokens: head_tokens,
            ..Node::default()
        });
        self.attach(mid, tail_key, child);
        self.node_mut(child).parent = mid;
        // Same first block, same key and length: the parent's sealed counts hold.
        if let Some(slot) = self.node_mut(parent).children.get_mut(&key) {
            *slot = mid;
        }
        for b in self.node(mid).blocks.clone() {
            self.set_slot(b, mid);
        }
        mid
    }

    /// The insertion walk from `node` (whose edge ends where `blocks[i]`
    /// starts, at token `p`): follows matching edges, splits where they
    /// part, adds a leaf with the rest.
    fn insert_below(
        &mut self,
        mut node: NodeId,
        mut i: usize,
        mut p: usize,
        tokens: &[u32],
        blocks: &[BlockRef],
        out: &mut Inserted,
    ) {
        while i < blocks.len() {
            let len = blocks[i].len as usize;
            let child = self.node(node).children.get(&tokens[p..p + len]).copied();
            let Some(c) = child else {
                // A new leaf with the remaining blocks, up to the first one
                // whose handle is indexed elsewhere (or newer in the index).
                let rest = &blocks[i..];
                let keep = rest
                    .iter()
                    .position(|b| self.slots.contains_key(&b.block.index()))
                    .unwrap_or(rest.len());
                out.already_indexed += usize::from(keep < rest.len());
                if keep == 0 {
                    break;
                }
                let rest = &rest[..keep];
                let end = p + rest.iter().map(|b| b.len as usize).sum::<usize>();
                self.stats.insert_tokens += (end - p) as u64;
                let leaf = self.alloc_node(Node {
                    parent: node,
                    blocks: rest.to_vec(),
                    tokens: tokens[p..end].to_vec(),
                    ..Node::default()
                });
                self.attach(node, tokens[p..p + len].into(), leaf);
                for &b in rest {
                    self.set_slot(b, leaf);
                }
                out.new += rest.len();
                self.cached += rest.len() as u64;
                break;
            };
            // Follow the edge while blocks agree (length and tokens).
            let (mut j, mut off, mut examined) = (0, 0, 0);
            {
                let cn = self.node(c);
                while j < cn.blocks.len() && i < blocks.len() {
                    let l = blocks[i].len as usize;
                    examined += l as u64;
                    if cn.blocks[j].len as usize != l || tokens[p..p + l] != cn.tokens[off..off + l]
                    {
                        break;
                    }
                    (i, j, p, off) = (i + 1, j + 1, p + l, off + l);
                    out.already_cached += 1;
                }
            }
            self.stats.insert_tokens += examined;
            if j == self.node(c).blocks.len() {
                node = c;
            } else if i < blocks.len() {
                node = self.split(c, j, off);
            } else {
                break;
            }
        }
    }
}

impl Slotted for RadixIndex {
    type Place = NodeId;
    fn slot_map(&mut self) -> &mut SlotMap<NodeId> {
        &mut self.slots
    }
    fn repoint(&mut self, node: NodeId, old: BlockId, new: BlockId) {
        if let Some(b) = self
            .node_mut(node)
            .blocks
            .iter_mut()
            .find(|b| b.block == old)
        {
            b.block = new;
        }
    }
}

impl std::fmt::Debug for RadixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixIndex")
            .field("block_size", &self.block_size)
            .field("live_nodes", &self.live_nodes())
            .field("stats", &self.stats())
            .finish()
    }
}
