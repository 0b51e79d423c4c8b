//! Unit tests of BlockTable's tiling, holes and packing.

use super::*;

fn b(i: u32) -> BlockId {
    BlockId::new(i, 1)
}

#[test]
fn positions_survive_drops_and_compaction() {
    let mut t = BlockTable::new(4).unwrap();
    for i in 0..4 {
        t.push(Slot::Hot(b(i)), 4, false).unwrap();
    }
    t.push(Slot::Hot(b(9)), 2, true).unwrap();
    assert_eq!(t.positions(), 18);
    assert_eq!(t.set_slot(1, Slot::Dropped).unwrap(), Slot::Hot(b(1)));
    assert_eq!(t.set_slot(2, Slot::Dropped).unwrap(), Slot::Hot(b(2)));
    assert_eq!(t.compact(), 1);
    t.check().unwrap();
    assert_eq!(t.positions(), 18);
    assert_eq!(t.live_tokens(), 10);
    assert_eq!(t.entries()[1].first(), 4);
    assert_eq!(t.entries()[1].tokens(), 8);
    assert_eq!(t.entries()[2].first(), 12);
    t.fill(2).unwrap();
    assert!(!t.is_open());
    assert_eq!(t.held().collect::<Vec<_>>(), vec![b(0), b(3), b(9)]);
}

#[test]
fn a_sealed_partial_tail_reopens_in_a_block_of_its_own() {
    let mut t = BlockTable::new(4).unwrap();
    t.push(Slot::Hot(b(0)), 4, false).unwrap();
    assert!(t.reopen_tail(b(5)).is_err(), "full");
    t.push(Slot::Hot(b(1)), 3, false).unwrap();
    assert_eq!(t.reopen_tail(b(5)).unwrap(), Slot::Hot(b(1)));
    assert!(t.is_open());
    assert!(t.reopen_tail(b(6)).is_err(), "already open");
    t.fill(1).unwrap();
    assert_eq!(t.held().collect::<Vec<_>>(), vec![b(0), b(5)]);
    t.check().unwrap();
}

#[test]
fn packing_keeps_positions_and_only_takes_full_closed_hot_entries() {
    let mut t = BlockTable::new(4).unwrap();
    t.push(Slot::Hot(b(0)), 4, false).unwrap();
    t.push(Slot::Cold(b(1)), 4, false).unwrap();
    t.push(Slot::Hot(b(2)), 4, false).unwrap();
    t.push(Slot::Hot(b(3)), 2, true).unwrap();
    let before = t.clone();
    assert!(t.repack(1, b(9)).is_err(), "cold");
    assert!(t.repack(3, b(9)).is_err(), "open, partial");
    assert!(t.repack(4, b(9)).is_err(), "absent");
    assert_eq!(t, before);
    assert_eq!(t.repack(0, b(8)).unwrap(), Slot::Hot(b(0)));
    assert_eq!(t.repack(2, b(9)).unwrap(), Slot::Hot(b(2)));
    assert!(t.entries()[0].is_packed() && !t.entries()[1].is_packed());
    assert_eq!(t.positions(), 14);
    t.check().unwrap();
    // A packed entry goes cold packed; dropped, it is no longer packed.
    t.set_slot(0, Slot::Cold(b(5))).unwrap();
    assert!(t.entries()[0].is_packed());
    t.set_slot(2, Slot::Dropped).unwrap();
    assert!(!t.entries()[2].is_packed());
    t.check().unwrap();
}

