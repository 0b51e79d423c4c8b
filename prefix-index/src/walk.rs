//! Pieces both indexes share: the lengths of sealed children, the candidate
//! block lengths at a node, and the depth-first walk that keeps the longest
//! verified path.

use crate::{BlockRef, PrefixMatch};

/// Lengths of a node's sealed (shorter than a block) children, longest
/// first, each with how many children have it. Updated in O(distinct
/// lengths) when a child comes or goes, never by rescanning the children.
#[derive(Default)]
pub(crate) struct SealedLens(Vec<(u32, u32)>);

impl SealedLens {
    pub(crate) fn add(&mut self, len: u32) {
        match self.0.binary_search_by(|&(l, _)| len.cmp(&l)) {
            Ok(i) => self.0[i].1 += 1,
            Err(i) => self.0.insert(i, (len, 1)),
        }
    }

    pub(crate) fn remove(&mut self, len: u32) {
        if let Ok(i) = self.0.binary_search_by(|&(l, _)| len.cmp(&l)) {
            self.0[i].1 -= 1;
            if self.0[i].1 == 0 {
                self.0.remove(i);
            }
        }
    }

    /// Candidate `k` at a node with `rest` query tokens left: 0 is the full
    /// block (when `rest >= block_size`), then the sealed lengths that fit,
    /// longest first. Returns the length and the next `k` to try.
    #[inline]
    pub(crate) fn candidate(
        &self,
        rest: usize,
        block_size: usize,
        k: usize,
    ) -> Option<(u32, usize)> {
        if k == 0 && rest >= block_size {
            return Some((block_size as u32, 1));
        }
        let start = k.max(1);
        self.0
            .iter()
            .enumerate()
            .skip(start - 1)
            .find(|(_, (l, _))| *l as usize <= rest)
            .map(|(i, &(l, _))| (l, i + 2))
    }
}

/// The path a depth-first match is on, and the longest found so far.
///
/// The common case is one path with no alternatives: then nothing is
/// copied. The best path is copied only when the walk backtracks above it.
#[derive(Default)]
pub(crate) struct Walk {
    trail: Vec<BlockRef>,
    best: Vec<BlockRef>,
    best_tokens: usize,
    best_depth: usize,
    /// `trail[..best_depth]` is the best path (not yet copied to `best`).
    live: bool,
}

impl Walk {
    /// Puts `blocks` at `depth..` of the path (dropping what was below);
    /// `tokens` is the length of the path through the last of them.
    #[inline]
    pub(crate) fn descend(&mut self, depth: usize, blocks: &[BlockRef], tokens: usize) {
        if depth < self.trail.len() {
            self.backtrack(depth);
        }
        self.trail.extend_from_slice(blocks);
        if tokens > self.best_tokens {
            self.best_tokens = tokens;
            self.best_depth = self.trail.len();
            self.live = true;
        }
    }

    /// Cuts the path to `depth`, first saving the best path if it would be
    /// cut.
    #[cold]
    fn backtrack(&mut self, depth: usize) {
        if self.live && depth < self.best_depth {
            self.best = self.trail[..self.best_depth].to_vec();
            self.live = false;
        }
        self.trail.truncate(depth);
    }

    /// Tokens of the best path so far.
    #[cfg(test)]
    pub(crate) fn best_tokens(&self) -> usize {
        self.best_tokens
    }

    pub(crate) fn finish(mut self) -> PrefixMatch {
        let blocks = if self.live {
            self.trail.truncate(self.best_depth);
            self.trail
        } else {
            self.best
        };
        PrefixMatch {
            blocks,
            tokens: self.best_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvforge_pool::BlockId;

    #[test]
    fn sealed_lengths_are_counted_and_ordered() {
        let mut s = SealedLens::default();
        for l in [2, 3, 2, 1] {
            s.add(l);
        }
        let all: Vec<u32> = (0..)
            .scan(0, |k, _| {
                let (l, next) = s.candidate(10, 4, *k)?;
                *k = next;
                Some(l)
            })
            .collect();
        assert_eq!(all, vec![4, 3, 2, 1]);
        s.remove(2);
        assert_eq!(
            s.candidate(2, 4, 0),
            Some((2, 3)),
            "one child of length 2 is left"
        );
        s.remove(2);
        assert_eq!(s.candidate(2, 4, 0), Some((1, 3)));
        assert_eq!(s.candidate(0, 4, 0), None);
    }

    #[test]
    fn the_walk_keeps_the_longest_path_across_backtracking() {
        let b = |i| BlockRef::new(BlockId::new(i, 1), 1);
        let mut w = Walk::default();
        w.descend(0, &[b(0)], 4);
        w.descend(1, &[b(1), b(2)], 10);
        // Back to depth 1 with a shorter alternative: the best survives.
        w.descend(1, &[b(3)], 6);
        assert_eq!(w.best_tokens(), 10);
        let m = w.finish();
        assert_eq!(m.blocks, vec![b(0), b(1), b(2)]);
        assert_eq!(m.tokens, 10);
    }
}
