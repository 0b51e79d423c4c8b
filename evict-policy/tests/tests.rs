//! `kvforge-evict`: the conformance suite on every policy, and what
//! StreamingLLM's sink plus window keeps.
#![allow(clippy::unwrap_used)]

use kvforge_evict::{EvictionPolicy, Pressure, SinkWindow, testing};
use kvforge_pool::{BlockId, BlockTable, Slot};

#[test]
fn sink_window_passes_the_conformance_suite() {
    for (bs, sink, window) in [(4, 4, 8), (4, 0, 1), (1, 2, 3), (16, 32, 64), (4, 6, 5)] {
        testing::check_policy(&mut SinkWindow::new(sink, window).unwrap(), bs);
    }
}

#[test]
fn sink_window_keeps_the_sink_and_the_window_in_whole_entries() {
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..10 {
        t.push(Slot::Hot(BlockId::new(i, 1)), 4, false).unwrap();
    }
    t.push(Slot::Hot(BlockId::new(10, 1)), 2, true).unwrap();
    // 42 positions: sink 4 keeps entry 0; window 10 keeps positions 32..42,
    // i.e. entries 8 (32..36), 9 and 10; entry 7 (28..32) ends at 32: dropped.
    let mut p = SinkWindow::new(4, 10).unwrap();
    let mut out = Vec::new();
    let pressure = Pressure {
        used: 0.0,
        new_tokens: 1,
    };
    p.victims(0, &t, pressure, &mut out);
    assert_eq!(out, (1..=7).collect::<Vec<_>>());
    assert_eq!(p.name(), "sink4-window10");
    // A sink that is not block aligned keeps the entry it touches.
    let mut out = Vec::new();
    SinkWindow::new(5, 10)
        .unwrap()
        .victims(0, &t, pressure, &mut out);
    assert_eq!(out, (2..=7).collect::<Vec<_>>());
}

#[test]
fn a_window_of_nothing_is_refused() {
    let e = SinkWindow::new(4, 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "eviction policy: the recent window must keep at least one token"
    );
}
