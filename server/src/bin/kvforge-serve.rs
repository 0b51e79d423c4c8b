//! `kvforge-serve` (also `kvforge serve`): the OpenAI-compatible server.
//!
//! ```text
//! kvforge serve --port 8000 --config configs/serve.toml
//! ```
//!
//! Binds a loopback address unless told otherwise, prints one line with
//! the address it listens on, and stops on SIGTERM or Ctrl-C: new requests
//! get 503, running ones finish within `--grace-secs`, then it exits 0; a
//! second signal exits at once (status 130). Every bad flag or file is one
//! line on stderr and a non-zero exit.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvforge_engine::mechanisms::RemoteSpec;
use kvforge_engine::{
    Attention, Engine, EngineConfig, Mechanisms, Registry, ReuseConfig, parse_device, parse_dtype,
};
use kvforge_server::sched::ProbeConfig;
use kvforge_server::{SchedConfig, Server, ServerConfig};

use kvforge_engine::DEFAULT_MODEL;

#[derive(Parser)]
#[command(
    name = "kvforge-serve",
    version,
    about = "An OpenAI-compatible server with continuous batching over kvforge's KV cache"
)]
struct Args {
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free one; the line printed at start names it).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// GGUF file or Hugging Face directory.
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// The model id clients name (default: the file's stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Weight storage dtype (default: --dtype).
    #[arg(long)]
    weights: Option<String>,
    /// KV cache storage dtype.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Hot KV capacity in tokens, shared by all requests (0: the model's
    /// context). The mechanisms file's budget_mib caps the bytes of all
    /// tiers on top.
    #[arg(long, default_value_t = 0)]
    kv_tokens: usize,
    /// A mechanisms file (the TOML of `kvforge --config` and the
    /// ablation's `[[config]]`): cold tier, eviction, sharing, budget;
    /// its `prefix` table sets reuse (absent: reuse off, as everywhere).
    /// Without --config: prefix reuse on, nothing else.
    #[arg(long)]
    config: Option<PathBuf>,
    /// CPU threads for libtorch (0: its default).
    #[arg(long, default_value_t = 0)]
    threads: i32,
    /// Requests in the running batch at most.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Tokens one engine step computes at most (decodes first, then
    /// prompt chunks).
    #[arg(long, default_value_t = 256)]
    max_step_tokens: usize,
    /// Requests waiting at most; more get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// An accepted API key (repeat for several; each key is a tenant
    /// with a prefix-cache namespace of its own, whatever its place in the
    /// list; surrounding spaces are trimmed). Also KVFORGE_API_KEY
    /// (comma-separated).
    #[arg(long, env = "KVFORGE_API_KEY", value_delimiter = ',')]
    api_key: Vec<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 512)]
    default_max_tokens: usize,
    /// Seconds a shutdown lets running requests finish.
    #[arg(long, default_value_t = 30)]
    grace_secs: u64,
    /// Seconds a client may take to send a request's headers (or to idle
    /// between requests on a kept-alive connection).
    #[arg(long, default_value_t = 10)]
    header_timeout_secs: u64,
    /// Seconds a client may take to send a request's body.
    #[arg(long, default_value_t = 30)]
    body_timeout_secs: u64,
    /// Publish KV events (blocks stored in and removed from the prefix
    /// cache, vLLM's fields) to routers on GET /v1/kv_events, per tenant.
    #[arg(long)]
    kv_events: bool,
    /// Batches of KV events each tenant's buffer keeps for subscribers
    /// that fall behind.
    #[arg(long, default_value_t = kvforge_server::events::DEFAULT_BUFFER)]
    kv_events_buffer: usize,
    /// A held-out text whose slice the quality probe streams through the
    /// live cache every --probe-every seconds; the dashboard plots its
    /// perplexity against the slice's full-cache value.
    #[arg(long)]
    probe: Option<PathBuf>,
    /// Tokens of the probe's slice (the text's first).
    #[arg(long, default_value_t = 256)]
    probe_tokens: usize,
    /// Seconds between two probes.
    #[arg(long, default_value_t = 30)]
    probe_every: u64,
}

/// The quality probe `--probe` asks for: its text's first tokens.
fn probe(a: &Args, engine: &Engine) -> Result<Option<ProbeConfig>, String> {
    let Some(path) = &a.probe else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--probe {}: {e}", path.display()))?;
    let mut tokens = engine
        .tokenizer()
        .encode_text(&text)
        .map_err(|e| format!("--probe {}: {e}", path.display()))?;
    tokens.truncate(a.probe_tokens);
    let p = ProbeConfig {
        tokens,
        every: Duration::from_secs(a.probe_every),
    };
    p.check()?;
    Ok(Some(p))
}

