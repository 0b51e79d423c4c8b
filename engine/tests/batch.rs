//! Batched decode: one forward step for many sequences (each with its own
//! block table and length) gives what running them one by one gives, and a
//! bad batch commits nothing; the engine's batch step schedules prompt
//! chunks and decodes and keeps one request's failure its own.

use kvforge_engine::batch::{Batch, Failure, Stepped};
use kvforge_engine::logprobs::{TokenLogprob, token_logprob};
use kvforge_engine::ppl::greedy_token;
use kvforge_engine::{
    Axis, Device, Engine, EngineConfig, Kind, KvQuant, KvStore, PagedKvCache, Sequence, Tensor,
};

use super::tiny;

fn cache() -> PagedKvCache {
    let model = tiny();
    let mut c = PagedKvCache::new(&model.cfg, 8, 1024, Device::Cpu, Kind::Float).unwrap();
    c.set_cold_tier(Some(KvQuant {
        bits: 4,
        group_size: 8,
        window: 16,
        rotate: false,
        key_axis: Axis::PerChannel,
        sink: 8,
    }))
    .unwrap();
    c
}

/// Prompts of different lengths, so the batch's positions and tables
/// differ (some blocks cold, some not).
fn prompts() -> Vec<Vec<u32>> {
    [5usize, 40, 17, 64]
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n as u32)
                .map(|i| 3 + (i * 7 + s as u32 * 11) % 90)
                .collect()
        })
        .collect()
}

/// Prefills every prompt, returning the sequences and their last logits.
fn prefill(model: &kvforge_engine::Llama, c: &PagedKvCache) -> (Vec<Sequence>, Vec<Tensor>) {
    let mut seqs = Vec::new();
    let mut last = Vec::new();
    for p in prompts() {
        let mut s = Sequence::default();
        last.push(model.forward(&p, &mut c.view(&mut s), false).unwrap());
        seqs.push(s);
    }
    (seqs, last)
}

#[test]
fn a_batch_decodes_what_the_sequences_decode_one_by_one() {
    let model = tiny();
    // One by one.
    let c1 = cache();
    let (mut seqs, mut last) = prefill(&model, &c1);
    let mut want: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut want_logits = Vec::new();
    for _ in 0..30 {
        for (i, s) in seqs.iter_mut().enumerate() {
            let t = greedy_token(&last[i]).unwrap();
            want[i].push(t);
            last[i] = model.forward(&[t], &mut c1.view(s), false).unwrap();
            want_logits.push(last[i].shallow_clone());
        }
    }
    // As one batch, teacher-forced with the tokens decoded one by one (the
    // batch's matmuls are another computation order): the logits agree
    // within 1e-4, the argmax too wherever the top-2 gap exceeds that.
    let c2 = cache();
    let (mut bseqs, first) = prefill(&model, &c2);
    for (l, w) in first.iter().zip(&want) {
        assert_eq!(greedy_token(l).unwrap(), w[0], "the same prefill");
    }
    let mut got_rows = Vec::new();
    for step in 0..30 {
        let toks: Vec<u32> = want.iter().map(|w| w[step]).collect();
        let mut views: Vec<_> = bseqs.iter_mut().map(|s| c2.view(s)).collect();
        let mut stores: Vec<&mut dyn KvStore> =
            views.iter_mut().map(|v| v as &mut dyn KvStore).collect();
        let logits = model.forward_batch(&toks, &mut stores).unwrap();
        assert_eq!(logits.size(), [4, 97]);
        got_rows.extend(super::forced::rows(&logits));
    }
    let want_rows: Vec<Vec<f32>> = want_logits.iter().flat_map(super::forced::rows).collect();
    let a = super::forced::agree(Some("batch logits"), &got_rows, &want_rows, 1e-4).unwrap();
    assert!(a.decided > 100, "{a:?}");
    // The same tables, up to which block ids the pools handed out (the
    // batch allocates in another order).
    let layout = |c: &PagedKvCache, s: &Sequence| -> Vec<(bool, u64, u32)> {
        let t = c.table(s).unwrap();
        t.entries()
            .iter()
            .map(|e| {
                (
                    matches!(e.slot(), kvforge_pool::Slot::Hot(_)),
                    e.first(),
                    e.tokens(),
                )
            })
            .collect()
    };
    for (a, b) in seqs.iter().zip(&bseqs) {
        assert_eq!(layout(&c1, a), layout(&c2, b), "same tables");
    }
    for s in seqs.iter_mut() {
        c1.free(s).unwrap();
    }
    for s in bseqs.iter_mut() {
        c2.free(s).unwrap();
    }
    assert_eq!(c2.bytes_in_use(), 0);
}

