//! How often does the KV cache hold near-duplicate vectors?
//! (`cargo xtask kv-stats`)
//!
//! Runs real texts through the model (the longest Wikipedia articles, the
//! setup's source code and technical manuals, a chitchat conversation whose
//! messages quote earlier ones), records every layer's keys (after RoPE, and
//! before: RoPE is undone exactly, it is a rotation) and values, and for
//! each vector finds its best cosine match:
//!
//! * `positions`: among the earlier vectors of the same layer and KV head;
//! * `layers`: the same position and head one layer down (MiniCache's axis);
//! * `sequences`: among all vectors of another text, same layer and head.
//!
//! at token granularity (one head vector) and block granularity (a block
//! of `--block` tokens of one head, flattened; and the whole cold block —
//! every layer's K and V — which is what the cache aliases today). Also the
//! exact duplicates after INT4 quantization (group 32 per token; per-channel
//! keys over the block at block granularity, as the cold tier stores them).
//!
//! Writes `kv_stats.csv` (one row per text × axis × granularity × kind ×
//! layer), `report.md` (the summary) and `best_cos_<text>.png` (the share of
//! vectors whose best match reaches each cosine) to `--out`.

#![allow(clippy::print_stdout)] // a report printer

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvforge_bench::cli::{self, Common};
use kvforge_bench::load_chats;
use kvforge_bench::output::{Csv, Output};
use kvforge_engine::ppl::articles;
use kvforge_engine::{
    ContiguousCache, Device, Engine, EngineConfig, Kind, KvStore, Message, Tensor,
};
use kvforge_lsh::{Content, Deduplicator, SimHashConfig, SimHashDedup};
use kvforge_pool::BlockId;
use kvforge_quant::{Axis, BlockShape, GroupQuantizer, QuantConfig, QuantizedBlock, Quantizer};

const THRESHOLDS: [f64; 3] = [0.90, 0.95, 0.99];

/// How often KV vectors repeat: best cosines across positions, layers and
/// texts, INT4 code duplicates, and token-level sharing simulated.
#[derive(Parser)]
#[command(name = "kv-stats")]
struct Args {
    /// Tokens per text.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// The data folder `cargo xtask setup` fills.
    #[arg(long, default_value = "data")]
    data: PathBuf,
    #[command(flatten)]
    common: Common,
}

impl Args {
    fn out(&self) -> PathBuf {
        self.common.out_or("target/kv-stats")
    }
}

fn parse_args() -> Result<Args> {
    let a: Args = cli::parse()?;
    if a.block < 2 || a.tokens < 4 * a.block || a.tokens % a.block != 0 {
        bail!(
            "--tokens ({}) must be a multiple of --block ({}) and at least 4 blocks; --block at least 2",
            a.tokens,
            a.block
        );
    }
    Ok(a)
}

/// One text's KV: per layer, `[heads, tokens, head_dim]` f32.
struct Kv {
    k_post: Vec<Tensor>,
    k_pre: Vec<Tensor>,
    /// `k_pre` less its mean over the text's positions (per layer and
    /// head): a component every key shares adds the same logit to every
    /// key, so attention does not see it, but it inflates cosines.
    k_pre_c: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl Kv {
    fn kind(&self, kind: &str) -> &[Tensor] {
        match kind {
            "k_post" => &self.k_post,
            "k_pre" => &self.k_pre,
            "k_pre_c" => &self.k_pre_c,
            _ => &self.v,
        }
    }
}

const KINDS: [&str; 4] = ["k_post", "k_pre", "k_pre_c", "v"];

fn record(e: &Engine, tokens: &[u32]) -> Result<Kv> {
    let c = e.model_config();
    // A sharing store that shares nothing records what the model stores.
    let mut r = Sharing::new(e, tokens.len(), false, None, false)?;
    for chunk in tokens.chunks(512) {
        let _ = e.model().forward(chunk, &mut r, false)?;
    }
    let mut kv = Kv {
        k_post: Vec::new(),
        k_pre: Vec::new(),
        k_pre_c: Vec::new(),
        v: Vec::new(),
    };
    let stored = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone).context("no tokens");
    for l in 0..c.n_layers {
        let k = Tensor::f_cat(&r.k_post[l], 0)?; // [n, h, d]
        kv.k_post.push(k.f_transpose(0, 1)?.f_contiguous()?);
        let pre = stored(&r.k_pre[l])?;
        kv.k_pre_c
            .push(&pre - pre.f_mean_dim([1i64].as_slice(), true, Kind::Float)?);
        kv.k_pre.push(pre);
        kv.v.push(stored(&r.v[l])?);
    }
    Ok(kv)
}

