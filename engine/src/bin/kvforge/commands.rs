//! The commands: generate (one prompt, or several as a batch), chat,
//! bench, ppl.

use std::io::{BufRead, Write};

use kvforge_engine::{
    CacheManager, Engine, EngineError, Generation, KvQuant, PplReport, SamplingParams, Sequence,
};

use super::MAX_TEXT_BYTES;
use super::args::{Common, Reuse};

fn report(engine: &Engine, g: &Generation) {
    let (hot, cold) = engine.cache().tier_bytes();
    let blocks = engine
        .cache()
        .tier_stats()
        .first()
        .map_or(0, |t| t.pool.in_use);
    eprintln!(
        "[{} prompt tokens, prefill {:.1} tok/s | {} new tokens, decode {:.1} tok/s | KV {} hot bytes in {} blocks + {} cold bytes]",
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        g.tokens.len(),
        g.decode_tokens_per_sec(),
        hot,
        blocks,
        cold,
    );
}

/// Writes one line of output; `false` once stdout is closed (e.g. `| head`),
/// so the caller stops instead of panicking the way `println!` would.
fn emit(line: impl std::fmt::Display) -> bool {
    stream(&format!("{line}\n"))
}

fn stream(piece: &str) -> bool {
    let mut out = std::io::stdout().lock();
    // A closed stdout (e.g. `| head`) just ends the generation; any other
    // failure (a full disk) ends it too, and is the command's error.
    match out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => true,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                let _ = STDOUT_ERROR.set(e.to_string());
            }
            false
        }
    }
}

/// The first error writing stdout, other than a closed pipe.
static STDOUT_ERROR: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Why the output was lost, if it was (not for a closed pipe: `| head`
/// asked for less).
pub(crate) fn stdout_error() -> Option<&'static str> {
    STDOUT_ERROR.get().map(String::as_str)
}

pub(crate) fn generate(prompts: &[String], raw: bool, common: &Common) -> Result<(), EngineError> {
    let engine = common.engine()?;
    let encode = |p: &String| {
        if raw {
            engine.tokenizer().encode(p)
        } else {
            common.user_ids(engine.tokenizer(), p)
        }
    };
    if prompts.len() > 1 {
        return generate_batch(&engine, prompts, &encode, common);
    }
    let ids = encode(&prompts[0])?;
    let mut seq = Sequence::default();
    let g = engine.generate(&mut seq, &ids, &common.params(), &mut |_, piece| {
        stream(piece)
    })?;
    emit("");
    report(&engine, &g);
    engine.cache().free(&mut seq)
}

/// Several prompts decoded as one batch: each reply printed as `[i] text`
/// when the batch ends, then one report line per sequence.
fn generate_batch(
    engine: &Engine,
    prompts: &[String],
    encode: &dyn Fn(&String) -> Result<Vec<u32>, EngineError>,
    common: &Common,
) -> Result<(), EngineError> {
    let ids = prompts.iter().map(encode).collect::<Result<Vec<_>, _>>()?;
    let base = common.params();
    let params: Vec<SamplingParams> = (0..ids.len())
        .map(|i| SamplingParams {
            seed: base.seed.wrapping_add(i as u64),
            ..base.clone()
        })
        .collect();
    let mut seqs: Vec<Sequence> = ids.iter().map(|_| Sequence::default()).collect();
    let mut texts = vec![String::new(); ids.len()];
    let result = engine.generate_batch(&mut seqs, &ids, &params, &mut |i, _, piece| {
        texts[i].push_str(piece);
        true
    });
    if let Ok(gens) = &result {
        for (i, t) in texts.iter().enumerate() {
            if !emit(format!("[{i}] {}", t.trim_end())) {
                break;
            }
        }
        for g in gens {
            report(engine, g);
        }
    }
    let freed = seqs.iter_mut().try_for_each(|s| engine.cache().free(s));
    result?;
    freed
}

