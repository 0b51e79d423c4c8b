//! Intervals for the report's quality columns: Wilson score intervals for
//! a share of items right (fact recall, pass keys); for a configuration's
//! change against the baseline on the very same items, an interval from
//! the items the two disagree on (McNemar's score test inverted); for a
//! perplexity change, a paired bootstrap over the very same scored chunks.

use crate::SplitMix;

/// z for a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;

/// Resamples of a bootstrap.
pub const RESAMPLES: usize = 2000;

/// A 95% interval `[lo, hi]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    /// Lower end.
    pub lo: f64,
    /// Upper end.
    pub hi: f64,
}

impl Interval {
    /// Whether it excludes zero: the change is told apart from noise.
    pub fn excludes_zero(&self) -> bool {
        self.lo > 0.0 || self.hi < 0.0
    }
}

/// The Wilson score interval of `k` successes in `n` trials (none for
/// `n = 0`). Unlike the normal approximation it stays inside `[0, 1]` and
/// is not empty at 0 or `n` successes.
pub fn wilson(k: usize, n: usize) -> Option<Interval> {
    if n == 0 || k > n {
        return None;
    }
    let (n, p) = (n as f64, k as f64 / n as f64);
    let z2 = Z95 * Z95;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z95 / (1.0 + z2 / n) * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    Some(Interval {
        lo: (centre - half).max(0.0),
        hi: (centre + half).min(1.0),
    })
}

/// The paired bootstrap interval of `stat` over `n` paired units: each
/// resample draws `n` unit indices with replacement (the same for both
/// configurations, which is what pairs them) and evaluates `stat` on them;
/// the 2.5th and 97.5th percentiles. Seeded: a rerun gives the same
/// interval. `None` for no units or a statistic that is never finite.
pub fn paired_bootstrap(n: usize, seed: u64, stat: impl Fn(&[usize]) -> f64) -> Option<Interval> {
    if n == 0 {
        return None;
    }
    let mut rng = SplitMix::new(seed);
    let mut idx = vec![0usize; n];
    let mut values: Vec<f64> = (0..RESAMPLES)
        .filter_map(|_| {
            for i in idx.iter_mut() {
                *i = (rng.next_u64() % n as u64) as usize;
            }
            Some(stat(&idx)).filter(|v| v.is_finite())
        })
        .collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    Some(Interval {
        lo: at(0.025),
        hi: at(0.975),
    })
}

/// The change in the share of items right (0/1 scores, `ours[i]` against
/// `base[i]` on the same item), in fractions, with a 95% interval from the
/// items the two disagree on: of those `m`, the share `b / m` the
/// configuration gets right gets a Wilson interval `[L, U]`, and the change
/// `(b − c) / n = m / n · (2p − 1)` the interval `m / n · (2L − 1, 2U − 1)`
/// — McNemar's score test inverted, so it excludes zero exactly when that
/// test rejects at 5%. (A bootstrap over a handful of items would call two
/// lost items of two significant; this does not.)
pub fn paired_difference(ours: &[f64], base: &[f64]) -> Option<(f64, Interval)> {
    if ours.len() != base.len() || ours.is_empty() {
        return None;
    }
    let n = ours.len() as f64;
    let right = |x: f64| x > 0.5;
    let (mut b, mut c) = (0usize, 0usize);
    for (&o, &w) in ours.iter().zip(base) {
        match (right(o), right(w)) {
            (true, false) => b += 1,
            (false, true) => c += 1,
            _ => {}
        }
    }
    let m = b + c;
    let change = (b as f64 - c as f64) / n;
    let Some(w) = wilson(b, m) else {
        // No item where they disagree: no change, and no spread.
        return Some((0.0, Interval { lo: 0.0, hi: 0.0 }));
    };
    let scale = m as f64 / n;
    Some((
        change,
        Interval {
            lo: scale * (2.0 * w.lo - 1.0),
            hi: scale * (2.0 * w.hi - 1.0),
        },
    ))
}

/// One scored chunk of a stream: tokens, and the sum of their negative
/// log-likelihoods under one configuration and under the baseline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairedChunk {
    /// Tokens scored.
    pub tokens: f64,
    /// NLL sum under the configuration.
    pub ours: f64,
    /// NLL sum under the baseline, the same tokens.
    pub base: f64,
}

