//! What the dashboard shows of the running requests: each one's block
//! table as a strip of entries, read while a dashboard watches.

use kvforge_pool::Slot;

use super::Scheduler;

/// One running request's block table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Strip {
    /// The request's order of admission.
    pub request: u64,
    /// Tokens its sequence holds.
    pub tokens: usize,
    /// One letter per entry: `h` hot, `c` cold, `a` an alias of another
    /// block's content, `d` dropped, `p` a packed (head-wise) hot block.
    pub entries: String,
}

/// The letter of one entry.
fn letter(e: &kvforge_pool::Entry) -> char {
    match e.slot() {
        Slot::Hot(_) if e.is_packed() => 'p',
        Slot::Hot(_) => 'h',
        Slot::Cold(_) => 'c',
        Slot::Alias { .. } => 'a',
        Slot::Dropped => 'd',
    }
}

impl Scheduler {
    /// The running requests' strips, under one lock of the coordinator.
    pub(super) fn strips(&self) -> Vec<Strip> {
        self.engine.cache().with_coordinator(|c| {
            self.running
                .iter()
                .filter_map(|r| {
                    let t = c.table(r.seq.id()?).ok()?;
                    Some(Strip {
                        request: r.admitted,
                        tokens: r.seq.len(),
                        entries: t.entries().iter().map(letter).collect(),
                    })
                })
                .collect()
        })
    }
}
