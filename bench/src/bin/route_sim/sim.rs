//! The replay's instances and routers: simulated instances (an LRU of
//! block keys each, and the shared remote tier's LRU), real ones
//! (`real.rs`), and the routers' choices.

use std::collections::{HashMap, VecDeque};

use anyhow::Result;
use kvforge_prefix::BlockHash;

use crate::real;

/// The instances' sizes.
pub(crate) struct Shape {
    pub(crate) instances: usize,
    /// Blocks each instance caches.
    pub(crate) capacity: usize,
    /// Blocks the shared remote tier holds.
    pub(crate) remote_capacity: usize,
    pub(crate) block_size: usize,
}

/// Blocks by key, least recently used first out.
pub(crate) struct Lru {
    cap: usize,
    tick: u64,
    at: HashMap<BlockHash, u64>,
    order: VecDeque<(u64, BlockHash)>,
}

impl Lru {
    fn new(cap: usize) -> Lru {
        Lru {
            cap,
            tick: 0,
            at: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// How many of `keys[from..]`, from the first on, it holds (touched).
    fn lead(&mut self, keys: &[BlockHash], from: usize) -> usize {
        let n = keys[from..]
            .iter()
            .take_while(|k| self.at.contains_key(k))
            .count();
        self.put(&keys[from..from + n]);
        n
    }

    fn peek(&self, keys: &[BlockHash]) -> usize {
        keys.iter().take_while(|k| self.at.contains_key(k)).count()
    }

    fn put(&mut self, keys: &[BlockHash]) {
        for &k in keys {
            self.tick += 1;
            self.at.insert(k, self.tick);
            self.order.push_back((self.tick, k));
        }
        while self.at.len() > self.cap {
            let Some((t, k)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&k) == Some(&t) {
                self.at.remove(&k);
            }
        }
        // Stale queue entries (touched since) are dropped lazily; bound them.
        if self.order.len() > 4 * self.cap.max(1) {
            let at = &self.at;
            self.order.retain(|(t, k)| at.get(k) == Some(t));
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Router {
    RoundRobin,
    Sticky,
    Prefix,
    /// The prefix router fed by KV events (real caches only).
    Events,
}

impl Router {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Router::RoundRobin => "round-robin",
            Router::Sticky => "sticky",
            Router::Prefix => "prefix-aware",
            Router::Events => "kv-events",
        }
    }
}

/// One request of the replay: its conversation, its full blocks' keys,
/// its prompt's token ids.
pub(crate) type Request = (usize, Vec<BlockHash>, Vec<u32>);

/// The load-capped prefix router's choice: the most leading blocks
/// (`held[i]` for instance `i`) among the instances whose share of the
/// `recent` requests is at most 1.25× the mean (else the one holding the
/// shared system prompt takes everything); ties to the least loaded.
fn pick(recent: &VecDeque<usize>, held: &[usize], fallback: usize) -> usize {
    let cap = 1.25 * recent.len() as f64 / held.len() as f64;
    let load = |i: usize| recent.iter().filter(|&&r| r == i).count();
    (0..held.len())
        .filter(|&i| load(i) as f64 <= cap.max(1.0))
        .max_by_key(|&i| (held[i], std::cmp::Reverse(load(i))))
        .unwrap_or(fallback)
}

/// Tokens: prompt, hit locally, hit remotely; requests per instance.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) prompt: u64,
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) per_instance: Vec<u64>,
}

/// Replays `requests` over simulated instances (LRUs of keys).
pub(crate) fn simulate(a: &Shape, requests: &[Request], router: Router, remote: bool) -> Tally {
    let mut inst: Vec<Lru> = (0..a.instances).map(|_| Lru::new(a.capacity)).collect();
    let mut tier = Lru::new(a.remote_capacity);
    let mut t = Tally {
        per_instance: vec![0; a.instances],
        ..Tally::default()
    };
    let mut recent: VecDeque<usize> = VecDeque::new();
    for (n, (conv, keys, ids)) in requests.iter().enumerate() {
        let i = match router {
            Router::RoundRobin => n % a.instances,
            Router::Sticky => conv % a.instances,
            Router::Prefix | Router::Events => {
                let held: Vec<usize> = inst.iter().map(|l| l.peek(keys)).collect();
                pick(&recent, &held, n % a.instances)
            }
        };
        remember(&mut recent, i, a.instances);
        t.per_instance[i] += 1;
        // The last token is always computed: a full prompt of whole blocks
        // reuses one block less.
        let usable = (ids.len() - 1) / a.block_size;
        let keys = &keys[..usable.min(keys.len())];
        let local = inst[i].lead(keys, 0);
        let far = if remote { tier.lead(keys, local) } else { 0 };
        t.prompt += ids.len() as u64;
        t.local += (local * a.block_size) as u64;
        t.remote += (far * a.block_size) as u64;
        inst[i].put(keys);
        if remote {
            tier.put(keys);
        }
    }
    t
}

/// The last `4 × instances` choices, for the load cap.
fn remember(recent: &mut VecDeque<usize>, i: usize, instances: usize) {
    recent.push_back(i);
    if recent.len() > 4 * instances {
        recent.pop_front();
    }
}

/// Replays `requests` over real prefix caches; with `Router::Events` the
/// router reads only the instances' events. Returns the tally and the
/// requests for which the events' view and an index disagreed.
pub(crate) fn simulate_real(
    a: &Shape,
    requests: &[Request],
    router: Router,
) -> Result<(Tally, u64)> {
    let bs = a.block_size;
    let mut inst = (0..a.instances)
        .map(|_| real::Instance::new(a.capacity, bs))
        .collect::<Result<Vec<_>>>()?;
    let mut views: Vec<real::View> = (0..a.instances).map(|_| real::View::default()).collect();
    let mut t = Tally {
        per_instance: vec![0; a.instances],
        ..Tally::default()
    };
    let mut recent: VecDeque<usize> = VecDeque::new();
    let mut disagreed = 0;
    for (n, (conv, _, ids)) in requests.iter().enumerate() {
        let usable = (ids.len() - 1) / bs;
        let toks = &ids[..usable * bs];
        let indexed: Vec<usize> = inst.iter_mut().map(|c| c.peek(toks)).collect();
        let told: Vec<usize> = views.iter().map(|v| v.lead(toks, bs)).collect();
        disagreed += u64::from(indexed != told);
        let i = match router {
            Router::RoundRobin => n % a.instances,
            Router::Sticky => conv % a.instances,
            Router::Prefix => pick(&recent, &indexed, n % a.instances),
            Router::Events => pick(&recent, &told, n % a.instances),
        };
        remember(&mut recent, i, a.instances);
        t.per_instance[i] += 1;
        let hit = inst[i].serve(toks)?;
        t.prompt += ids.len() as u64;
        t.local += (hit * bs) as u64;
        for (c, v) in inst.iter().zip(&mut views) {
            v.apply(c.drain());
        }
    }
    let held: usize = views.iter().map(real::View::len).sum();
    anyhow::ensure!(
        held <= a.instances * a.capacity,
        "the events told of {held} blocks, more than the caches hold"
    );
    Ok((t, disagreed))
}
