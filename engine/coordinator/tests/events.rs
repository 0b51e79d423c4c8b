//! `Coordinator::watch_index`: refused without an index or on a full one;
//! once watched, a registered sequence's blocks are reported stored; the
//! blocks a sequence reopens on are counted by tier.

use std::sync::{Arc, Mutex};

use kvforge_coordinator::{CoordinatorConfig, PrefixConfig};
use kvforge_pool::{KvLayout, StorageFormat};
use kvforge_prefix::{EventSink, ExtraKeys, KvEvent};

use crate::{Fits, checked};

struct Collect(Arc<Mutex<Vec<(String, KvEvent)>>>);

impl EventSink for Collect {
    fn publish(&mut self, namespace: &str, events: Vec<KvEvent>) {
        let mut all = self.0.lock().unwrap();
        all.extend(events.into_iter().map(|e| (namespace.to_owned(), e)));
    }
}

fn config(prefix: bool) -> CoordinatorConfig {
    let layout = KvLayout::new(2, 2, 8, 4, StorageFormat::F16).unwrap();
    let mut c = CoordinatorConfig::new(layout, 16);
    c.prefix = prefix.then(PrefixConfig::default);
    c
}

#[test]
fn a_watched_index_reports_what_a_register_stores() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let e = checked(config(false))
        .watch_index(Box::new(Collect(log.clone())), 0)
        .unwrap_err();
    assert!(e.to_string().contains("prefix reuse"), "{e}");
    let mut c = checked(config(true));
    c.watch_index(Box::new(Collect(log.clone())), 0).unwrap();
    let prompt: Vec<u32> = (0..9).collect();
    let ns = ExtraKeys::namespace("t");
    let o = c.open(&prompt, &ns).unwrap();
    c.plan(o.seq, prompt.len()).fits();
    c.commit(o.seq).unwrap();
    c.register(o.seq, &prompt, &ns).unwrap();
    let stored: Vec<Vec<u32>> = log
        .lock()
        .unwrap()
        .iter()
        .map(|(n, e)| match e {
            KvEvent::BlockStored { token_ids, .. } if n == "t" => token_ids.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(stored[..2], [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    // A second watch is refused, and so is a first on an index that
    // holds blocks (their events were never sent).
    let e = c
        .watch_index(Box::new(Collect(log.clone())), 0)
        .unwrap_err();
    assert!(e.to_string().contains("watched already"), "{e}");
    let mut full = checked(config(true));
    let o2 = full.open(&prompt, &ns).unwrap();
    full.plan(o2.seq, prompt.len()).fits();
    full.commit(o2.seq).unwrap();
    full.register(o2.seq, &prompt, &ns).unwrap();
    let e = full
        .watch_index(Box::new(Collect(log.clone())), 0)
        .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    full.close(o2.seq).unwrap();
    c.close(o.seq).unwrap();
    // The same prompt again opens on its two full blocks, both hot.
    let again = c.open(&prompt, &ns).unwrap();
    assert_eq!(again.reused, 8);
    let n = c.counters();
    assert_eq!((n.reused_hot_blocks, n.reused_cold_blocks), (2, 0));
    c.close(again.seq).unwrap();
}