/// `[heads, items, dim]` rows scaled to unit length.
fn unit(x: &Tensor) -> Result<Tensor> {
    let n = x.f_norm_scalaropt_dim(2, [-1i64].as_slice(), true)?;
    Ok(x / n.f_clamp_min(1e-12)?)
}

/// Best cosine of every row of `x` (`[h, n, d]`) with an earlier row of
/// the same head: `[h, n - 1]` (the first row has none).
fn best_earlier(x: &Tensor) -> Result<Tensor> {
    let u = unit(x)?;
    let s = u.f_bmm(&u.f_transpose(1, 2)?)?;
    let n = x.size()[1];
    let later = Tensor::f_ones([n, n], (Kind::Bool, Device::Cpu))?.f_triu(0)?;
    let s = s.f_masked_fill(&later, -2.0)?;
    Ok(s.f_amax([-1i64].as_slice(), false)?.f_narrow(1, 1, n - 1)?)
}

/// Best cosine of every row of `x` with any row of `y` (same head).
fn best_in(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let s = unit(x)?.f_bmm(&unit(y)?.f_transpose(1, 2)?)?;
    Ok(s.f_amax([-1i64].as_slice(), false)?)
}

/// Cosine of matching rows of `x` and `y`.
fn paired(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok((unit(x)? * unit(y)?).f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?)
}

/// `[h, n, d]` → `[h, n / block, block · d]`.
fn blocks(x: &Tensor, block: usize) -> Result<Tensor> {
    let s = x.size();
    Ok(x.f_reshape([s[0], s[1] / block as i64, block as i64 * s[2]])?)
}

/// One statistic: the best cosines of a set of vectors.
struct Stat {
    text: String,
    axis: &'static str,
    granularity: &'static str,
    kind: String,
    layer: Option<usize>,
    best: Vec<f32>,
    /// Vectors whose INT4 codes equal an earlier one's (token and block
    /// rows of the positions axis only).
    int4_dup: Option<f64>,
}

impl Stat {
    fn frac(&self, t: f64) -> f64 {
        let hit = self.best.iter().filter(|&&c| f64::from(c) >= t).count();
        hit as f64 / self.best.len().max(1) as f64
    }
    fn mean(&self) -> f64 {
        self.best.iter().map(|&c| f64::from(c)).sum::<f64>() / self.best.len().max(1) as f64
    }
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(Vec::<f32>::try_from(t.f_flatten(0, -1)?.f_contiguous()?)?)
}