/// The relative perplexity change `ppl / ppl_base − 1` over `chunks`, with
/// its paired bootstrap interval (chunks resampled: tokens close together
/// are not independent, chunks of the stream nearly are).
pub fn ppl_change(chunks: &[PairedChunk], seed: u64) -> Option<(f64, Interval)> {
    let change = |idx: &[usize]| {
        let (mut n, mut d) = (0.0, 0.0);
        for &i in idx {
            n += chunks[i].tokens;
            d += chunks[i].ours - chunks[i].base;
        }
        (d / n).exp() - 1.0
    };
    let all: Vec<usize> = (0..chunks.len()).collect();
    let point = change(&all);
    point
        .is_finite()
        .then(|| Some((point, paired_bootstrap(chunks.len(), seed, change)?)))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_known_values_and_stays_inside_zero_one() {
        // 8 of 10: the textbook interval is [0.490, 0.943].
        let w = wilson(8, 10).unwrap();
        assert!(
            (w.lo - 0.4902).abs() < 1e-3 && (w.hi - 0.9433).abs() < 1e-3,
            "{w:?}"
        );
        // 0 of 2 and 2 of 2: not empty, inside [0, 1].
        let (z, a) = (wilson(0, 2).unwrap(), wilson(2, 2).unwrap());
        assert_eq!(z.lo, 0.0);
        assert!(z.hi > 0.6 && z.hi < 0.7, "{z:?}");
        assert!((a.lo - (1.0 - z.hi)).abs() < 1e-12 && a.hi == 1.0);
        assert!(wilson(0, 0).is_none() && wilson(3, 2).is_none());
        // More items, a narrower interval.
        let (small, big) = (wilson(5, 10).unwrap(), wilson(50, 100).unwrap());
        assert!(big.hi - big.lo < small.hi - small.lo);
    }

    #[test]
    fn a_paired_difference_is_significant_only_when_the_items_say_so() {
        // Identical answers: a zero change whose interval is [0, 0].
        let same = [1.0, 0.0, 1.0, 1.0];
        let (d, i) = paired_difference(&same, &same).unwrap();
        assert_eq!((d, i.lo, i.hi), (0.0, 0.0, 0.0));
        assert!(!i.excludes_zero());
        // One item of 4 lost; both of 2; 3 of 6: not told apart from noise
        // (McNemar's exact p: 1, 0.5, 0.25).
        let (d, i) = paired_difference(&[1.0, 0.0, 1.0, 0.0], &same).unwrap();
        assert_eq!(d, -0.25);
        assert!(!i.excludes_zero(), "{i:?}");
        let (d, i) = paired_difference(&[0.0; 2], &[1.0; 2]).unwrap();
        assert_eq!(d, -1.0);
        assert!(!i.excludes_zero() && i.lo == -1.0, "{i:?}");
        let half = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        assert!(
            !paired_difference(&half, &[1.0; 6])
                .unwrap()
                .1
                .excludes_zero()
        );
        // 8 of 8 lost, and 30 of 30: told apart.
        for n in [8, 30] {
            let (d, i) = paired_difference(&vec![0.0; n], &vec![1.0; n]).unwrap();
            assert_eq!(d, -1.0);
            assert!(i.excludes_zero() && i.hi < 0.0, "{n}: {i:?}");
        }
        // Gains and losses that cancel: zero change, an interval around it.
        let (d, i) = paired_difference(&[1.0, 0.0, 1.0, 0.0], &[0.0, 1.0, 0.0, 1.0]).unwrap();
        assert_eq!(d, 0.0);
        assert!(i.lo < 0.0 && i.hi > 0.0);
        assert!(paired_difference(&[1.0], &[1.0, 0.0]).is_none());
    }

    #[test]
    fn a_ppl_change_is_paired_chunk_by_chunk_and_seeded() {
        // A configuration worse by 0.01 nats per token on every chunk, with
        // chunks of very different difficulty: pairing removes the spread.
        let chunks: Vec<PairedChunk> = (0..50)
            .map(|i| {
                let base = 64.0 * (1.0 + (i % 7) as f64);
                PairedChunk {
                    tokens: 64.0,
                    ours: base + 0.64,
                    base,
                }
            })
            .collect();
        let (c, i) = ppl_change(&chunks, 3).unwrap();
        assert!((c - (0.01f64.exp() - 1.0)).abs() < 1e-12, "{c}");
        assert!(i.excludes_zero() && i.lo > 0.009, "{i:?}");
        assert_eq!(ppl_change(&chunks, 3), ppl_change(&chunks, 3));
        assert!(ppl_change(&[], 3).is_none());
    }
}