#[test]
fn holes_are_rows_of_full_closed_hot_blocks_and_leave_one_live() {
    let mut t = BlockTable::new(4).unwrap();
    t.push(Slot::Hot(b(0)), 4, false).unwrap();
    t.push(Slot::Cold(b(1)), 4, false).unwrap();
    t.push(Slot::Hot(b(2)), 4, false).unwrap();
    t.push(Slot::Hot(b(3)), 2, true).unwrap();
    let before = t.clone();
    assert!(t.punch(1, 0b1).is_err(), "cold");
    assert!(t.punch(3, 0b1).is_err(), "open, partial");
    assert!(t.punch(0, 0).is_err(), "no rows");
    assert!(t.punch(0, 0b1_0000).is_err(), "row 4 of 4");
    assert!(t.punch(0, 0b1111).is_err(), "every row: drop it instead");
    assert!(t.punch(9, 0b1).is_err(), "absent");
    assert_eq!(t, before);
    t.punch(0, 0b0101).unwrap();
    assert!(t.punch(0, 0b0001).is_err(), "already a hole");
    assert!(t.punch(0, 0b1010).is_err(), "would leave nothing");
    // The same rows through punch_or_drop drop the entry instead; an
    // entry that may not hold holes is refused either way.
    let mut u = t.clone();
    assert!(u.punch_or_drop(1, 0b1111).is_err(), "cold");
    assert!(u.punch_or_drop(0, 0b1011).is_err(), "a hole named again");
    assert_eq!(u, t);
    assert_eq!(u.punch_or_drop(0, 0b1010).unwrap(), Some(Slot::Hot(b(0))));
    assert_eq!(u.entries()[0].slot(), Slot::Dropped);
    assert_eq!(u.punch_or_drop(2, 0b0001).unwrap(), None);
    assert_eq!(u.entries()[2].holes(), 0b0001);
    u.check().unwrap();
    assert_eq!((t.entries()[0].holes(), t.entries()[0].live()), (0b0101, 2));
    assert_eq!(t.live_tokens(), 2 + 4 + 4 + 2);
    assert_eq!(t.positions(), 14, "positions stay");
    t.check().unwrap();
    // A holed entry does not go cold; dropped, its holes go with it.
    assert!(t.set_slot(0, Slot::Cold(b(7))).is_err());
    assert_eq!(t.set_slot(0, Slot::Dropped).unwrap(), Slot::Hot(b(0)));
    assert_eq!((t.entries()[0].holes(), t.entries()[0].live()), (0, 0));
    // Compacted rows: a packed block whose tail holds nothing.
    assert!(t.repack_rows(2, b(8), 0b1111).is_err(), "nothing live");
    assert_eq!(t.repack_rows(2, b(8), 0b1100).unwrap(), Slot::Hot(b(2)));
    assert!(t.entries()[2].is_packed());
    assert_eq!(t.live_tokens(), 4 + 2 + 2);
    t.check().unwrap();
    // Blocks over 64 tokens have no hole bits.
    let mut big = BlockTable::new(128).unwrap();
    big.push(Slot::Hot(b(0)), 128, false).unwrap();
    assert!(big.punch(0, 1).is_err());
}

#[test]
fn illegal_changes_are_refused_and_change_nothing() {
    let mut t = BlockTable::new(4).unwrap();
    t.push(Slot::Hot(b(0)), 4, false).unwrap();
    t.push(Slot::Hot(b(1)), 3, true).unwrap();
    let before = t.clone();
    assert!(t.push(Slot::Hot(b(2)), 0, false).is_err());
    assert!(t.push(Slot::Hot(b(2)), 5, false).is_err());
    assert!(t.push(Slot::Cold(b(2)), 2, true).is_err());
    assert!(t.fill(2).is_err());
    // The open entry and partial blocks cannot go cold; the open one
    // cannot be dropped.
    assert!(t.set_slot(1, Slot::Cold(b(5))).is_err());
    assert!(t.set_slot(1, Slot::Dropped).is_err());
    assert!(t.set_slot(7, Slot::Dropped).is_err());
    assert_eq!(t, before);
    t.set_slot(0, Slot::Dropped).unwrap();
    assert!(t.set_slot(0, Slot::Hot(b(0))).is_err());
    assert!(t.set_slot(0, Slot::Cold(b(0))).is_err());
    t.check().unwrap();
    assert!(BlockTable::new(0).is_err());
}