fn code_bytes(q: &QuantizedBlock) -> Vec<u8> {
    let mut out = q.packed.clone();
    for x in q.scales.iter().chain(&q.mins) {
        out.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    out
}

/// The share of rows of `x` (`[h, n, d]`, rows of `shape`) whose INT4
/// codes equal an earlier row's of the same head.
fn int4_duplicates(x: &Tensor, shape: BlockShape, q: &dyn Quantizer) -> Result<f64> {
    let data = values(x)?;
    let s = x.size();
    let (heads, n) = (s[0] as usize, s[1] as usize);
    let row = shape.len();
    let (mut dup, mut total) = (0usize, 0usize);
    for h in 0..heads {
        let mut seen = BTreeSet::new();
        for i in 0..n {
            let start = (h * n + i) * row;
            let codes = code_bytes(&q.quantize(shape, &data[start..start + row])?);
            if !seen.insert(codes) {
                dup += 1;
            }
            total += 1;
        }
    }
    Ok(dup as f64 / total.max(1) as f64)
}

struct Text {
    name: String,
    tokens: Vec<u32>,
    /// The text whose vectors this one is matched against on the
    /// `sequences` axis.
    other: Option<Vec<u32>>,
}

fn texts(e: &Engine, a: &Args) -> Result<Vec<Text>> {
    let read = |f: &str| -> Result<String> {
        let p = a.data.join("exllamav2").join(f);
        std::fs::read_to_string(&p)
            .with_context(|| format!("reading {} (run `cargo xtask setup`)", p.display()))
    };
    let n = a.tokens;
    let cut = |name: &str, ids: Vec<u32>| -> Result<Vec<u32>> {
        if ids.len() < n {
            bail!("{name}: only {} tokens, {n} asked", ids.len());
        }
        Ok(ids[..n].to_vec())
    };
    let wiki = articles(&read("wiki.utf8")?);
    let (w0, w1) = match (wiki.first(), wiki.get(1)) {
        (Some(a), Some(b)) => (a, b),
        _ => bail!("wiki.utf8 holds fewer than two articles"),
    };
    let enc = |s: &str| e.tokenizer().encode_text(s);
    let code = enc(&read("code.utf8")?)?;
    let tech = enc(&read("technical.utf8")?)?;
    // A chat whose every third message quotes the message before last.
    let chats = load_chats(&a.data.join("chitchat/dataset.json"), 10, 40, 10..=40)?;
    let mut msgs = Vec::new();
    for chat in &chats {
        for (i, text) in chat.iter().enumerate() {
            let content = if i >= 2 && i % 3 == 2 {
                format!("You said: \"{}\"\n{text}", chat[i - 2])
            } else {
                text.clone()
            };
            let role = if msgs.len() % 2 == 0 {
                "user"
            } else {
                "assistant"
            };
            msgs.push(Message::new(role, content));
        }
        if e.tokenizer().chat_ids(&msgs)?.len() > 2 * n {
            break;
        }
    }
    let chat = e.tokenizer().chat_ids(&msgs)?;
    Ok(vec![
        Text {
            name: "wiki".into(),
            tokens: cut("wiki", enc(w0)?)?,
            other: Some(cut("wiki (2nd article)", enc(w1)?)?),
        },
        Text {
            name: "code".into(),
            tokens: cut("code", code.clone())?,
            other: code.get(n..2 * n).map(<[u32]>::to_vec),
        },
        Text {
            name: "technical".into(),
            tokens: cut("technical", tech.clone())?,
            other: tech.get(n..2 * n).map(<[u32]>::to_vec),
        },
        Text {
            name: "chat-quote".into(),
            tokens: cut("chat-quote", chat.clone())?,
            other: chat.get(n..2 * n).map(<[u32]>::to_vec),
        },
    ])
}

fn measure(e: &Engine, a: &Args, t: &Text) -> Result<Vec<Stat>> {
    let kv = record(e, &t.tokens)?;
    let other = t.other.as_ref().map(|o| record(e, o)).transpose()?;
    let c = e.model_config();
    let hd = c.head_dim;
    let int4 = |axis: Axis, group: usize| -> Result<GroupQuantizer> {
        Ok(GroupQuantizer::new(QuantConfig::new(4, group, axis)?))
    };
    let (tok_q, key_block_q) = (int4(Axis::PerToken, 32)?, int4(Axis::PerChannel, a.block)?);
    let token_shape = BlockShape {
        tokens: 1,
        heads: 1,
        head_dim: hd,
    };
    let block_shape = BlockShape {
        tokens: a.block,
        heads: 1,
        head_dim: hd,
    };
    let mut out = Vec::new();
    let mut stat = |axis, granularity, kind: &str, layer, best: &Tensor, dup| -> Result<()> {
        out.push(Stat {
            text: t.name.clone(),
            axis,
            granularity,
            kind: kind.into(),
            layer,
            best: values(best)?,
            int4_dup: dup,
        });
        Ok(())
    };
    for kind in KINDS {
        let layers = kv.kind(kind);
        for (l, x) in layers.iter().enumerate() {
            let bx = blocks(x, a.block)?;
            // Codes of what the cold tier could store (not of centred keys).
            let stored = kind != "k_pre_c";
            let tok_dup = stored
                .then(|| int4_duplicates(x, token_shape, &tok_q))
                .transpose()?;
            // Block slabs as the cold tier lays them out: [tokens, head_dim].
            let block_q: &dyn Quantizer = if kind == "v" { &tok_q } else { &key_block_q };
            let block_dup = stored
                .then(|| int4_duplicates(&bx, block_shape, block_q))
                .transpose()?;
            stat(
                "positions",
                "token",
                kind,
                Some(l),
                &best_earlier(x)?,
                tok_dup,
            )?;
            stat(
                "positions",
                "block",
                kind,
                Some(l),
                &best_earlier(&bx)?,
                block_dup,
            )?;
            if l > 0 {
                stat(
                    "layers",
                    "token",
                    kind,
                    Some(l),
                    &paired(x, &layers[l - 1])?,
                    None,
                )?;
            }
            if let Some(o) = &other {
                stat(
                    "sequences",
                    "token",
                    kind,
                    Some(l),
                    &best_in(x, &o.kind(kind)[l])?,
                    None,
                )?;
            }
        }
    }
    // The whole cold block: every layer's K (rotated) and V, one vector.
    let whole = |kv: &Kv| -> Result<Tensor> {
        let parts: Vec<Tensor> = kv
            .k_post
            .iter()
            .chain(&kv.v)
            .map(|x| {
                let b = blocks(x, a.block)?; // [h, nb, block·d]
                Ok(b.f_transpose(0, 1)?.f_flatten(1, -1)?) // [nb, h·block·d]
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::f_cat(&parts, 1)?.f_unsqueeze(0)?)
    };
    let w = whole(&kv)?;
    stat(
        "positions",
        "cold-block",
        "k_post+v",
        None,
        &best_earlier(&w)?,
        None,
    )?;
    if let Some(o) = &other {
        stat(
            "sequences",
            "cold-block",
            "k_post+v",
            None,
            &best_in(&w, &whole(o)?)?,
            None,
        )?;
    }
    Ok(out)
}

/// RoPE cos / sin for positions `0..n`, `[n, 1, head_dim]`.
fn rope_tables(c: &kvforge_engine::LlamaConfig, n: usize) -> Result<(Tensor, Tensor)> {
    let half = (c.head_dim / 2) as i64;
    let inv: Vec<f64> = (0..half)
        .map(|i| c.rope_theta.powf(-2.0 * i as f64 / c.head_dim as f64))
        .collect();
    let pos = Tensor::f_arange(n as i64, (Kind::Double, Device::Cpu))?;
    let freqs = pos.f_outer(&Tensor::f_from_slice(&inv)?)?;
    let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
    Ok((
        emb.f_cos()?.f_to_kind(Kind::Float)?,
        emb.f_sin()?.f_to_kind(Kind::Float)?,
    ))
}

/// `x·cos + sign·rotate_half(x)·sin`: RoPE with `sign` 1, undone with −1.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, sign: f64) -> Result<Tensor> {
    let half = x.size()[2] / 2;
    let (x1, x2) = (x.f_narrow(-1, 0, half)?, x.f_narrow(-1, half, half)?);
    let rot = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
    Ok(x * cos + rot * sin * sign)
}

/// Token-level sharing, simulated exactly: each new value (and, with
/// `keys`, each new key before RoPE) whose best cosine match among the
/// vectors already stored for its layer and head reaches `threshold` is
/// replaced by that vector — what attention reads from a cache that
/// stores it once. Keys are matched and shared before RoPE and rotated at
/// their own position (a cache that rotates keys in the kernel).
struct Sharing {
    inner: ContiguousCache,
    threshold: f64,
    keys: bool,
    rope: (Tensor, Tensor),
    /// Per layer, `[heads, stored, head_dim]`.
    k_pre: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    /// Per layer, the keys attention read, `[n, heads, head_dim]` chunks.
    k_post: Vec<Vec<Tensor>>,
    /// Values found through [`SimHashDedup`] instead of an exhaustive
    /// search.
    lsh: Option<LshValues>,
    shared: i64,
    vectors: i64,
}

/// Per layer × head: a deduplicator over single value vectors, and every
/// value stored so far by position (a shared one holds its canonical's).
struct LshValues {
    dedup: Vec<SimHashDedup>,
    stored: Vec<Vec<Vec<f32>>>,
    secs: f64,
}

impl LshValues {
    fn new(cfg: SimHashConfig, slots: usize) -> Result<Self> {
        Ok(LshValues {
            dedup: (0..slots)
                .map(|_| SimHashDedup::new(cfg))
                .collect::<std::result::Result<_, _>>()?,
            stored: vec![Vec::new(); slots],
            secs: 0.0,
        })
    }

    /// Offers every row of `new` (`[h, n, d]`, positions from `start`) to
    /// its head's deduplicator; a shared row is replaced by its canonical
    /// vector. Returns the rows and how many were shared.
    fn share(&mut self, layer: usize, new: &Tensor) -> Result<(Tensor, i64)> {
        let size = new.size();
        let (h, n, d) = (size[0] as usize, size[1] as usize, size[2] as usize);
        let mut data = values(new)?;
        let t0 = std::time::Instant::now();
        let mut shared = 0;
        for head in 0..h {
            let slot = layer * h + head;
            let (dedup, stored) = (&mut self.dedup[slot], &mut self.stored[slot]);
            for i in 0..n {
                let row = &mut data[(head * n + i) * d..(head * n + i + 1) * d];
                let content = Content {
                    bytes: Vec::new(),
                    vector: row.to_vec(),
                };
                let pos = BlockId::new(stored.len() as u32, 1);
                let got = dedup.offer(pos, &content, &mut |b| {
                    Some(Content {
                        bytes: Vec::new(),
                        vector: stored.get(b.index() as usize)?.clone(),
                    })
                })?;
                if let Some(c) = got {
                    row.copy_from_slice(&stored[c.index() as usize]);
                    shared += 1;
                }
                stored.push(row.to_vec());
            }
        }
        self.secs += t0.elapsed().as_secs_f64();
        Ok((
            Tensor::f_from_slice(&data)?.f_reshape([h as i64, n as i64, d as i64])?,
            shared,
        ))
    }
}

impl Sharing {
    /// A store for `tokens` positions of `e`'s model: values (and, with
    /// `keys`, keys) shared at `threshold` (`None`: nothing shared), found
    /// through SimHash with `lsh` (values only).
    fn new(
        e: &Engine,
        tokens: usize,
        keys: bool,
        threshold: Option<f64>,
        lsh: bool,
    ) -> Result<Self> {
        let c = e.model_config();
        let lsh = match threshold.filter(|_| lsh && !keys) {
            Some(t) => Some(LshValues::new(
                SimHashConfig {
                    threshold: t as f32,
                    ..SimHashConfig::default()
                },
                c.n_layers * c.n_kv_heads,
            )?),
            None => None,
        };
        Ok(Sharing {
            inner: ContiguousCache::new(c.n_layers),
            threshold: threshold.unwrap_or(f64::INFINITY),
            keys,
            rope: rope_tables(c, tokens)?,
            k_pre: (0..c.n_layers).map(|_| None).collect(),
            v: (0..c.n_layers).map(|_| None).collect(),
            k_post: (0..c.n_layers).map(|_| Vec::new()).collect(),
            lsh,
            shared: 0,
            vectors: 0,
        })
    }

    /// `new` (`[h, n, d]`) with each row replaced by its best match in
    /// `old` where that reaches the threshold; counts what it replaced.
    fn share(&mut self, new: &Tensor, old: &Option<Tensor>) -> Result<Tensor> {
        let Some(old) = old.as_ref().filter(|_| self.threshold.is_finite()) else {
            return Ok(new.shallow_clone());
        };
        let s = unit(new)?.f_bmm(&unit(old)?.f_transpose(1, 2)?)?;
        let (best, idx) = s.f_max_dim(-1, false)?;
        let hit = best.f_ge(self.threshold)?; // [h, n]
        self.shared += hit.f_sum(Kind::Int64)?.f_int64_value(&[])?;
        let idx = idx.f_unsqueeze(-1)?.f_expand(new.size(), false)?;
        let matched = old.f_gather(1, &idx, false)?;
        Ok(matched.f_where_self(&hit.f_unsqueeze(-1)?, new)?)
    }
}

impl KvStore for Sharing {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn prepare(&mut self, n: usize) -> kvforge_engine::Result<()> {
        self.inner.prepare(n)
    }
    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> kvforge_engine::Result<Tensor> {
        let mut run = || -> Result<(Tensor, Tensor)> {
            let (start, n) = (self.inner.len() as i64, k.size()[0]);
            let cos = self.rope.0.f_narrow(0, start, n)?;
            let sin = self.rope.1.f_narrow(0, start, n)?;
            let heads = |t: &Tensor| -> Result<Tensor> { Ok(t.f_transpose(0, 1)?.f_contiguous()?) };
            let v_heads = heads(&v.f_to_kind(Kind::Float)?)?;
            let v_new = match self.lsh.as_mut() {
                Some(lsh) => {
                    let (t, shared) = lsh.share(layer, &v_heads)?;
                    self.shared += shared;
                    t
                }
                None => self.share(&v_heads, &self.v[layer].as_ref().map(Tensor::shallow_clone))?,
            };
            let k_pre = heads(&rotate(&k.f_to_kind(Kind::Float)?, &cos, &sin, -1.0)?)?;
            let k_pre = if self.keys {
                self.share(
                    &k_pre,
                    &self.k_pre[layer].as_ref().map(Tensor::shallow_clone),
                )?
            } else {
                k_pre
            };
            self.vectors += 2 * k_pre.size()[0] * n;
            let cat = |old: &Option<Tensor>, new: &Tensor| -> Result<Tensor> {
                Ok(match old {
                    Some(o) => Tensor::f_cat(&[o, new], 1)?,
                    None => new.shallow_clone(),
                })
            };
            self.k_pre[layer] = Some(cat(&self.k_pre[layer], &k_pre)?);
            self.v[layer] = Some(cat(&self.v[layer], &v_new)?);
            // Keys shared before RoPE are rotated back at their own
            // position; otherwise attention reads the model's keys.
            let k_out = if self.keys {
                rotate(&k_pre.f_transpose(0, 1)?, &cos, &sin, 1.0)?
            } else {
                k.f_to_kind(Kind::Float)?
            };
            self.k_post[layer].push(k_out.shallow_clone());
            Ok((
                k_out.f_to_kind(k.kind())?,
                v_new.f_transpose(0, 1)?.f_to_kind(v.kind())?,
            ))
        };
        let (k2, v2) = run().map_err(|e| kvforge_engine::EngineError::Torch(format!("{e:#}")))?;
        self.inner.attend(layer, q, &k2, &v2)
    }
    fn commit(&mut self, n: usize) -> kvforge_engine::Result<()> {
        self.inner.commit(n)
    }
}

/// One sharing setting's result on one text.
struct Simulated {
    text: String,
    what: &'static str,
    threshold: Option<f64>,
    ppl: f64,
    /// Share of all K and V vectors stored once instead.
    shared: f64,
    /// Through SimHash (not an exhaustive search): its time per token,
    /// every layer and head, in µs.
    lsh_us: Option<f64>,
}

/// Perplexity of `tokens` (scored in chunks of 64 after the first 64)
/// with token-level sharing at `threshold` (`None`: no sharing).
fn simulate(
    e: &Engine,
    text: &str,
    tokens: &[u32],
    keys: bool,
    threshold: Option<f64>,
    lsh: bool,
) -> Result<Simulated> {
    let mut s = Sharing::new(e, tokens.len(), keys, threshold, lsh)?;
    let (mut nll, mut scored) = (0f64, 0usize);
    for (i, chunk) in tokens.chunks(64).enumerate() {
        let logits = e.model().forward(chunk, &mut s, true)?;
        if let Some(next) = tokens.get((i + 1) * 64..((i + 2) * 64).min(tokens.len())) {
            // Row j predicts token j + 1: the chunk's last row predicts the
            // next chunk's first token; score rows whose target exists.
            let targets: Vec<i64> = chunk[1..]
                .iter()
                .chain(next.first())
                .map(|&t| i64::from(t))
                .collect();
            let lp = logits.f_log_softmax(-1, Kind::Float)?;
            let t = Tensor::f_from_slice(&targets)?.f_unsqueeze(1)?;
            let picked = lp.f_gather(1, &t, false)?;
            if i > 0 {
                nll -= picked.f_sum(Kind::Double)?.f_double_value(&[])?;
                scored += targets.len();
            }
        }
    }
    Ok(Simulated {
        text: text.into(),
        what: match (keys, s.lsh.is_some()) {
            (true, _) => "k+v",
            (false, false) => "v",
            (false, true) => "v (SimHash)",
        },
        threshold,
        ppl: (nll / scored.max(1) as f64).exp(),
        shared: s.shared as f64 / s.vectors.max(1) as f64,
        lsh_us: s.lsh.map(|l| 1e6 * l.secs / tokens.len() as f64),
    })
}

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("kv-stats", run)
}