pub(crate) fn chat(common: &Common, reuse: &Reuse) -> Result<(), EngineError> {
    // A mechanisms file's prefix table replaces --index and --turn-tail.
    let mut rc = reuse.config()?;
    if let Some(p) = common.mechanisms()?.and_then(|m| m.prefix) {
        rc.index = p.index.into();
        rc.tail = p.tail.into();
        rc.seed = p.seed;
    }
    let manager = CacheManager::new(common.engine()?, rc)?;
    let params = common.params();
    let session = manager.open_session(&reuse.namespace);
    reuse.write_metrics(&manager)?;
    let stdin = std::io::stdin();
    let mut first = true;
    let mut closed = true; // whether the last reply ended with <|im_end|>
    eprintln!("kvforge chat — empty line or Ctrl-D to quit");
    loop {
        eprint!("> ");
        let mut raw = Vec::new();
        let n = stdin
            .lock()
            .read_until(b'\n', &mut raw)
            .map_err(|e| EngineError::Request(format!("reading stdin: {e}")))?;
        if n == 0 {
            break;
        }
        // A bad turn is reported and skipped; the session goes on unchanged.
        let Ok(line) = std::str::from_utf8(&raw) else {
            eprintln!("error: that line is not valid UTF-8; the session is unchanged");
            continue;
        };
        let msg = line.trim_end_matches(['\n', '\r']);
        if msg.is_empty() {
            break;
        }
        // The previous reply's last token (usually <|im_end|>) is already
        // pending in the session; close the reply if it was cut off.
        let ids = manager.with_engine(|e| {
            if first {
                common.user_ids(e.tokenizer(), msg)
            } else if common.allow_special {
                let end = if closed { "" } else { "<|im_end|>" };
                e.tokenizer().encode(&format!(
                    "{end}\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
                ))
            } else {
                e.tokenizer().user_turn_ids(!closed, msg)
            }
        });
        let mut printed = false;
        let turn = ids.and_then(|ids| {
            manager.turn(session, &ids, &params, &mut |_, piece| {
                printed = true;
                stream(piece)
            })
        });
        let r = match turn {
            Ok(r) => r,
            // A turn that fails mid-reply has streamed part of it (F15):
            // end that line and say the session does not hold it.
            Err(e) if printed => {
                emit("");
                eprintln!(
                    "error: {e}; the partial reply above is discarded, the session is unchanged"
                );
                continue;
            }
            Err(e) => {
                eprintln!("error: {e}; the session is unchanged");
                continue;
            }
        };
        first = false;
        emit("");
        manager.with_engine(|e| report(e, &r.generation));
        eprintln!(
            "[reused {} of {} prompt tokens]",
            r.reused_tokens, r.prompt_tokens
        );
        if reuse.metrics {
            eprintln!("{}", manager.metrics());
        }
        reuse.write_metrics(&manager)?;
        closed = r.generation.stopped_at_eos;
        if STDOUT_ERROR.get().is_some() {
            // The replies can no longer be written: stop, do not generate
            // the rest of stdin into the void.
            break;
        }
    }
    manager.close_session(session)
}

/// Reads a text file: a regular file of at most [`MAX_TEXT_BYTES`], UTF-8.
fn read_text(path: &std::path::Path) -> Result<String, EngineError> {
    kvforge_engine::input::read_text(path, MAX_TEXT_BYTES).map_err(EngineError::Request)
}

/// The first `n` tokens of `body`; `what` and `flag` name them in the error
/// when there are fewer.
fn first_tokens(
    engine: &Engine,
    body: &str,
    n: usize,
    what: &str,
    flag: &str,
) -> Result<Vec<u32>, EngineError> {
    let mut ids = engine.tokenizer().encode(body)?;
    if ids.len() < n {
        return Err(EngineError::Request(format!(
            "{what} holds {} tokens, fewer than {flag} {n}",
            ids.len()
        )));
    }
    ids.truncate(n);
    Ok(ids)
}

