//! The [`Deduplicator`] conformance suite.

use std::collections::BTreeMap;

use kvforge_pool::BlockId;

use crate::{Content, Deduplicator};

/// Content number `c` of the suite: five distinct vectors (and their
/// bytes), the same every time it is asked for.
fn content(c: u8, vectors: bool) -> Content {
    let vector = if vectors {
        (0..64u32)
            .map(|i| {
                // Orthogonal-ish patterns: one sign flip pattern per c.
                let h = (i.wrapping_mul(2_654_435_761) >> (c * 3 + 1)) & 1;
                if h == 1 { 1.0 } else { -1.0 }
            })
            .collect()
    } else {
        Vec::new()
    };
    Content {
        bytes: vec![c; 64],
        vector,
    }
}

/// Offers blocks with repeated and distinct contents, answers fetches from
/// what it stored (a forgotten or never stored block is gone), forgets
/// some, and checks every answer against the contract: an offered, live,
/// other block whose content was fetched and
/// [`matches`](Deduplicator::matches). Panics on the first violation of
/// the [`Deduplicator`] contract.
pub fn check_deduplicator<D: Deduplicator + ?Sized>(d: &mut D) {
    let vectors = d.wants_vectors();
    let mut stored: BTreeMap<BlockId, Content> = BTreeMap::new();
    let mut forgotten = Vec::new();
    for i in 0..40u32 {
        let block = BlockId::new(i, 1);
        let c = content(((i * 7) % 5) as u8, vectors);
        let mut fetched = Vec::new();
        let got = d
            .offer(block, &c, &mut |x| {
                fetched.push(x);
                stored.get(&x).cloned()
            })
            .unwrap_or_else(|e| panic!("offer {i}: {e}"));
        if let Some(x) = got {
            assert_ne!(x, block, "a block is not its own canonical");
            assert!(!forgotten.contains(&x), "{x:?} was forgotten");
            let s = stored
                .get(&x)
                .unwrap_or_else(|| panic!("{x:?} is not a candidate (never kept, or an alias)"));
            assert!(fetched.contains(&x), "{x:?} returned unverified");
            assert!(d.matches(&c, s), "{x:?} does not match");
        } else {
            stored.insert(block, c.clone());
        }
        if i % 6 == 5 {
            // Forget the oldest stored candidate.
            if let Some((&old, _)) = stored.iter().next() {
                stored.remove(&old);
                d.forget(old);
                forgotten.push(old);
            }
        }
    }
    let s = d.stats();
    assert_eq!(s.offered, 40);
    assert!(s.shared > 0, "identical contents were never shared");
    assert_eq!(s.canonical, stored.len() as u64, "candidates counted");
    // Identical content always matches; the suite's distinct ones do not.
    assert!(d.matches(&content(0, vectors), &content(0, vectors)));
    assert!(!d.matches(&content(0, vectors), &content(1, vectors)));
    // Content that is gone when fetched: nothing is shared.
    let before = d.stats().shared;
    let again = d
        .offer(BlockId::new(500, 1), &content(0, vectors), &mut |_| None)
        .unwrap_or_else(|e| panic!("offer: {e}"));
    assert_eq!(again, None);
    assert_eq!(d.stats().shared, before);
}