fn run() -> Result<()> {
    let a = parse_args()?;
    let e = Engine::load(&a.common.model, &EngineConfig::default()).with_context(|| {
        format!(
            "loading {} (run `cargo xtask setup`)",
            a.common.model.display()
        )
    })?;
    let texts = texts(&e, &a)?;
    let mut out = Output::create(a.out())?;
    let t0 = std::time::Instant::now();
    let mut stats = Vec::new();
    for t in &texts {
        println!("{}: {} tokens", t.name, t.tokens.len());
        stats.extend(measure(&e, &a, t)?);
    }
    let mut sims = Vec::new();
    for t in &texts {
        sims.push(simulate(&e, &t.name, &t.tokens, false, None, false)?);
        for (keys, lsh) in [(false, false), (false, true), (true, false)] {
            for th in [0.99, 0.95, 0.90] {
                let what = match (keys, lsh) {
                    (true, _) => "k+v",
                    (false, false) => "v",
                    (false, true) => "v (SimHash)",
                };
                println!("{}: sharing {what} at cosine {th}", t.name);
                sims.push(simulate(&e, &t.name, &t.tokens, keys, Some(th), lsh)?);
            }
        }
    }
    write_csv(&stats, &mut out)?;
    let mut md = report(&a, &texts, &stats, t0.elapsed().as_secs_f64());
    write_simulated(&sims, &mut md, &mut out)?;
    for t in &texts {
        plot(&t.name, &stats, &mut out)?;
    }
    let report = out.report(&md)?;
    println!("wrote {}", report.display());
    Ok(())
}