#[test]
fn a_bad_batch_commits_nothing() {
    let model = tiny();
    let c = cache();
    let (mut seqs, _) = prefill(&model, &c);
    let lens: Vec<usize> = seqs.iter().map(Sequence::len).collect();
    let tables: Vec<_> = seqs.iter().map(|s| c.table(s).unwrap()).collect();
    let bytes = c.bytes_in_use();
    for (toks, what) in [
        (vec![3u32, 4, 5], "three tokens for four sequences"),
        (vec![3u32, 4, 500, 6], "a token outside the vocabulary"),
    ] {
        let mut views: Vec<_> = seqs.iter_mut().map(|s| c.view(s)).collect();
        let mut stores: Vec<&mut dyn KvStore> =
            views.iter_mut().map(|v| v as &mut dyn KvStore).collect();
        let e = model.forward_batch(&toks, &mut stores).expect_err(what);
        assert!(!e.to_string().contains('\n'), "{what}: one line: {e}");
    }
    let now: Vec<usize> = seqs.iter().map(Sequence::len).collect();
    assert_eq!(now, lens);
    for (s, t) in seqs.iter().zip(&tables) {
        assert_eq!(&c.table(s).unwrap(), t);
    }
    assert_eq!(c.bytes_in_use(), bytes);
    // The sequences go on.
    let mut views: Vec<_> = seqs.iter_mut().map(|s| c.view(s)).collect();
    let mut stores: Vec<&mut dyn KvStore> =
        views.iter_mut().map(|v| v as &mut dyn KvStore).collect();
    let logits = model.forward_batch(&[3, 4, 5, 6], &mut stores).unwrap();
    assert_eq!(logits.size(), [4, 97]);
    drop(stores);
    drop(views);
    for s in seqs.iter_mut() {
        c.free(s).unwrap();
    }
}

/// `Engine::generate_batch` on the real model: every sequence follows the
/// greedy tokens `generate` gives it alone up to their first near-tie (the
/// batch's matmuls are another computation order), sequences stop on
/// their own (max tokens, the caller), and bad batches are refused before
/// any work.
#[test]
fn generate_batch_follows_generate_one_by_one() {
    use super::forced::{REAL_TOL, follows, forced, top2};
    use kvforge_engine::{Message, SamplingParams, Tokenizer};
    let engine = super::smollm2();
    let prompts: Vec<Vec<u32>> = ["What is a cat?", "Name three colors.", "Hi!"]
        .iter()
        .map(|m| {
            engine
                .tokenizer()
                .encode(&Tokenizer::chat_prompt(&[Message::new("user", *m)]))
                .unwrap()
        })
        .collect();
    let params: Vec<SamplingParams> = [12usize, 5, 9]
        .iter()
        .map(|&max_tokens| SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    let mut want = Vec::new();
    let mut want_rows = Vec::new();
    for (p, sp) in prompts.iter().zip(&params) {
        let mut s = Sequence::default();
        let g = engine.generate(&mut s, p, sp, &mut |_, _| true).unwrap();
        engine.cache().free(&mut s).unwrap();
        // The logits each token was picked from (the same schedule).
        let rows = forced(&engine, &mut s, p, &g.tokens);
        engine.cache().free(&mut s).unwrap();
        let picked: Vec<u32> = rows.iter().map(|r| top2(r).0 as u32).collect();
        assert_eq!(picked, g.tokens);
        want.push(g.tokens);
        want_rows.push(rows);
    }
    let mut seqs: Vec<Sequence> = (0..3).map(|_| Sequence::default()).collect();
    let mut seen = vec![0usize; 3];
    let got = engine
        .generate_batch(&mut seqs, &prompts, &params, &mut |i, _, _| {
            seen[i] += 1;
            true
        })
        .unwrap();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.tokens.len(), want[i].len());
        follows(&g.tokens, &want[i], &want_rows[i], REAL_TOL)
            .unwrap_or_else(|e| panic!("sequence {i}: {e}"));
    }
    assert_eq!(seen, vec![12, 5, 9]);
    for (s, (p, g)) in seqs.iter().zip(prompts.iter().zip(&got)) {
        // The last sampled token is not fed back.
        assert_eq!(s.len(), p.len() + g.tokens.len() - 1);
    }
    for s in seqs.iter_mut() {
        engine.cache().free(s).unwrap();
    }
    // The caller stops sequence 1 after its second token; the others go on.
    let mut seqs: Vec<Sequence> = (0..3).map(|_| Sequence::default()).collect();
    let mut ones = 0;
    let got = engine
        .generate_batch(&mut seqs, &prompts, &params, &mut |i, _, _| {
            ones += usize::from(i == 1);
            i != 1 || ones < 2
        })
        .unwrap();
    assert_eq!(got[1].tokens.len(), 2);
    follows(&got[0].tokens, &want[0], &want_rows[0], REAL_TOL).unwrap();
    for s in seqs.iter_mut() {
        engine.cache().free(s).unwrap();
    }
    // Bad batches: nothing runs, nothing is held.
    let bytes = engine.cache().bytes_in_use();
    let mut seqs: Vec<Sequence> = (0..3).map(|_| Sequence::default()).collect();
    let mut empty = prompts.clone();
    empty[2].clear();
    for (ps, sp, what) in [
        (
            &prompts[..2],
            &params[..],
            "two prompts for three sequences",
        ),
        (&prompts[..], &params[..1], "one parameter set"),
        (&empty[..], &params[..], "an empty prompt"),
    ] {
        let e = engine
            .generate_batch(&mut seqs, ps, sp, &mut |_, _, _| true)
            .expect_err(what);
        assert!(!e.to_string().contains('\n'), "{what}: {e}");
        assert!(seqs.iter().all(|s| s.is_empty()), "{what}");
    }
    assert_eq!(engine.cache().bytes_in_use(), bytes);
}

