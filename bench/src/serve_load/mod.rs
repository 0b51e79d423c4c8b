//! `cargo xtask serve-load`: kvforge-serve under real clients replaying
//! chitchat conversations, and llama.cpp's llama-server under the same
//! load (`bin/serve_load.rs` holds the command line).
//!
//! * [`servers`]: the servers as child processes on loopback ports;
//! * [`replay`]: clients that resend the whole history every turn;
//! * [`run`]: one measured run; [`sweep`]: the concurrency sweep; [`soak`]:
//!   clients leaving mid-stream; [`compare`]: the half-budget run and one stream against
//!   `kvforge bench`.

use std::path::PathBuf;

use anyhow::Result;

pub mod compare;
pub mod replay;
pub mod run;
pub mod servers;
pub mod soak;
pub mod sweep;

use replay::Load;
use servers::{KvforgeSpec, Spawned};

/// What every experiment shares.
#[derive(Clone, Debug)]
pub struct Common {
    /// The GGUF file both servers load.
    pub model: PathBuf,
    /// chitchat's `dataset.json`.
    pub data: PathBuf,
    /// The `kvforge-serve` binary.
    pub serve_bin: PathBuf,
    /// User turns per conversation.
    pub turns: usize,
    /// Tokens per reply at most.
    pub max_tokens: usize,
    /// Replies of exactly `max_tokens` (`ignore_eos`).
    pub ignore_eos: bool,
    /// A mechanisms file for kvforge-serve.
    pub config: Option<PathBuf>,
    /// More kvforge-serve flags (`--serve-args "--weights f16"`).
    pub extra: Vec<String>,
}

impl Common {
    /// `n` conversations of at least `turns` messages, cut to `turns`.
    pub fn chats(&self, n: usize) -> Result<Vec<Vec<String>>> {
        kvforge_ablate::inputs::load_chats(&self.data, self.turns, n, self.turns..=usize::MAX)
    }

    /// Where a server's log goes: `target/serve-load/logs/NAME` (not
    /// beside the report).
    pub fn log(&self, name: &str) -> PathBuf {
        let dir = PathBuf::from("target/serve-load/logs");
        let _ = std::fs::create_dir_all(&dir);
        dir.join(name)
    }

    /// kvforge-serve with `extra` flags (and `--config`, if given).
    pub fn kvforge(&self, extra: &[String]) -> KvforgeSpec {
        let mut args = extra.to_vec();
        args.extend(self.extra.iter().cloned());
        if let Some(c) = &self.config {
            args.push("--config".into());
            args.push(c.display().to_string());
        }
        KvforgeSpec {
            bin: self.serve_bin.clone(),
            model: self.model.clone(),
            args,
        }
    }
}

/// One short request, so that a run does not time the first one's
/// allocations.
pub fn warm_up(s: &Spawned) {
    let load = Load {
        max_tokens: 4,
        ignore_eos: true,
        disconnect_after: None,
    };
    let msg = [serde_json::json!({"role": "user", "content": "Hello!"})];
    let _ = replay::turn(&s.addr, &s.model_id, &msg, &load);
}

/// A progress line on stderr.
pub fn progress(msg: &str) {
    eprintln!("serve-load: {msg}");
}