/// Writes `simulated.csv` and appends its section to `md`.
fn write_simulated(sims: &[Simulated], md: &mut String, out: &mut Output) -> Result<()> {
    let mut csv = Csv::new(&[
        "text",
        "shared",
        "threshold",
        "ppl",
        "ppl_change",
        "vectors_shared",
        "simhash_us_per_token",
    ]);
    md.push_str(
        "\n## Token-level sharing, simulated\n\n\
         Each new value (`v`), or value and pre-RoPE key (`k+v`), whose best cosine among the vectors already stored \
         for its layer and head reaches the threshold is replaced by that vector (keys rotated at their own position), \
         which is exactly what attention reads from a cache that stores it once. `shared` is the share of all K and V \
         vectors stored once instead: the KV bytes an ideal token-level store saves, before the cost of its index \
         (≈ 2 bytes per shared vector against ≈ 36 for an INT4 head vector with its group parameters). \
         `v` searches every stored value exhaustively; `v (SimHash)` offers each value to a `SimHashDedup` per layer \
         and head (16 bits × 4 tables; the first candidate that verifies, not the best, and earlier tokens of the \
         same chunk count too), whose time per token (all layers and heads) is the last column.\n\n\
         | text | shared | cosine ≥ | perplexity | change | vectors shared | SimHash µs / token |\n|---|---|---|---|---|---|---|\n",
    );
    for s in sims {
        let base = sims
            .iter()
            .find(|b| b.text == s.text && b.threshold.is_none())
            .map_or(f64::NAN, |b| b.ppl);
        let change = 100.0 * (s.ppl / base - 1.0);
        let th = s.threshold.map_or("–".into(), |t| format!("{t}"));
        let what = if s.threshold.is_none() {
            "none"
        } else {
            s.what
        };
        let us = s.lsh_us.map_or(String::new(), |u| format!("{u:.0}"));
        csv.row([
            s.text.clone(),
            what.to_string(),
            th.clone(),
            format!("{:.4}", s.ppl),
            format!("{change:.3}"),
            format!("{:.4}", s.shared),
            us.clone(),
        ]);
        let _ = writeln!(
            md,
            "| {} | {what} | {th} | {:.3} | {change:+.2}% | {:.1}% | {} |",
            s.text,
            s.ppl,
            100.0 * s.shared,
            if us.is_empty() { "–" } else { &us }
        );
    }
    out.csv("simulated.csv", &csv)?;
    Ok(())
}

