//! `kvforge`: generate text or chat with a LLaMA-family model through the
//! paged KV cache.
//!
//! ```text
//! kvforge generate --prompt "What is a KV cache?"
//! kvforge chat                      # interactive, multi-turn, streams tokens
//! ```
//!
//! Every error is one line on stderr and a non-zero exit. `KVFORGE_LOG=debug`
//! logs every prefix-cache block lookup (position, key, hit or miss) to
//! stderr.

#![allow(clippy::print_stdout)] // a CLI: stdout is its output

mod args;
mod commands;
mod flags;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use args::{Common, Reuse};
use commands::{bench, chat, generate, ppl};

use kvforge_engine::DEFAULT_MODEL;

/// Largest `--block-size`: a block is one unit of the KV pool, and larger
/// blocks only waste memory (a libtorch allocation error otherwise).
const MAX_BLOCK_SIZE: usize = 4096;

/// Largest text file `ppl` / `bench` read.
const MAX_TEXT_BYTES: u64 = kvforge_engine::input::MAX_TEXT_BYTES;

#[derive(Parser)]
#[command(
    name = "kvforge",
    version,
    about = "LLaMA inference over a paged, pooled KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to a prompt (chat template applied unless --raw);
    /// several `--prompt`s are decoded together as one batch.
    Generate {
        /// The prompt; repeat it to decode several as one batch (prompt
        /// `i` samples with seed + i).
        #[arg(long, required = true)]
        prompt: Vec<String>,
        /// Feed the prompt as is, without the chat template.
        #[arg(long)]
        raw: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Interactive multi-turn chat on stdin; an empty line or EOF ends it.
    /// A session in the prefix cache: each turn prefills only its new tokens.
    Chat {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        reuse: Reuse,
    },
    /// Perplexity of a text file: window (llama.cpp style) and streaming
    /// through the cache. `<doc …>` files (the setup's wiki.utf8) are split
    /// into articles and the longest is used. Prints one JSON line per mode;
    /// with --kv-quant a third line, streaming over the quantized cold tier,
    /// with its change against the unquantized cache.
    Ppl {
        /// Text file (default: the setup's Wikipedia calibration text).
        #[arg(long, default_value = "data/exllamav2/wiki.utf8")]
        text: PathBuf,
        /// Tokens scored in total (the article is cut to this length).
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        /// Window for window perplexity.
        #[arg(long, default_value_t = 512)]
        window: usize,
        /// Streaming: tokens prefilled before scoring starts.
        #[arg(long, default_value_t = 512)]
        prefix: usize,
        /// Streaming: tokens per step after the prefix.
        #[arg(long, default_value_t = 64)]
        chunk: usize,
        /// Streaming: greedy decode steps timed at the final context.
        #[arg(long, default_value_t = 16)]
        decode: usize,
        #[command(flatten)]
        common: Common,
    },
    /// The OpenAI-compatible server with continuous batching: runs the
    /// `kvforge-serve` binary next to this one (crate `kvforge-server`;
    /// `cargo xtask serve` builds and runs it). `kvforge serve --help`
    /// lists its flags.
    #[command(disable_help_flag = true)]
    Serve {
        /// kvforge-serve's flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Prefill the first --context tokens of a text file, then decode
    /// --max-tokens greedy tokens; prints one JSON line of speeds.
    Bench {
        /// Text to take the prompt from.
        #[arg(long)]
        text: PathBuf,
        /// Prompt length in tokens.
        #[arg(long, default_value_t = 1024)]
        context: usize,
        #[command(flatten)]
        common: Common,
    },
}

/// Replaces this process with the `kvforge-serve` binary beside it, so
/// that signals (SIGTERM) reach the server itself.
fn serve(args: &[std::ffi::OsString]) -> Result<(), kvforge_engine::EngineError> {
    use std::os::unix::process::CommandExt;
    let missing = || {
        kvforge_engine::EngineError::Request(
            "kvforge serve runs kvforge-serve, which is not built next to kvforge: \
             cargo build --release -p kvforge-server (or run `cargo xtask serve`)"
                .into(),
        )
    };
    let exe = std::env::current_exe().map_err(|_| missing())?;
    let server = exe.with_file_name("kvforge-serve");
    if !server.is_file() {
        return Err(missing());
    }
    let err = std::process::Command::new(&server).args(args).exec();
    Err(kvforge_engine::EngineError::Request(format!(
        "cannot run {}: {err}",
        server.display()
    )))
}

/// `KVFORGE_LOG=error|warn|info|debug|trace` turns on logging to stderr.
fn init_logging() {
    let Ok(level) = std::env::var("KVFORGE_LOG") else {
        return;
    };
    let level = match level.parse::<tracing::Level>() {
        Ok(l) => l,
        Err(_) => {
            eprintln!(
                "KVFORGE_LOG={level:?} is not a level (error, warn, info, debug, trace); logging off"
            );
            return;
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .try_init();
}
fn main() -> ExitCode {
    init_logging();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help / --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap spreads one problem over several lines; keep it to one.
            let msg = e.to_string();
            let line: Vec<&str> = msg
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
                .collect();
            eprintln!("{} (see kvforge --help)", line.join(" "));
            return ExitCode::from(2);
        }
    };
    let chat_only = match &cli.command {
        Command::Generate { common, .. }
        | Command::Bench { common, .. }
        | Command::Ppl { common, .. } => common.mechanisms.chat_only(),
        _ => None,
    };
    if let Some(flag) = chat_only {
        eprintln!("error: {flag} acts at the end of a chat turn: it is a `kvforge chat` flag");
        return ExitCode::FAILURE;
    }
    let result = match &cli.command {
        Command::Generate {
            prompt,
            raw,
            common,
        } => generate(prompt, *raw, common),
        Command::Chat { common, reuse } => chat(common, reuse),
        Command::Serve { args } => serve(args),
        Command::Bench {
            text,
            context,
            common,
        } => bench(text, *context, common),
        Command::Ppl {
            text,
            tokens,
            window,
            prefix,
            chunk,
            decode,
            common,
        } => ppl(text, *tokens, *window, (*prefix, *chunk, *decode), common),
    };
    match result {
        Ok(()) => match commands::stdout_error() {
            Some(e) => {
                eprintln!("error: writing to stdout: {e}");
                ExitCode::FAILURE
            }
            None => ExitCode::SUCCESS,
        },
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
