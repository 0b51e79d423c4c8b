//! The experiment binaries' command lines: clap, every error one line, and
//! the flags they share ([`Common`]).

use std::path::PathBuf;

use clap::Parser;

/// The flags every experiment binary of the engine takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// The model (GGUF file or Hugging Face directory).
    #[arg(long, default_value = kvforge_engine::DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Where the outputs go (each binary has its own folder under `target/`).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The chitchat conversations a chat experiment replays.
#[derive(clap::Args, Debug)]
pub struct Chats {
    /// The chitchat dataset.
    #[arg(long = "data", default_value = CHITCHAT)]
    pub data: PathBuf,
}

/// Where `cargo xtask setup` puts chitchat's conversations.
pub const CHITCHAT: &str = "data/chitchat/dataset.json";

impl Common {
    /// The output folder: `--out`, else `default`.
    pub fn out_or(&self, default: &str) -> PathBuf {
        self.out.clone().unwrap_or_else(|| PathBuf::from(default))
    }
}

/// The command line as `A`: `--help` prints and exits 0; a bad flag or value
/// is one line (clap spreads one problem over several).
pub fn parse<A: Parser>() -> anyhow::Result<A> {
    match A::try_parse() {
        Ok(a) => Ok(a),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            std::process::exit(0);
        }
        Err(e) => Err(anyhow::anyhow!(one_line(&e.to_string()))),
    }
}

/// clap's message without its usage and tips, on one line.
pub fn one_line(msg: &str) -> String {
    let words: Vec<&str> = msg
        .lines()
        .take_while(|l| !l.starts_with("Usage:"))
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("tip:") && !l.starts_with("For more information")
        })
        .collect();
    let line = words.join(" ");
    line.strip_prefix("error: ").unwrap_or(&line).to_string()
}

/// A count of at least 1 (a `value_parser`).
pub fn positive(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