fn write_csv(stats: &[Stat], out: &mut Output) -> Result<()> {
    let mut csv = Csv::new(&[
        "text",
        "axis",
        "granularity",
        "kind",
        "layer",
        "vectors",
        "frac_ge_0.90",
        "frac_ge_0.95",
        "frac_ge_0.99",
        "mean_best_cos",
        "int4_identical",
    ]);
    for s in stats {
        let layer = s.layer.map_or("all".into(), |l| l.to_string());
        let dup = s.int4_dup.map_or(String::new(), |d| format!("{d:.4}"));
        csv.row([
            s.text.clone(),
            s.axis.to_string(),
            s.granularity.to_string(),
            s.kind.to_string(),
            layer,
            s.best.len().to_string(),
            format!("{:.4}", s.frac(0.90)),
            format!("{:.4}", s.frac(0.95)),
            format!("{:.4}", s.frac(0.99)),
            format!("{:.4}", s.mean()),
            dup,
        ]);
    }
    out.csv("kv_stats.csv", &csv)?;
    Ok(())
}

/// Pools the best cosines of `stats` rows matching the filter.
fn pooled<'a>(stats: &'a [Stat], keep: impl Fn(&Stat) -> bool) -> (Vec<f32>, Vec<f64>) {
    let rows: Vec<&'a Stat> = stats.iter().filter(|s| keep(s)).collect();
    let best = rows.iter().flat_map(|s| s.best.iter().copied()).collect();
    let dups = rows.iter().filter_map(|s| s.int4_dup).collect();
    (best, dups)
}