/// Requests for [`Engine::step`]: each samples greedily `new` tokens, and
/// the test sees what every step ran.
struct Reqs {
    seqs: Vec<Sequence>,
    tokens: Vec<Vec<u32>>,
    sampled: Vec<Vec<u32>>,
    failed: Vec<Option<String>>,
    new: usize,
    /// Alternatives wanted with each prompt token's score (`None`: none).
    top: Option<usize>,
    /// Each request's scores, by position in its context.
    scores: Vec<Vec<(usize, TokenLogprob)>>,
}

impl Reqs {
    fn new(prompts: &[Vec<u32>], new: usize) -> Reqs {
        let n = prompts.len();
        Reqs {
            seqs: (0..n).map(|_| Sequence::default()).collect(),
            tokens: prompts.to_vec(),
            sampled: vec![Vec::new(); n],
            failed: vec![None; n],
            new,
            top: None,
            scores: vec![Vec::new(); n],
        }
    }

    fn held(&self) -> Vec<usize> {
        self.seqs.iter().map(Sequence::len).collect()
    }
}

impl Batch for Reqs {
    fn requests(&self) -> usize {
        self.seqs.len()
    }
    fn ended(&self, i: usize) -> bool {
        self.failed[i].is_some() || self.sampled[i].len() == self.new
    }
    fn pending(&self, i: usize) -> &[u32] {
        &self.tokens[i][self.seqs[i].len()..]
    }
    fn sequences(&mut self, which: &[usize]) -> Vec<&mut Sequence> {
        let mut all: Vec<Option<&mut Sequence>> = self.seqs.iter_mut().map(Some).collect();
        which.iter().filter_map(|&i| all[i].take()).collect()
    }
    fn sample(&mut self, i: usize, logits: &[f32]) {
        let best = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        let t = best.unwrap_or(0) as u32;
        self.sampled[i].push(t);
        if self.sampled[i].len() < self.new {
            self.tokens[i].push(t);
        }
    }
    fn fail(&mut self, i: usize, why: Failure) {
        self.failed[i] = Some(why.to_string());
    }
    fn prompt_logprobs(&self, _: usize) -> Option<usize> {
        self.top
    }
    fn scored(&mut self, i: usize, from: usize, scores: Vec<TokenLogprob>) {
        let at = (from..).zip(scores);
        self.scores[i].extend(at);
    }
}

fn engine(kv_tokens: usize) -> Engine {
    let cfg = EngineConfig {
        block_size: 4,
        kv_tokens,
        kv_kind: Some(Kind::Float),
        ..EngineConfig::default()
    };
    Engine::new(tiny(), super::manager::tokenizer(), &cfg).unwrap()
}

