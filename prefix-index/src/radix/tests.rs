//! Unit tests of RadixIndex beyond the conformance suite.

use super::*;

#[test]
fn nodes_are_bounded_by_live_entries_across_many_namespaces() {
    let mut idx = RadixIndex::new(4).unwrap();
    let t: Vec<u32> = (0..4).collect();
    for i in 0..100_000u32 {
        // 8 pool slots, each reused with a new epoch by the next tenant.
        let b = BlockId::new(i % 8, i / 8 + 1);
        let e = ExtraKeys::namespace(format!("tenant-{i}"));
        idx.insert(&t, &e, &[BlockRef::new(b, 4)]).unwrap();
    }
    assert_eq!(idx.stats().namespaces, 8);
    assert_eq!(idx.stats().cached_blocks, 8);
    assert_eq!(idx.live_nodes(), 16, "8 roots and 8 leaves");
    assert!(
        idx.nodes.len() <= 18,
        "freed nodes are reused: {}",
        idx.nodes.len()
    );
}