/// The report's main table.
fn report(a: &Args, texts: &[Text], stats: &[Stat], secs: f64) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Near-duplicate KV vectors\n");
    let _ = writeln!(
        md,
        "`cargo xtask kv-stats` — model `{}`, {} tokens per text, blocks of {} tokens; {:.0} s. \
         A row gives the share of vectors whose best cosine match (on that axis) reaches 0.90 / 0.95 / 0.99, \
         pooled over the layers named; `int4 =` is the share whose INT4 codes equal an earlier vector's exactly.\n",
        a.common.model.display(),
        a.tokens,
        a.block,
        secs
    );
    let _ = writeln!(
        md,
        "| text | axis | granularity | kind | layers | ≥ 0.90 | ≥ 0.95 | ≥ 0.99 | mean best | int4 = |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    let fmt = |v: f64| format!("{:.1}%", 100.0 * v);
    for t in texts {
        for (axis, gran) in [
            ("positions", "token"),
            ("positions", "block"),
            ("layers", "token"),
            ("sequences", "token"),
        ] {
            for kind in KINDS {
                for (label, pick) in [
                    ("0", (|l: usize| l == 0) as fn(usize) -> bool),
                    ("1–", |l: usize| l > 0),
                ] {
                    let (best, dups) = pooled(stats, |s| {
                        s.text == t.name
                            && s.axis == axis
                            && s.granularity == gran
                            && s.kind == kind
                            && s.layer.is_some_and(pick)
                    });
                    if best.is_empty() {
                        continue;
                    }
                    let s = Stat {
                        text: String::new(),
                        axis,
                        granularity: gran,
                        kind: kind.into(),
                        layer: None,
                        best,
                        int4_dup: None,
                    };
                    let dup = if dups.is_empty() {
                        "–".into()
                    } else {
                        fmt(dups.iter().sum::<f64>() / dups.len() as f64)
                    };
                    let _ = writeln!(
                        md,
                        "| {} | {axis} | {gran} | {kind} | {label} | {} | {} | {} | {:.3} | {dup} |",
                        t.name,
                        fmt(s.frac(THRESHOLDS[0])),
                        fmt(s.frac(THRESHOLDS[1])),
                        fmt(s.frac(THRESHOLDS[2])),
                        s.mean()
                    );
                }
            }
        }
        for s in stats
            .iter()
            .filter(|s| s.text == t.name && s.granularity == "cold-block")
        {
            let _ = writeln!(
                md,
                "| {} | {} | cold-block | {} | all | {} | {} | {} | {:.3} | – |",
                t.name,
                s.axis,
                s.kind,
                fmt(s.frac(THRESHOLDS[0])),
                fmt(s.frac(THRESHOLDS[1])),
                fmt(s.frac(THRESHOLDS[2])),
                s.mean()
            );
        }
    }
    md
}