/// The batch step's schedule: prompt chunks within the token budget, in
/// request order; a request whose prompt is in decodes with the others
/// in one batch (its last prompt token too; that the batch computes what
/// each alone computes, within rounding, is the tests above); one
/// request's bad token fails it alone, and so does one with nothing
/// pending that has not ended; a step that does not fit the cache says so
/// and writes nothing.
#[test]
fn the_batch_step_chunks_prompts_decodes_together_and_isolates_failures() {
    let e = engine(1024);
    let prompts = vec![(1..=10).collect::<Vec<u32>>(), vec![7, 8, 9]];
    let mut b = Reqs::new(&prompts, 3);
    let mut held = Vec::new();
    while !(0..2).all(|i| b.ended(i)) {
        assert!(matches!(e.step(&mut b, 4), Stepped::Ran));
        held.push(b.held());
    }
    // 4 of the 10; 4 more; the last 2 (the first sample), then 2 of the
    // 3; both decode (the second its last prompt token: its first
    // sample); both decode, the first's third sample ends it; the second
    // decodes alone.
    let want: Vec<Vec<usize>> = [[4, 0], [8, 0], [10, 2], [11, 3], [12, 4], [12, 5]]
        .iter()
        .map(|h| h.to_vec())
        .collect();
    assert_eq!(held, want);
    assert!(matches!(e.step(&mut b, 4), Stepped::Idle));
    for s in &mut b.seqs {
        e.cache().free(s).unwrap();
    }
    // A token outside the vocabulary fails its request only.
    let vocab = e.model_config().vocab as u32;
    let mut b = Reqs::new(&[vec![5, 6, vocab], vec![5, 6, 7]], 2);
    while !(0..2).all(|i| b.ended(i)) {
        e.step(&mut b, 64);
    }
    assert!(
        b.failed[0].as_deref().unwrap_or("").contains("vocab"),
        "{:?}",
        b.failed
    );
    assert_eq!((b.failed[1].as_ref(), b.sampled[1].len()), (None, 2));
    for s in &mut b.seqs {
        e.cache().free(s).unwrap();
    }
    // Nothing pending and not ended: it would never run, so it fails.
    let mut b = Reqs::new(&[vec![], vec![5, 6]], 1);
    assert!(matches!(e.step(&mut b, 64), Stepped::Ran));
    assert!(
        b.failed[0]
            .as_deref()
            .unwrap_or("")
            .contains("nothing left")
    );
    assert_eq!(b.sampled[1].len(), 1);
    for s in &mut b.seqs {
        e.cache().free(s).unwrap();
    }
    // Too long for the cache: the step says so, and the sequence holds
    // nothing.
    let small = engine(16);
    let mut b = Reqs::new(&[(1..=40).collect()], 1);
    assert!(matches!(small.step(&mut b, 64), Stepped::Full(_)));
    assert_eq!(b.held(), [0]);
}

/// Prompt scores: a request that asks for them gets one per prompt token
/// after the first, whatever the chunking, each what a prefill of the
/// tokens before it predicts for it (`token_logprob` of its last logits).
/// Chunks of 3 and one chunk of 19 compute the same rows in different
/// shapes: on this tiny f32 model they differ from the reference by
/// 1.4e-6 at most (measured under `MKL_CBWR=COMPATIBLE|AVX2|AVX512` and
/// `ATEN_CPU_CAPABILITY=default|avx2`); 1e-4 leaves a margin of about 70.
#[test]
fn prompt_scores_cover_every_token_once_whatever_the_chunking() {
    const TOL: f32 = 1e-4;
    let e = engine(1024);
    let prompt: Vec<u32> = (0..19).map(|i| 3 + (i * 13) % 80).collect();
    let run = |step_tokens: usize| {
        let mut b = Reqs::new(std::slice::from_ref(&prompt), 1);
        b.top = Some(3);
        while !b.ended(0) {
            e.step(&mut b, step_tokens);
        }
        e.cache().free(&mut b.seqs[0]).unwrap();
        std::mem::take(&mut b.scores[0])
    };
    let (chunked, whole) = (run(3), run(64));
    let positions = |s: &[(usize, TokenLogprob)]| s.iter().map(|(p, _)| *p).collect::<Vec<_>>();
    assert_eq!(positions(&chunked), (1..19).collect::<Vec<_>>());
    assert_eq!(positions(&whole), positions(&chunked));
    let mut worst = 0f32;
    for ((p, a), (q, b)) in chunked.iter().zip(&whole) {
        assert_eq!((p, a.token), (q, b.token));
        assert_eq!(a.token, prompt[*p]);
        // The reference: a prefill of the tokens before it, alone.
        let mut seq = Sequence::default();
        let logits = e.prefill(&mut seq, &prompt[..*p]).unwrap();
        e.cache().free(&mut seq).unwrap();
        let want = token_logprob(&logits, prompt[*p], 3);
        for got in [a, b] {
            worst = worst.max((got.logprob - want.logprob).abs());
            // Each alternative's score, not their order (a near tie may
            // order differently in another computation order).
            assert_eq!(got.top.len(), 3);
            assert!(got.top.windows(2).all(|w| w[0].1 >= w[1].1), "at {p}");
            for &(id, lp) in &got.top {
                let lp_want = token_logprob(&logits, id, 0).logprob;
                worst = worst.max((lp - lp_want).abs());
            }
            assert!(got.top[0].1 >= want.top[0].1 - TOL, "at {p}");
        }
    }
    eprintln!("largest difference from the reference: {worst:e}");
    assert!(worst < TOL, "{worst}");
    // A request that asks for none gets none.
    let mut b = Reqs::new(std::slice::from_ref(&prompt), 1);
    while !b.ended(0) {
        e.step(&mut b, 3);
    }
    assert!(b.scores[0].is_empty());
}
