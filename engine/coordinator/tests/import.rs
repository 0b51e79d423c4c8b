//! `Coordinator::import`: blocks whose KV the engine brings from a remote
//! tier — appended full to a just-opened sequence, under the byte budget,
//! indexed like computed blocks, released on close; refused (changing
//! nothing) mid-step or after a partial block.

use kvforge_coordinator::{
    COLD, ColdConfig, CoordError, Coordinator, CoordinatorConfig, HOT, PrefixConfig, TurnTail,
};
use kvforge_pool::{KvLayout, StorageFormat};
use kvforge_prefix::ExtraKeys;

use crate::{Fits, checked};

const BS: u32 = 4;

fn config(blocks: usize) -> CoordinatorConfig {
    let mut c = CoordinatorConfig::new(
        KvLayout::new(2, 2, 8, BS, StorageFormat::F16).unwrap(),
        blocks,
    );
    c.prefix = Some(PrefixConfig {
        seed: Some(3),
        tail: TurnTail::Seal,
        ..PrefixConfig::default()
    });
    c
}

#[test]
fn imported_blocks_are_the_sequences_own_and_indexed_at_register() {
    let mut c = checked(config(16));
    let prompt: Vec<u32> = (0..21).collect();
    let e = ExtraKeys::default();
    let o = c.open(&prompt, &e).unwrap();
    assert_eq!(o.reused, 0);
    let got = c.import(o.seq, HOT, 0, 5).unwrap();
    assert_eq!(got.len(), 5);
    assert_eq!(c.table(o.seq).unwrap().positions(), 20);
    assert!(!c.table(o.seq).unwrap().is_open());
    // The rest of the prompt is computed after them.
    c.plan(o.seq, 1).fits();
    c.commit(o.seq).unwrap();
    c.register(o.seq, &prompt, &e).unwrap();
    c.close(o.seq).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
    // Another request finds them in the index.
    let o2 = c.open(&prompt, &e).unwrap();
    assert_eq!(o2.reused, 20);
    c.close(o2.seq).unwrap();
}

#[test]
fn an_import_is_cut_to_the_budget_and_the_free_blocks() {
    let mut cfg = config(16);
    cfg.budget_bytes = 3 * cfg.layout.block_bytes();
    let mut c = checked(cfg);
    let s = c
        .open(&(0..40).collect::<Vec<_>>(), &ExtraKeys::default())
        .unwrap()
        .seq;
    assert_eq!(c.import_room(s, HOT), 3, "what an import would take");
    assert_eq!(c.import(s, HOT, 0, 8).unwrap().len(), 3);
    assert_eq!(c.import_room(s, HOT), 0);
    assert_eq!(c.import(s, HOT, 12, 8).unwrap().len(), 0, "nothing left");
    c.close(s).unwrap();
    let mut c = checked(config(4));
    let s = c.open_empty();
    assert_eq!(c.import(s, HOT, 0, 9).unwrap().len(), 4);
    c.close(s).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
}

#[test]
fn an_import_at_another_position_than_the_tables_end_is_refused_and_changes_nothing() {
    let mut c = checked(config(16));
    let prompt: Vec<u32> = (0..21).collect();
    let o = c.open(&prompt, &ExtraKeys::default()).unwrap();
    assert_eq!(c.import(o.seq, HOT, 0, 2).unwrap().len(), 2);
    let before = c.table(o.seq).unwrap().clone();
    let used = c.bytes_in_use();
    // The caller believes its next block starts at 12 (it lost count of
    // one): refused, since its KV would sit at positions 8..12.
    for at in [0, 4, 12, 9] {
        assert!(
            matches!(c.import(o.seq, HOT, at, 1), Err(CoordError::Order { .. })),
            "at {at}"
        );
    }
    assert_eq!(c.table(o.seq).unwrap().entries(), before.entries());
    assert_eq!(c.bytes_in_use(), used);
    assert_eq!(c.import(o.seq, HOT, 8, 1).unwrap().len(), 1);
    c.close(o.seq).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
}

#[test]
fn cold_blocks_can_be_imported_when_there_is_a_cold_tier() {
    let mut cfg = config(8);
    let int4 = StorageFormat::Int4 { group_size: 8 };
    cfg.cold = Some(ColdConfig {
        format: int4,
        value_format: int4,
        window: 4,
        sink: 0,
    });
    let mut c = checked(cfg);
    let s = c.open_empty();
    let got = c.import(s, COLD, 0, 3).unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(c.tier_stats()[COLD].pool.in_use, 3);
    c.close(s).unwrap();
    assert_eq!(c.bytes_in_use(), 0);
    assert_eq!(c.take_freed_cold().len(), 3, "their storage can go");
    let mut c = checked(config(8));
    let s = c.open_empty();
    assert!(c.import(s, COLD, 0, 1).is_err(), "no cold tier");
}

#[test]
fn an_import_mid_step_or_after_a_partial_block_is_refused_and_changes_nothing() {
    let mut c = checked(config(16));
    let s = c.open_empty();
    c.plan(s, 6).fits();
    assert_eq!(c.import_room(s, HOT), 0, "mid-step: no room");
    assert!(matches!(
        c.import(s, HOT, 0, 1),
        Err(CoordError::Order { .. })
    ));
    c.commit(s).unwrap();
    let before = c.table(s).unwrap().clone();
    let used = c.bytes_in_use();
    assert!(matches!(
        c.import(s, HOT, 6, 1),
        Err(CoordError::Order { .. })
    ));
    c.seal(s).unwrap();
    assert!(
        matches!(c.import(s, HOT, 6, 1), Err(CoordError::Order { .. })),
        "sealed at 6 tokens"
    );
    assert_eq!(c.table(s).unwrap().entries(), before.entries());
    assert_eq!(c.bytes_in_use(), used);
    c.close(s).unwrap();
    let _ = Coordinator::new(config(1)).unwrap();
}
