//! Intervals for the report's quality columns: Wilson score intervals for
//! a share of items right (fact recall, pass keys); for a configuration's
//! change against the baseline on the very same items, Tango's score
//! interval for paired proportions (consistent with McNemar's test); for a
//! perplexity change, a paired bootstrap over the very same scored chunks.

use crate::inputs::SplitMix;

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
///
/// Units are drawn in runs of `block` consecutive ones (a moving-block
/// bootstrap; 1 = units drawn singly): neighbouring chunks of one text
/// are correlated — what a cache dropped early hurts every later chunk —
/// and drawing them singly would make the interval too narrow.
pub fn paired_bootstrap(
    n: usize,
    block: usize,
    seed: u64,
    stat: impl Fn(&[usize]) -> f64,
) -> Option<Interval> {
    if n == 0 {
        return None;
    }
    let block = block.clamp(1, n);
    let starts = (n - block + 1) as u64;
    let mut rng = SplitMix::new(seed);
    let mut idx = Vec::with_capacity(n + block);
    let mut values: Vec<f64> = (0..RESAMPLES)
        .filter_map(|_| {
            idx.clear();
            while idx.len() < n {
                let s = (rng.next_u64() % starts) as usize;
                idx.extend(s..s + block);
            }
            idx.truncate(n);
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
/// `base[i]` on the same item), in fractions, with Tango's score interval
/// for a difference of paired proportions: every change `Δ` whose score
/// statistic (the discordant items `b` the configuration alone gets right
/// and `c` the baseline alone does, against `Δ` with the other cell
/// probabilities at their constrained maximum likelihood) is within 1.96.
/// At `Δ = 0` that statistic is McNemar's, so the interval excludes zero
/// exactly when McNemar's score test rejects at 5%: two items lost of two
/// are not told apart from noise, eight of eight are. Items that all agree
/// still get an interval around zero as wide as their number allows.
pub fn paired_difference(ours: &[f64], base: &[f64]) -> Option<(f64, Interval)> {
    if ours.len() != base.len() || ours.is_empty() {
        return None;
    }
    let right = |x: f64| x > 0.5;
    let (mut b, mut c) = (0.0, 0.0);
    for (&o, &w) in ours.iter().zip(base) {
        match (right(o), right(w)) {
            (true, false) => b += 1.0,
            (false, true) => c += 1.0,
            _ => {}
        }
    }
    let n = ours.len() as f64;
    let point = (b - c) / n;
    // The score statistic of `d`; 0 at the point estimate.
    let z = |d: f64| -> f64 {
        // The probability of the baseline-only cell that maximizes the
        // likelihood under the change `d`: the feasible root of
        // 2n q² − B q − c d (1 − d) = 0.
        let big_b = b + c - d * (2.0 * n - b + c);
        let disc = (big_b * big_b + 8.0 * n * c * d * (1.0 - d)).max(0.0);
        let q = ((big_b + disc.sqrt()) / (4.0 * n)).clamp((-d).max(0.0), (1.0 - d) / 2.0);
        let var = (2.0 * q + d - d * d) / n;
        if var <= 0.0 {
            return if (point - d).abs() < 1e-12 {
                0.0
            } else {
                f64::INFINITY
            };
        }
        ((point - d) / var.sqrt()).abs()
    };
    // Each end by bisection between the point (z = 0) and ±1.
    let end = |toward: f64| -> f64 {
        let edge = toward - toward.signum() * 1e-12;
        if z(edge) <= Z95 {
            return toward;
        }
        let (mut inside, mut outside) = (point, edge);
        for _ in 0..100 {
            let mid = 0.5 * (inside + outside);
            if z(mid) <= Z95 {
                inside = mid;
            } else {
                outside = mid;
            }
        }
        inside
    };
    Some((
        point,
        Interval {
            lo: end(-1.0),
            hi: end(1.0),
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

/// Chunks per block of the perplexity bootstrap (512 tokens at the
/// default chunk of 64).
pub const PPL_BLOCK: usize = 8;

/// The relative perplexity change `ppl / ppl_base − 1` over `chunks` (in
/// stream order), with its paired moving-block bootstrap interval (blocks
/// of [`PPL_BLOCK`] consecutive chunks, the same for both caches).
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
        .then(|| {
            Some((
                point,
                paired_bootstrap(chunks.len(), PPL_BLOCK, seed, change)?,
            ))
        })
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
        // Identical answers on 6 items: no change, but an interval around
        // it (3.84 / (n + 3.84) either side when every item agrees).
        let same = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let (d, i) = paired_difference(&same, &same).unwrap();
        assert_eq!(d, 0.0);
        let half = Z95 * Z95 / (6.0 + Z95 * Z95);
        assert!(
            (i.hi - half).abs() < 1e-9 && (i.lo + half).abs() < 1e-9,
            "{i:?}"
        );
        assert!(!i.excludes_zero());
        // Both of 2 lost, 3 of 6 lost: not told apart from noise (McNemar's
        // z² = (b − c)² / (b + c) = 2 and 3, under 3.84); the interval
        // reaches below the point, down to −1 where it must.
        let (d, i) = paired_difference(&[0.0; 2], &[1.0; 2]).unwrap();
        assert_eq!(d, -1.0);
        assert!(!i.excludes_zero() && i.lo == -1.0, "{i:?}");
        let lost = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let (d, i) = paired_difference(&lost, &[1.0; 6]).unwrap();
        assert_eq!(d, -0.5);
        assert!(!i.excludes_zero() && i.lo < -0.5, "{i:?}");
        // 4 of 4 lost (z² = 4) and 30 of 30: told apart.
        for n in [4, 30] {
            let (d, i) = paired_difference(&vec![0.0; n], &vec![1.0; n]).unwrap();
            assert_eq!(d, -1.0);
            assert!(i.excludes_zero() && i.hi < 0.0, "{n}: {i:?}");
        }
        // Gains and losses that cancel: zero change, an interval around it;
        // the mirror image of a loss is the mirrored interval.
        let (d, i) = paired_difference(&[1.0, 0.0, 1.0, 0.0], &[0.0, 1.0, 0.0, 1.0]).unwrap();
        assert_eq!(d, 0.0);
        assert!(i.lo < 0.0 && i.hi > 0.0 && (i.lo + i.hi).abs() < 1e-9);
        let (_, gain) = paired_difference(&[1.0; 6], &lost).unwrap();
        let (_, loss) = paired_difference(&lost, &[1.0; 6]).unwrap();
        assert!((gain.lo + loss.hi).abs() < 1e-9 && (gain.hi + loss.lo).abs() < 1e-9);
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
        // Fewer chunks than a block: one block of all of them.
        assert!(ppl_change(&chunks[..3], 3).is_some());
        assert!(ppl_change(&[], 3).is_none());
    }
}
