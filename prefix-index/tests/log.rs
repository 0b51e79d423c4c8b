//! The per-block debug log of `kvforge-prefix`. In its own test binary:
//! tracing caches per-callsite interest globally, and tests running in
//! parallel threads without a subscriber can make a scoped subscriber miss
//! events (seen as a flaky failure when this test shared a binary).
#![allow(clippy::unwrap_used)]

use kvforge_prefix::{ExtraKeys, HashChainIndex, PrefixMatcher, testing};

/// A `MakeWriter` that collects log output in memory.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

#[test]
fn debug_log_has_one_event_per_block_with_its_hash_and_outcome() {
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(out.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let mut idx = HashChainIndex::with_seed(4, 1).unwrap();
        let e = ExtraKeys::default();
        let t: Vec<u32> = (0..12).collect();
        idx.insert(&t, &e, &testing::full_blocks(0, 2, 4)).unwrap();
        assert_eq!(idx.match_prefix(&t, &e).tokens, 8);
    });
    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("block lookup")).collect();
    assert_eq!(lines.len(), 3, "two hits, then the miss on block 2:\n{log}");
    assert!(
        lines[0].contains("position=0")
            && lines[0].contains("hit=true")
            && lines[0].contains("hash=Some(BlockHash(")
    );
    assert!(lines[2].contains("position=2") && lines[2].contains("hit=false"));
}
