//! Fuzz target: the `[LIFECYCLE]` label parser. The first byte picks the
//! number of segments (0–15), the rest is the model's text (lossy UTF-8).
//! Any input must parse without a panic, with one label per segment and no
//! opening tag left in the text.
//!
//! `cargo xtask fuzz` (see the engine README, "Fuzzing").
#![no_main]

use kvforge_lifecycle::parse_labels;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let segments = usize::from(n % 16);
    let p = parse_labels(&String::from_utf8_lossy(rest), segments);
    assert_eq!(p.labels.len(), segments);
    assert!(!p.text.to_ascii_lowercase().contains("[lifecycle]"));
});
