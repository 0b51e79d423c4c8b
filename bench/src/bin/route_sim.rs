//! Several instances behind a router, simulated on the chitchat replay
//! (`cargo xtask route-sim`): which router, with or without a shared
//! remote tier, recomputes the fewest prompt tokens.
//!
//! `--chats` conversations of `--turns` messages (human chats from
//! `chitchat-dataset`, the two sides as user and assistant) are replayed
//! statelessly — every request resends the whole history, tokenized with
//! SmolLM2's chat template — `--active` conversations at a time,
//! round-robin between them. Each of `--instances` instances keeps the
//! blocks (`--block-size` tokens, chained keys) of the prompts it served
//! in an LRU of `--capacity` blocks; a request reuses the leading blocks
//! its instance holds, then, with the remote tier, the leading blocks
//! after them that the tier holds (an LRU of `--remote-capacity` blocks
//! every instance writes to). No model runs: this counts tokens only.
//!
//! Routers: `round-robin` (request by request), `sticky` (a conversation
//! always on the same instance, by its id), `prefix` (the instance holding
//! the longest prefix of the request, as a KV-event-fed router such as
//! Dynamo's would know it, among the instances whose share of the last
//! `4 × instances` requests is at most 1.25× the mean; ties go to the
//! least loaded). Conversations arrive in a fresh random order each turn. Per router and tier: the share of prompt tokens hit
//! locally and remotely, the tokens recomputed, and the load imbalance
//! (most requests on one instance over the mean). Markdown report and CSV
//! in `--out` (default `target/route-sim`).

#![allow(clippy::print_stdout)] // a report printer

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use kvforge_bench::cli::{self, Chats, Common};
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{Message, Tokenizer};
use kvforge_prefix::{BlockHash, ExtraKeys, Xxh3Hasher, block_key, root_key};

/// Routing chats over instances: the prefix hit rate each router reaches.
#[derive(Parser)]
#[command(name = "route-sim")]
struct Args {
    /// Chats.
    #[arg(long, default_value_t = 200, value_parser = cli::positive)]
    chats: usize,
    /// Turns per chat.
    #[arg(long, default_value_t = 12, value_parser = cli::positive)]
    turns: usize,
    /// Chats active at once.
    #[arg(long, default_value_t = 32, value_parser = cli::positive)]
    active: usize,
    /// Instances.
    #[arg(long, default_value_t = 4, value_parser = cli::positive)]
    instances: usize,
    /// Blocks each instance caches.
    #[arg(long, default_value_t = 2048, value_parser = cli::positive)]
    capacity: usize,
    /// Blocks the shared remote tier holds.
    #[arg(long, default_value_t = 32768, value_parser = cli::positive)]
    remote_capacity: usize,
    #[arg(long, default_value_t = 16, value_parser = cli::positive)]
    block_size: usize,
    #[command(flatten)]
    chats_file: Chats,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/route-sim")
    }
}

fn parse_args() -> Result<Args> {
    cli::parse()
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("route-sim", run)
}

