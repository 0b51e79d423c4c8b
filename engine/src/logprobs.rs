//! Log-probabilities of tokens under the model: what OpenAI's `logprobs`
//! and `top_logprobs` report, and what an evaluation harness sums over a
//! continuation. They are the model's own distribution — a log-softmax of
//! the raw logits, before temperature, top-k/top-p or any constraint (as
//! OpenAI and vLLM report them) — so a greedy and a sampled request score
//! the same text the same way.

use std::cmp::Ordering::Greater;

/// One token's log-probability and the most likely tokens at its place.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// `ln p(token)`.
    pub logprob: f32,
    /// The `top` most likely tokens and their log-probabilities, most
    /// likely first (ties: the lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Most alternatives a caller may ask for per token (OpenAI's limit for
/// `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// `token`'s log-probability under `logits` (one row over the vocabulary)
/// and the `top` (at most [`MAX_TOP_LOGPROBS`]) most likely tokens.
/// The normalizer is summed in f64 from the row's maximum, so a row of
/// large logits neither overflows nor loses the small terms. A token past
/// the row reads as `-inf`; a row holding NaN gives NaN.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&x| lp(x));
    let top = most_likely(logits, top.min(MAX_TOP_LOGPROBS))
        .into_iter()
        .map(|(id, x)| (id, lp(x)))
        .collect();
    TokenLogprob {
        token,
        logprob,
        top,
    }
}

/// The `k` largest logits with their ids, largest first (ties: lower id
/// first), in one pass keeping a sorted list of `k`.
fn most_likely(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (id, &x) in logits.iter().enumerate() {
        if best.len() == k
            && best
                .last()
                .is_some_and(|&(_, w)| x.partial_cmp(&w) != Some(Greater))
        {
            continue;
        }
        // After every entry not below x: an equal logit keeps the lower id
        // first.
        let at = best.partition_point(|&(_, w)| w >= x);
        best.insert(at, (id as u32, x));
        best.truncate(k);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_normalize_and_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let t = token_logprob(&logits, 2, 3);
        let total: f64 = logits
            .iter()
            .map(|&x| f64::from(token_logprob(&logits, 0, 0).logprob - logits[0] + x).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let ids: Vec<u32> = t.top.iter().map(|&(i, _)| i).collect();
        assert_eq!(ids, [1, 3, 2], "ties keep the lower id first");
        assert_eq!(t.top[2].1, t.logprob);
        assert!(t.top[0].1 > t.logprob && t.top[0].1 == t.top[1].1);
    }

    #[test]
    fn large_logits_neither_overflow_nor_lose_the_rest() {
        let mut logits = vec![0.0f32; 1000];
        logits[7] = 1000.0;
        let t = token_logprob(&logits, 7, 1);
        assert!(t.logprob.abs() < 1e-6 && t.logprob.is_finite());
        let small = token_logprob(&logits, 0, 0).logprob;
        assert!((small + 1000.0).abs() < 1e-3, "{small}");
    }

    #[test]
    fn out_of_range_tokens_and_large_tops_are_bounded() {
        let logits = [0.5f32; 40];
        assert_eq!(token_logprob(&logits, 40, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(token_logprob(&logits, 0, 1000).top.len(), MAX_TOP_LOGPROBS);
        assert_eq!(token_logprob(&[0.0; 3], 0, 5).top.len(), 3);
        let lp = token_logprob(&logits, 3, 0).logprob;
        assert!((lp + 40f32.ln()).abs() < 1e-6);
    }
}