/// The engine, its reuse, and the remote tier the mechanisms file names.
type Loaded = (Engine, ReuseConfig, Option<RemoteSpec>);

fn engine(a: &Args) -> Result<Loaded, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.threads < 0 || a.threads as usize > cores {
        return Err(format!(
            "--threads {} must be between 0 (libtorch's default) and this machine's {cores} cores",
            a.threads
        ));
    }
    if a.block_size == 0 || a.block_size > 4096 {
        return Err(format!("--block-size {} must be in 1..=4096", a.block_size));
    }
    kvforge_engine::set_cpu_threads(a.threads);
    let e = |e: kvforge_engine::EngineError| e.to_string();
    let mut cfg = EngineConfig {
        device: parse_device(&a.device).map_err(e)?,
        kind: parse_dtype(&a.dtype).map_err(e)?,
        weight_kind: a
            .weights
            .as_deref()
            .map(parse_dtype)
            .transpose()
            .map_err(e)?,
        kv_kind: Some(parse_dtype(&a.kv_dtype).map_err(e)?),
        block_size: a.block_size,
        kv_tokens: a.kv_tokens,
        attention: Attention::Fused,
        ..EngineConfig::default()
    };
    let (reuse, remote) = match &a.config {
        Some(path) => {
            let registry = Registry::builtin();
            let mut m = Mechanisms::load(path, a.block_size, &registry)?;
            let remote = m.remote.take();
            (m.apply(&mut cfg, &registry, None)?, remote)
        }
        None => (ReuseConfig::default(), None),
    };
    if !a.model.exists() {
        return Err(format!(
            "{} not found; run `cargo xtask setup` (or pass --model PATH)",
            a.model.display()
        ));
    }
    Ok((Engine::load(&a.model, &cfg).map_err(e)?, reuse, remote))
}

fn run(a: Args) -> Result<(), String> {
    let (engine, reuse, remote) = engine(&a)?;
    let remote = match remote {
        Some(spec) => {
            let r = kvforge_server::remote::connect(&spec, &engine)?;
            let blocks = if r.cold { "cold" } else { "hot" };
            eprintln!(
                "kvforge-serve: remote tier {} ({blocks} blocks, seed {}, model {:032x})",
                spec.url, r.seed, r.model
            );
            Some(r)
        }
        None => None,
    };
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        a.model
            .file_stem()
            .map_or_else(|| "kvforge".into(), |s| s.to_string_lossy().into_owned())
    });
    let cfg = ServerConfig {
        sched: SchedConfig {
            max_batch: a.max_batch,
            max_step_tokens: a.max_step_tokens,
            max_waiting: a.max_waiting,
            probe: probe(&a, &engine)?,
        },
        reuse,
        api_keys: a.api_key.clone(),
        model_id: model_id.clone(),
        max_body_bytes: a.max_body_bytes,
        default_max_tokens: a.default_max_tokens,
        grace: Duration::from_secs(a.grace_secs),
        header_timeout: Duration::from_secs(a.header_timeout_secs),
        body_timeout: Duration::from_secs(a.body_timeout_secs),
        fault: None,
        check_invariants: false,
        remote,
        kv_events: a.kv_events.then_some(a.kv_events_buffer),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let local = listener.local_addr().map_err(|e| e.to_string())?;
        let server = Server::start(engine, cfg)?;
        eprintln!("kvforge-serve: listening on http://{local} (model {model_id:?})");
        server
            .serve(listener, stop_signal())
            .await
            .map_err(|e| format!("serving: {e}"))
    })?;
    eprintln!("kvforge-serve: stopped");
    Ok(())
}

/// The next signal `s` catches (never, without one).
async fn next(s: &mut Option<tokio::signal::unix::Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// SIGTERM or Ctrl-C. A second one, while stopping, exits at once.
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("kvforge-serve: stopping (new requests get 503; running ones may finish)");
        return;
    };
    let mut int = signal(SignalKind::interrupt()).ok();
    tokio::select! {
        _ = term.recv() => {}
        () = next(&mut int) => {}
    }
    eprintln!(
        "kvforge-serve: stopping (new requests get 503; running ones may finish; a second signal exits now)"
    );
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            () = next(&mut int) => {}
        }
        eprintln!("kvforge-serve: second signal: exiting now");
        std::process::exit(130);
    });
}

fn main() -> ExitCode {
    if let Ok(level) = std::env::var("KVFORGE_LOG")
        && let Ok(level) = level.parse::<tracing::Level>()
    {
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let msg = e.to_string();
            let line: Vec<&str> = msg
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
                .collect();
            eprintln!("{} (see kvforge-serve --help)", line.join(" "));
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
