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
//! (most requests on one instance over the mean).
//!
//! Then the same replay over real prefix caches (`real.rs`: per instance a
//! `BlockPool` of `--capacity` blocks and a prefix index watched for KV
//! events), remote tier off, with a fourth router, `kv-events`: the
//! load-capped prefix router knowing the instances only from the
//! `BlockStored` / `BlockRemoved` events they publish, as a router
//! subscribed to `kvforge serve --kv-events` does. It should reach the hit
//! rate of the `prefix` router that reads the indexes themselves; the
//! report counts the requests where the two views disagreed. Markdown
//! report and CSV in `--out` (default `target/route-sim`).

#![allow(clippy::print_stdout)] // a report printer

mod real;
mod sim;

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use kvforge_bench::cli::{self, Chats, Common};
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{Message, Tokenizer};
use kvforge_prefix::{ExtraKeys, Xxh3Hasher, block_key, root_key};
use sim::{Request, Router, Shape, Tally, simulate, simulate_real};

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

    fn shape(&self) -> Shape {
        Shape {
            instances: self.instances,
            capacity: self.capacity,
            remote_capacity: self.remote_capacity,
            block_size: self.block_size,
        }
    }
}

fn parse_args() -> Result<Args> {
    cli::parse()
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("route-sim", run)
}

/// Every request of the replay in arrival order: `active` conversations
/// at a time, one message pair each in turn.
fn requests(a: &Args, tok: &Tokenizer) -> Result<Vec<Request>> {
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
                out.push((w * a.active + c, keys, ids));
            }
        }
    }
    Ok(out)
}

/// One row of the report and the CSV.
struct Row<'a> {
    router: Router,
    remote: bool,
    caches: &'a str,
    t: Tally,
    /// Requests whose events' view disagreed with an index (real caches).
    disagreed: Option<u64>,
}

impl Row<'_> {
    fn write(&self, md: &mut String, csv: &mut Csv, base: u64, instances: usize) -> Result<()> {
        let t = &self.t;
        let recomputed = t.prompt - t.local - t.remote;
        let mean = t.per_instance.iter().sum::<u64>() as f64 / instances as f64;
        let imbalance = *t.per_instance.iter().max().unwrap_or(&0) as f64 / mean.max(1.0);
        let pct = |x: u64| 100.0 * x as f64 / t.prompt.max(1) as f64;
        let disagreed = self.disagreed.map_or("–".into(), |d| d.to_string());
        writeln!(
            md,
            "| {} | {} | {} | {:.1}% | {:.1}% | {recomputed} | {:.3}× | {imbalance:.2} | {disagreed} |",
            self.router.name(),
            self.caches,
            if self.remote { "on" } else { "off" },
            pct(t.local),
            pct(t.remote),
            recomputed as f64 / base.max(1) as f64
        )?;
        csv.row([
            self.router.name().to_string(),
            self.caches.to_string(),
            self.remote.to_string(),
            t.prompt.to_string(),
            t.local.to_string(),
            t.remote.to_string(),
            recomputed.to_string(),
            format!("{imbalance:.3}"),
            disagreed,
        ]);
        Ok(())
    }
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&a.common.model)?)?;
    let reqs = requests(&a, &tok)?;
    let shape = a.shape();
    let mut out = Output::create(a.out())?;
    let mut csv = Csv::new(&[
        "router",
        "caches",
        "remote",
        "prompt_tokens",
        "local_hit",
        "remote_hit",
        "recomputed",
        "imbalance",
        "disagreed",
    ]);
    let mut md = String::new();
    writeln!(
        md,
        "# {} instances behind a router: chitchat replay\n",
        a.instances
    )?;
    writeln!(
        md,
        "{} conversations × {} messages, {} active at a time, {} requests; {} blocks of {} tokens per instance, remote tier {} blocks. `simulated`: each instance an LRU of block keys; `real`: a `BlockPool` and a prefix index watched for KV events (remote tier off). `kv-events` knows the real caches only from their events; `disagreed`: requests for which what the events told differed from an index.\n",
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
        "| router | caches | remote tier | local hit | remote hit | recomputed tokens | vs round-robin alone | imbalance | disagreed |\n|---|---|---|---:|---:|---:|---:|---:|---:|"
    )?;
    let base = simulate(&shape, &reqs, Router::RoundRobin, false);
    let base = base.prompt - base.local - base.remote;
    for router in [Router::RoundRobin, Router::Sticky, Router::Prefix] {
        for remote in [false, true] {
            let t = simulate(&shape, &reqs, router, remote);
            let row = Row {
                router,
                remote,
                caches: "simulated",
                t,
                disagreed: None,
            };
            row.write(&mut md, &mut csv, base, a.instances)?;
        }
    }
    for router in [
        Router::RoundRobin,
        Router::Sticky,
        Router::Prefix,
        Router::Events,
    ] {
        let (t, d) = simulate_real(&shape, &reqs, router)?;
        let row = Row {
            router,
            remote: false,
            caches: "real",
            t,
            disagreed: Some(d),
        };
        row.write(&mut md, &mut csv, base, a.instances)?;
    }
    out.csv("route.csv", &csv)?;
    let path = out.report(&md)?;
    println!("{md}\nwritten: {}", path.display());
    Ok(())
}
