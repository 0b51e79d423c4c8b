//! The [`Deduplicator`] conformance suite.

use std::collections::HashMap;

use kvforge_pool::BlockId;

use crate::Deduplicator;

/// Offers blocks with repeated, distinct and colliding-looking contents,
/// verifies with a byte comparison (and once with a verifier that rejects
/// everything), forgets some. Panics on the first violation of the
/// [`Deduplicator`] contract.
pub fn check_deduplicator<D: Deduplicator + ?Sized>(d: &mut D) {
    let mut stored: HashMap<BlockId, Vec<u8>> = HashMap::new();
    let mut forgotten = Vec::new();
    let contents: Vec<Vec<u8>> = (0..5u8).map(|c| vec![c; 64]).collect();
    for i in 0..40u32 {
        let block = BlockId::new(i, 1);
        let content = contents[(i as usize * 7) % 5].clone();
        let mut asked = Vec::new();
        let got = d.offer(block, &content, &mut |c| {
            asked.push(c);
            stored.get(&c).is_some_and(|s| *s == content)
        });
        if let Some(c) = got {
            assert_ne!(c, block, "a block is not its own canonical");
            assert!(stored.contains_key(&c), "{c:?} was never kept");
            assert!(!forgotten.contains(&c), "{c:?} was forgotten");
            assert!(asked.contains(&c), "{c:?} returned unverified");
            assert_eq!(stored[&c], content, "{c:?} holds other content");
        } else {
            stored.insert(block, content.clone());
        }
        if i % 6 == 5 {
            // Forget the oldest stored candidate.
            if let Some(&old) = stored.keys().min() {
                stored.remove(&old);
                d.forget(old);
                forgotten.push(old);
            }
        }
    }
    let s = d.stats();
    assert_eq!(s.offered, 40);
    assert!(s.shared > 0, "identical contents were never shared");
    // A verifier that says no: nothing is shared.
    let before = d.stats().shared;
    let again = d.offer(BlockId::new(500, 1), &contents[0], &mut |_| false);
    assert_eq!(again, None);
    assert_eq!(d.stats().shared, before);
}
