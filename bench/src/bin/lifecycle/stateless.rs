//! The stateless configurations (`no-reuse`, `lifecycle-alone`,
//! `truncation`): the whole conversation so far sent as one request each
//! turn, less what the seed's rule reclaimed or what a token budget cuts.

use anyhow::Result;
use kvforge_engine::lifecycle::segment_cuts;
use kvforge_engine::{CacheManager, SamplingParams, Tokenizer, TurnReport};
use kvforge_lifecycle::{Lifecycle, LifecycleParams, RuleFallback, TurnEnd};

use crate::Args;

/// A conversation sent as stateless requests: every token so far, the
/// turns' starts, and (`lifecycle-alone`) which positions the seed's rule
/// reclaimed.
pub(crate) struct Stateless {
    history: Vec<u32>,
    starts: Vec<usize>,
    removed: Vec<bool>,
    rule: Lifecycle,
    stop: Vec<u32>,
}

impl Stateless {
    pub(crate) fn new(a: &Args, tok: &Tokenizer) -> Result<Stateless> {
        let rule = Lifecycle::new(
            Box::new(RuleFallback::new(a.protect, u64::MAX)?),
            LifecycleParams {
                delay: a.delay,
                min_match: 6,
                compress_min: None,
            },
        )?;
        let stop = ["<|im_start|>", "<|im_end|>"]
            .iter()
            .filter_map(|t| tok.token_id(t))
            .collect();
        Ok(Stateless {
            history: Vec::new(),
            starts: Vec::new(),
            removed: Vec::new(),
            rule,
            stop,
        })
    }

    /// Turn `ti` (`input` after the history) as one request under `config`.
    pub(crate) fn turn(
        &mut self,
        m: &CacheManager,
        config: &str,
        input: &[u32],
        params: &SamplingParams,
        budget_tokens: usize,
        ti: usize,
    ) -> Result<TurnReport> {
        self.starts.push(self.history.len());
        self.history.extend(input);
        self.removed.resize(self.history.len(), false);
        let prompt: Vec<u32> = match config {
            "truncation" => truncated(&self.history, &self.starts, budget_tokens),
            "lifecycle-alone" => self
                .history
                .iter()
                .zip(&self.removed)
                .filter(|(_, r)| !**r)
                .map(|(&t, _)| t)
                .collect(),
            _ => self.history.clone(),
        };
        let r = m.complete(&prompt, "lifecycle", params, &mut |_, _| true)?;
        self.history.extend(&r.generation.tokens);
        self.removed.resize(self.history.len(), false);
        if config == "lifecycle-alone" {
            let start = self.starts[ti];
            let cuts = segment_cuts(m.engine().tokenizer(), &self.history, start);
            let o = self.rule.end_turn(
                1,
                TurnEnd {
                    end: self.history.len() as u64,
                    cuts: &cuts,
                    tokens: &self.history,
                    stop: &self.stop,
                    refer: Some(start as u64..(start + input.len()) as u64),
                    model: None,
                },
            );
            for r in o.reclaim {
                for x in &mut self.removed[r.start as usize..r.end as usize] {
                    *x = true;
                }
            }
        }
        Ok(r)
    }
}

/// The system prompt (turn 0 up to its user message) and the newest whole
/// turns that fit `budget` tokens with the newest turn always in.
fn truncated(history: &[u32], starts: &[usize], budget: usize) -> Vec<u32> {
    let sys_end = starts.get(1).copied().unwrap_or(history.len());
    let newest = *starts.last().unwrap_or(&0);
    let mut from = newest;
    for &s in starts.iter().rev().skip(1) {
        if s == 0 || sys_end + (history.len() - s) > budget {
            break;
        }
        from = s;
    }
    if from == 0 {
        return history.to_vec();
    }
    let mut p = history[..sys_end.min(history.len())].to_vec();
    // Keep turn 0 whole when it fits; otherwise its system part only.
    if from > sys_end {
        p.truncate(sys_end);
    }
    p.extend(&history[from..]);
    p
}