/// Blocks by key, least recently used first out.
struct Lru {
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
enum Router {
    RoundRobin,
    Sticky,
    Prefix,
}

/// Tokens: prompt, hit locally, hit remotely; requests per instance.
#[derive(Default)]
struct Tally {
    prompt: u64,
    local: u64,
    remote: u64,
    per_instance: Vec<u64>,
}

/// Replays `requests` (conversation id, block keys, prompt tokens).
fn simulate(
    a: &Args,
    requests: &[(usize, Vec<BlockHash>, usize)],
    router: Router,
    remote: bool,
) -> Tally {
    let mut inst: Vec<Lru> = (0..a.instances).map(|_| Lru::new(a.capacity)).collect();
    let mut tier = Lru::new(a.remote_capacity);
    let mut t = Tally {
        per_instance: vec![0; a.instances],
        ..Tally::default()
    };
    let mut recent: VecDeque<usize> = VecDeque::new();
    for (n, (conv, keys, len)) in requests.iter().enumerate() {
        let i = match router {
            Router::RoundRobin => n % a.instances,
            Router::Sticky => conv % a.instances,
            Router::Prefix => {
                // The longest prefix among instances not above 1.25× the
                // mean of the recent load (else one instance holding the
                // shared system prompt takes everything).
                let cap = 1.25 * recent.len() as f64 / a.instances as f64;
                let load = |i: usize| recent.iter().filter(|&&r| r == i).count();
                (0..a.instances)
                    .filter(|&i| load(i) as f64 <= cap.max(1.0))
                    .max_by_key(|&i| (inst[i].peek(keys), std::cmp::Reverse(load(i))))
                    .unwrap_or(n % a.instances)
            }
        };
        recent.push_back(i);
        if recent.len() > 4 * a.instances {
            recent.pop_front();
        }
        t.per_instance[i] += 1;
        // The last token is always computed: a full prompt of whole blocks
        // reuses one block less.
        let usable = (len - 1) / a.block_size;
        let keys = &keys[..usable.min(keys.len())];
        let local = inst[i].lead(keys, 0);
        let far = if remote { tier.lead(keys, local) } else { 0 };
        t.prompt += *len as u64;
        t.local += (local * a.block_size) as u64;
        t.remote += (far * a.block_size) as u64;
        inst[i].put(keys);
        if remote {
            tier.put(keys);
        }
    }
    t
}

/// Every request of the replay in arrival order: `active` conversations
/// at a time, one message pair each in turn.
fn requests(a: &Args, tok: &Tokenizer) -> Result<Vec<(usize, Vec<BlockHash>, usize)>> {
    let chats =
        kvforge_bench::load_chats(&a.chats_file.data, a.turns, a.chats, a.turns..=usize::MAX)?;
    let h = Xxh3Hasher::with_seed(1);
    let root = root_key(&h, &ExtraKeys::default());
    let mut scratch = Vec::new();
    let mut out = Vec::new();
    let mut rng = kvforge_bench::SplitMix::new(7);
    for (w, wave) in chats.chunks(a.active).enumerate() {
        for turn in (0..a.turns).step_by(2) {
            // Conversations do not arrive in lock-step: a fresh order each turn.
            let mut order: Vec<usize> = (0..wave.len()).collect();
            for k in (1..order.len()).rev() {
                order.swap(k, (rng.next_u64() % (k as u64 + 1)) as usize);
            }
            for c in order {
                let chat = &wave[c];
                let msgs: Vec<Message> = chat[..=turn]
                    .iter()
                    .enumerate()
                    .map(|(k, m)| {
                        Message::new(if k % 2 == 0 { "user" } else { "assistant" }, m.clone())
                    })
                    .collect();
                let ids = tok.chat_ids(&msgs)?;
                let mut parent = root;
                let keys = ids
                    .chunks_exact(a.block_size)
                    .map(|b| {
                        parent = block_key(&h, parent, b, &mut scratch);
                        parent
                    })
                    .collect();
                out.push((w * a.active + c, keys, ids.len()));
            }
        }
    }
    Ok(out)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&a.common.model)?)?;
    let reqs = requests(&a, &tok)?;
    let mut out = Output::create(a.out())?;
    let mut csv = Csv::new(&[
        "router",
        "remote",
        "prompt_tokens",
        "local_hit",
        "remote_hit",
        "recomputed",
        "imbalance",
    ]);
    let mut md = String::new();
    writeln!(
        md,
        "# {} instances behind a router: chitchat replay\n",
        a.instances
    )?;
    writeln!(
        md,
        "{} conversations × {} messages, {} active at a time, {} requests; {} blocks of {} tokens per instance, remote tier {} blocks.\n",
        a.chats,
        a.turns,
        a.active,
        reqs.len(),
        a.capacity,
        a.block_size,
        a.remote_capacity
    )?;
    writeln!(
        md,
        "| router | remote tier | local hit | remote hit | recomputed tokens | vs round-robin alone | imbalance |\n|---|---|---:|---:|---:|---:|---:|"
    )?;
    let mut base = None;
    for router in [Router::RoundRobin, Router::Sticky, Router::Prefix] {
        for remote in [false, true] {
            let t = simulate(&a, &reqs, router, remote);
            let recomputed = t.prompt - t.local - t.remote;
            let base = *base.get_or_insert(recomputed);
            let mean = t.per_instance.iter().sum::<u64>() as f64 / a.instances as f64;
            let imbalance = *t.per_instance.iter().max().unwrap_or(&0) as f64 / mean.max(1.0);
            let name = match router {
                Router::RoundRobin => "round-robin",
                Router::Sticky => "sticky",
                Router::Prefix => "prefix-aware",
            };
            let pct = |x: u64| 100.0 * x as f64 / t.prompt.max(1) as f64;
            writeln!(
                md,
                "| {name} | {} | {:.1}% | {:.1}% | {recomputed} | {:.3}× | {imbalance:.2} |",
                if remote { "on" } else { "off" },
                pct(t.local),
                pct(t.remote),
                recomputed as f64 / base.max(1) as f64
            )?;
            csv.row([
                name.to_string(),
                remote.to_string(),
                t.prompt.to_string(),
                t.local.to_string(),
                t.remote.to_string(),
                recomputed.to_string(),
                format!("{imbalance:.3}"),
            ]);
        }
    }
    out.csv("route.csv", &csv)?;
    let path = out.report(&md)?;
    println!("{md}\nwritten: {}", path.display());
    Ok(())
}
