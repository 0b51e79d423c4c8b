//! The loop step by step: a request whose client has gone gives its
//! blocks back in the next step, whether it runs or waits.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{
    Device, Engine, EngineConfig, Kind, Llama, LlamaConfig, ReuseConfig, SamplingParams, Tokenizer,
};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::{Event, Job, Msg, SchedConfig, Scheduler, Shared};

fn scheduler(max_batch: usize) -> Scheduler {
    scheduler_with(max_batch, false)
}

/// With `remote`, a remote tier on an in-memory store.
fn scheduler_with(max_batch: usize, remote: bool) -> Scheduler {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let g = GgufFile::open(&root.join(kvforge_engine::DEFAULT_MODEL))
        .expect("the model: run `cargo xtask setup`");
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let mc = LlamaConfig {
        vocab: tok.vocab,
        max_ctx: 1024,
        ..LlamaConfig::tiny()
    };
    let model = Llama::random(mc, 3, Device::Cpu, Kind::Float).unwrap();
    let mut engine = Engine::new(model, tok, &EngineConfig::default()).unwrap();
    ReuseConfig::default().apply(engine.cache_mut()).unwrap();
    if remote {
        let model = engine.fingerprint().unwrap();
        engine
            .cache_mut()
            .set_remote(Some(kvforge_engine::cache::RemoteSetup {
                store: Arc::new(kvforge_remote::MemoryTier::new()),
                secret: kvforge_remote::Secret::new(b"the scheduler tests' secret").unwrap(),
                seed: 1,
                model,
                cold: false,
                options: kvforge_remote::RemoteOptions::default(),
            }))
            .unwrap();
    }
    engine.cache().check_every_call(true);
    let cfg = SchedConfig {
        max_batch,
        ..SchedConfig::default()
    };
    Scheduler::new(Arc::new(engine), cfg, Arc::new(Shared::default()), None)
}

fn submit(s: &mut Scheduler, prompt_len: usize) -> UnboundedReceiver<Event> {
    submit_for(s, prompt_len, 500)
}

fn submit_for(s: &mut Scheduler, prompt_len: usize, max_tokens: usize) -> UnboundedReceiver<Event> {
    submit_choices(s, prompt_len, max_tokens, 1)
}

fn submit_choices(
    s: &mut Scheduler,
    prompt_len: usize,
    max_tokens: usize,
    n: usize,
) -> UnboundedReceiver<Event> {
    let (tx, rx) = unbounded_channel();
    s.shared
        .queued
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    s.take(Msg::Submit(Job {
        prompt: (1..=prompt_len as u32).collect(),
        params: SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        namespace: "t".into(),
        user: None,
        events: tx,
        arrived: Instant::now(),
        logprobs: None,
        echo: false,
        n,
        index: 0,
    }));
    rx
}

fn hot_in_use(s: &Scheduler) -> usize {
    s.engine.cache().tier_stats()[0].pool.in_use
}

#[test]
fn a_gone_client_frees_its_blocks_in_the_next_step() {
    let mut s = scheduler(1);
    let mut running = submit(&mut s, 40);
    let waiting = submit(&mut s, 8);
    for _ in 0..3 {
        s.tick();
    }
    assert!(matches!(running.try_recv(), Ok(Event::Token(_))));
    assert_eq!(s.running.len(), 1);
    assert_eq!(s.waiting.len(), 1);
    assert!(hot_in_use(&s) > 0);
    // The waiting one's client goes: gone from the queue at the next step.
    drop(waiting);
    s.tick();
    assert!(s.waiting.is_empty());
    assert_eq!(s.shared.queued.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The running one's: its sequence is freed at the next step, its KV
    // left in the prefix cache (free, cached).
    drop(running);
    s.tick();
    assert!(s.running.is_empty());
    assert_eq!(hot_in_use(&s), 0);
    assert!(s.engine.cache().tier_stats()[0].pool.cached_free > 0);
    assert_eq!(super::lock(&s.shared.metrics).aborted, 2);
}

/// With a remote tier, lookups start while requests wait, at most
/// `max_batch` in flight or answered and waiting (what they fetched is
/// held outside the KV budget); the others wait their turn, and every
/// request runs to its end.
#[test]
fn lookups_of_waiting_requests_are_capped_and_every_request_ends() {
    let mut s = scheduler_with(2, true);
    let mut rx: Vec<_> = (0..6).map(|k| submit_for(&mut s, 40 + 7 * k, 3)).collect();
    let held = s.waiting.iter().filter(|r| r.lookup.held()).count();
    let pending = s
        .waiting
        .iter()
        .filter(|r| matches!(r.lookup, super::Lookup::Pending))
        .count();
    assert_eq!((held, pending), (2, 4));
    let mut done = vec![false; rx.len()];
    for _ in 0..5000 {
        if done.iter().all(|&d| d) {
            break;
        }
        s.take_fetched();
        s.tick();
        let held = s.waiting.iter().filter(|r| r.lookup.held()).count();
        assert!(held <= 2, "{held} lookups held");
        for (d, r) in done.iter_mut().zip(&mut rx) {
            while let Ok(e) = r.try_recv() {
                match e {
                    Event::Done(_) => *d = true,
                    Event::Failed(e) => panic!("{e:?}"),
                    Event::Echo(_) | Event::Token(_) => {}
                }
            }
        }
        if s.only_lookups() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert!(done.iter().all(|&d| d), "{done:?}");
    assert_eq!(hot_in_use(&s), 0);
}

/// `n` choices beyond `max_batch`: the ones that do not fit the batch
/// wait (their first token sampled from the prompt's logits) and run when
/// a slot frees; the batch never passes `max_batch` and every choice ends.
#[test]
fn choices_beyond_the_batch_wait_their_turn() {
    let mut s = scheduler(2);
    let mut rx = submit_choices(&mut s, 40, 6, 5);
    let (mut done, mut tokens) = (vec![false; 5], vec![0usize; 5]);
    for _ in 0..500 {
        s.tick();
        assert!(s.running.len() <= 2, "{} running", s.running.len());
        while let Ok(e) = rx.try_recv() {
            match e {
                Event::Done(o) => {
                    assert_eq!(o.completion_tokens, 6);
                    done[o.index] = true;
                }
                Event::Token(t) => tokens[t.index] += 1,
                Event::Failed(e) => panic!("{e:?}"),
                Event::Echo(_) => {}
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    assert!(done.iter().all(|&d| d), "{done:?}");
    assert!(tokens.iter().all(|&t| t > 0), "{tokens:?}");
    assert_eq!(hot_in_use(&s), 0);
    assert_eq!(s.shared.queued.load(std::sync::atomic::Ordering::SeqCst), 0);
}
