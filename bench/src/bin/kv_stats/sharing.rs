//! Token-level sharing simulated exactly: a `KvStore` that replaces each
//! new value (and key) vector by an earlier one it matches at a cosine,
//! found by brute force or by SimHash, and the perplexity that costs.

use anyhow::Result;
use kvforge_engine::{ContiguousCache, Engine, Kind, KvStore, Tensor};
use kvforge_lsh::{Content, Deduplicator, SimHashConfig, SimHashDedup};
use kvforge_pool::BlockId;

use crate::vectors::{rope_tables, rotate, unit, values};

/// Token-level sharing, simulated exactly: each new value (and, with
/// `keys`, each new key before RoPE) whose best cosine match among the
/// vectors already stored for its layer and head reaches `threshold` is
/// replaced by that vector — what attention reads from a cache that
/// stores it once. Keys are matched and shared before RoPE and rotated at
/// their own position (a cache that rotates keys in the kernel).
pub(crate) struct Sharing {
    pub(crate) inner: ContiguousCache,
    pub(crate) threshold: f64,
    pub(crate) keys: bool,
    pub(crate) rope: (Tensor, Tensor),
    /// Per layer, `[heads, stored, head_dim]`.
    pub(crate) k_pre: Vec<Option<Tensor>>,
    pub(crate) v: Vec<Option<Tensor>>,
    /// Per layer, the keys attention read, `[n, heads, head_dim]` chunks.
    pub(crate) k_post: Vec<Vec<Tensor>>,
    /// Values found through [`SimHashDedup`] instead of an exhaustive
    /// search.
    pub(crate) lsh: Option<LshValues>,
    pub(crate) shared: i64,
    pub(crate) vectors: i64,
}

/// Per layer × head: a deduplicator over single value vectors, and every
/// value stored so far by position (a shared one holds its canonical's).
pub(crate) struct LshValues {
    pub(crate) dedup: Vec<SimHashDedup>,
    pub(crate) stored: Vec<Vec<Vec<f32>>>,
    pub(crate) secs: f64,
}

impl LshValues {
    pub(crate) fn new(cfg: SimHashConfig, slots: usize) -> Result<Self> {
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
    pub(crate) fn new(
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
pub(crate) struct Simulated {
    pub(crate) text: String,
    pub(crate) what: &'static str,
    pub(crate) threshold: Option<f64>,
    pub(crate) ppl: f64,
    /// Share of all K and V vectors stored once instead.
    pub(crate) shared: f64,
    /// Through SimHash (not an exhaustive search): its time per token,
    /// every layer and head, in µs.
    pub(crate) lsh_us: Option<f64>,
}

/// Perplexity of `tokens` (scored in chunks of 64 after the first 64)
/// with token-level sharing at `threshold` (`None`: no sharing).
pub(crate) fn simulate(
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