pub(crate) fn bench(
    text: &std::path::Path,
    context: usize,
    common: &Common,
) -> Result<(), EngineError> {
    common.check()?;
    let body = read_text(text)?;
    let engine = common.engine()?;
    let what = text.display().to_string();
    let ids = first_tokens(&engine, &body, context, &what, "--context")?;
    // Warm-up, as the transformers side does.
    let mut seq = Sequence::default();
    let _ = engine.model().forward(
        &ids[..16.min(context)],
        &mut engine.cache().view(&mut seq),
        false,
    )?;
    engine.cache().free(&mut seq)?;
    let params = SamplingParams {
        ignore_eos: true,
        ..common.params()
    };
    let g = engine.generate(&mut seq, &ids, &params, &mut |_, _| true)?;
    emit(format!(
        "{{\"engine\":\"kvforge\",\"dtype\":\"{}\",\"weights\":\"{}\",\"kv\":\"{}\",\"context\":{},\"prefill_tok_s\":{:.3},\"decode_tok_s\":{:.3},\"threads\":{},\"kv_bytes\":{},\"cold_bytes\":{},\"kv_quant\":\"{}\"}}",
        common.dtype,
        common.weights_label(&engine),
        common.kv_dtype,
        g.prompt_tokens,
        g.prompt_tokens as f64 / g.prefill_secs.max(1e-9),
        g.decode_tokens_per_sec(),
        tch::get_num_threads(),
        engine.cache().bytes_in_use(),
        engine.cache().tier_bytes().1,
        engine
            .cache()
            .cold_tier()
            .map_or_else(|| "none".into(), |q| q.name()),
    ));
    engine.cache().free(&mut seq)
}

pub(crate) fn ppl(
    text: &std::path::Path,
    tokens: usize,
    window: usize,
    stream: (usize, usize, usize),
    common: &Common,
) -> Result<(), EngineError> {
    let (prefix, chunk, decode) = stream;
    // Every argument is checked before the text is read or the model loaded.
    common.check()?;
    if window < 2 || window > tokens {
        return Err(EngineError::Request(format!(
            "window perplexity needs 2 <= --window <= --tokens (window {window}, tokens {tokens})"
        )));
    }
    if prefix == 0 || chunk == 0 || prefix >= tokens {
        return Err(EngineError::Request(format!(
            "streaming perplexity needs 0 < --prefix < --tokens and --chunk > 0 (prefix {prefix}, chunk {chunk}, tokens {tokens})"
        )));
    }
    let body = read_text(text)?;
    let mut engine = common.engine()?;
    // Checked before any perplexity runs, not after minutes of it.
    let ctx = engine.model_config().max_ctx;
    if tokens.saturating_add(decode) > ctx {
        return Err(EngineError::Request(format!(
            "--tokens {tokens} plus --decode {decode} exceed the model's context of {ctx} tokens"
        )));
    }
    let article = kvforge_engine::ppl::longest_article(&body);
    let what = format!("the longest article of {}", text.display());
    let ids = first_tokens(&engine, &article, tokens, &what, "--tokens")?;
    let tier = engine.cache().cold_tier();
    let weights = common.weights_label(&engine).to_string();
    let line = |mode: &str, quant: Option<KvQuant>, r: &PplReport| {
        serde_json::json!({
            "mode": mode, "tokens": tokens, "window": window, "prefix": prefix, "chunk": chunk,
            "dtype": common.dtype, "weights": weights,
            "kv": common.kv_dtype,
            "kv_quant": quant.map_or_else(|| "none".to_string(), |q| q.name()),
            "scored": r.scored, "ppl": r.ppl, "kv_bytes": r.kv_bytes,
            "hot_bytes": r.hot_bytes, "cold_bytes": r.cold_bytes,
            "kv_bytes_per_token": r.kv_bytes_per_token, "tokens_per_sec": r.tokens_per_sec,
            "decode_steps": r.decode_steps, "decode_tok_s": r.decode_tokens_per_sec,
        })
    };
    // Window perplexity runs each window in one step: the cold tier never
    // engages, so it is reported once, for the unquantized cache.
    engine.cache_mut().set_cold_tier(None)?;
    if !emit(line("window", None, &engine.window_ppl(&ids, window)?)) {
        return Ok(());
    }
    let base = engine.streaming_ppl(&ids, prefix, chunk, decode)?;
    if !emit(line("stream", None, &base)) {
        return Ok(());
    }
    if let Some(q) = tier {
        engine.cache_mut().set_cold_tier(Some(q))?;
        let r = engine.streaming_ppl(&ids, prefix, chunk, decode)?;
        let mut out = line("stream", Some(q), &r);
        out["ppl_change"] = (r.ppl / base.ppl - 1.0).into();
        out["kv_cut"] = (1.0 - r.kv_bytes as f64 / base.kv_bytes.max(1) as f64).into();
        if decode > 0 {
            out["decode_ratio"] =
                (r.decode_tokens_per_sec / base.decode_tokens_per_sec.max(1e-9)).into();
        }
        emit(out);
    }
    Ok(())
}