/// The share of vectors whose best earlier match reaches each cosine, per
/// kind, token granularity, layers pooled.
fn plot(text: &str, stats: &[Stat], out: &mut Output) -> Result<()> {
    let mut series = Vec::new();
    for kind in KINDS {
        for (label, first) in [("layer 0", true), ("layers 1+", false)] {
            let (mut best, _) = pooled(stats, |s| {
                s.text == text
                    && s.axis == "positions"
                    && s.granularity == "token"
                    && s.kind == kind
                    && s.layer.is_some_and(|l| (l == 0) == first)
            });
            best.sort_by(f32::total_cmp);
            let n = best.len().max(1) as f64;
            let pts: Vec<(f64, f64)> = (0..=50)
                .map(|i| {
                    let x = 0.5 + f64::from(i) / 100.0;
                    let above = best.len() - best.partition_point(|&c| f64::from(c) < x);
                    (x, above as f64 / n)
                })
                .collect();
            series.push((format!("{kind}, {label}"), pts));
        }
    }
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    out.png(&format!("best_cos_{text}.png"), |path| {
        kvforge_bench::plot::line_plot(
            path,
            &format!("{text}: best cosine with an earlier vector (same layer, head)"),
            "cosine",
            "share of vectors at or above",
            (0.5, 1.0),
            (0.0, 1.0),
            &named,
        )
    })?;
    Ok(())
}
