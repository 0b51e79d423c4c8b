//! Budget-aligned configurations: `target_kv = 0.25` sizes one knob of a
//! configuration so that, on each item, it holds that share of the KV
//! bytes the full cache (the baseline) held on the very same item.
//!
//! The knob, by what the configuration has:
//!
//! * an eviction policy: its budget — `window` for `sink-window`
//!   (StreamingLLM), `budget_tokens` for the scored policies (whose
//!   protected `window` shrinks to half of what the budget leaves after
//!   the sink, in whole blocks, if it would not fit). With a cold tier
//!   the budget counts the cold tier's sink and hot window at the hot
//!   dtype's block size and every other kept block at the quantized one.
//! * only a cold tier: its hot window (full-precision newest tokens); the
//!   format's floor (sink kept, window 0) is the least it can hold.
//! * a tier policy (`tier = { … }`): refused — it replaces the window
//!   these sizes count.
//!
//! The sizes are whole blocks (what the pools account), and they count
//! what the cache holds when the share is measured: the policies act on
//! the table before a step, and the step then writes its tokens, so an
//! item measured after a step of `step` blocks (a stream's chunk; one
//! block for an item that ends on decode: the block its last token lands
//! in, which straddles the window's start) holds that many blocks beyond
//! what the policies kept. A cold tier keeps them in full precision (they
//! are newer than its window), and `sink-window` keeps them beside its
//! window, so both are counted; the scored policies count the incoming
//! tokens against their budget already. The measured share is recorded
//! beside the target for every item (`kv_share`), so a report shows both.

use kvforge_engine::mechanisms::{Mechanisms, PolicySpec};

/// What sizes a configuration's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Knob {
    /// `sink-window`'s `window`.
    Window,
    /// A scored policy's `budget_tokens`.
    BudgetTokens,
    /// The cold tier's hot window.
    HotWindow,
}

/// The knob `target_kv` sets on `m`, or why it has none.
pub fn knob(m: &Mechanisms) -> Result<Knob, String> {
    if let Some(t) = &m.tier {
        // It decides what goes cold; the cold tier's window it replaces
        // sizes nothing.
        return Err(format!(
            "target_kv cannot size a tier policy ({}): give its own window in tier = {{ … }}, or size an eviction budget without it",
            t.policy
        ));
    }
    match (&m.eviction, &m.cold) {
        (Some(e), _) if e.policy == "sink-window" => Ok(Knob::Window),
        (Some(e), _) if e.params.contains_key("budget_tokens") => Ok(Knob::BudgetTokens),
        (Some(e), _) => Err(format!(
            "target_kv sets an eviction budget in tokens; {:?} here has watermarks (high, low) instead",
            e.policy
        )),
        (None, Some(_)) => Ok(Knob::HotWindow),
        (None, None) => Err(
            "target_kv needs something to size: an eviction policy or a cold tier (prefix reuse, sharing and the lifecycle have no budget)".into(),
        ),
    }
}

/// Block sizes of a configuration's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// Tokens per block.
    pub block: usize,
    /// Bytes of one hot block (K and V of every layer).
    pub hot: u64,
    /// Bytes of one quantized block, when there is a cold tier.
    pub cold: Option<u64>,
}

/// `m` sized to hold `target` of `full` bytes (what the baseline kept on
/// the item) with blocks of `sizes`, measured after a step that writes
/// `step` blocks; and the knob's value in tokens.
pub fn resolve(
    m: &Mechanisms,
    target: f64,
    full: u64,
    sizes: Sizes,
    step: u64,
) -> Result<(Mechanisms, usize), String> {
    let b = sizes.block as u64;
    let h = sizes.hot.max(1);
    let want = (target * full as f64).floor() as u64;
    let blocks = full.div_ceil(h);
    let pct = |bytes: u64| 100.0 * bytes as f64 / full.max(1) as f64;
    let mut out = m.clone();
    let tokens = match knob(m)? {
        Knob::HotWindow => {
            let (Some(q), Some(c)) = (m.cold.as_ref(), sizes.cold) else {
                return Err("a cold tier without a quantized block size".into());
            };
            let sink = (q.sink as u64).div_ceil(b).min(blocks);
            // The step's blocks stay in full precision.
            let open = (blocks - sink).min(step);
            let floor = (sink + open) * h + (blocks - sink - open) * c;
            if want < floor || h <= c {
                return Err(format!(
                    "target_kv = {target}: {} holds at least {:.1}% of this item's KV (sink {}, window 0)",
                    q.content_name(),
                    pct(floor),
                    q.sink
                ));
            }
            let window = ((want - floor) / (h - c)).min(blocks - sink - open);
            let cold = out.cold.as_mut().ok_or("no cold tier")?;
            cold.window = (window * b) as usize;
            cold.window
        }
        k => {
            let (hot_blocks, per_block) = match (&m.cold, sizes.cold) {
                // Sink, hot window and the step's blocks.
                (Some(q), Some(c)) => (((q.sink + q.window) as u64).div_ceil(b) + step, c),
                _ => (0, h),
            };
            let hot_bytes = hot_blocks * h;
            if want < hot_bytes + per_block {
                return Err(format!(
                    "target_kv = {target}: the cold tier's sink, hot window and the measured step's blocks alone hold {:.1}% of this item's KV",
                    pct(hot_bytes)
                ));
            }
            let kept = hot_blocks + (want - hot_bytes) / per_block;
            let tokens = (kept * b) as usize;
            let cold_window = m.cold.as_ref().map_or(0, |q| q.window);
            let e = out.eviction.as_mut().ok_or("no eviction policy")?;
            let step_tokens = (step * b) as usize;
            set_budget(e, k, tokens, sizes.block, step_tokens, cold_window, target)?;
            tokens
        }
    };
    Ok((out, tokens))
}

/// Sets `e`'s budget to `tokens` (its knob `k`): `sink-window`'s window
/// is what the sink leaves less the `step` tokens the measured step
/// writes; a scored policy's protected window shrinks (in whole blocks of
/// at least one `block`) when sink and window would not fit in it.
fn set_budget(
    e: &mut PolicySpec,
    k: Knob,
    tokens: usize,
    block: usize,
    step: usize,
    cold_window: usize,
    target: f64,
) -> Result<(), String> {
    let get = |name: &str| e.params.get(name).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
    let (sink, window) = (get("sink"), get("window"));
    let small = || {
        format!(
            "target_kv = {target}: a budget of {tokens} tokens leaves no room after the sink of {sink} (and the cold window of {cold_window})"
        )
    };
    let rest = tokens.checked_sub(sink).filter(|&r| r > cold_window);
    let Some(rest) = rest else {
        return Err(small());
    };
    match k {
        Knob::Window => {
            // The step's blocks are kept beside the window.
            let w = rest - step.min(rest);
            if w <= cold_window || w == 0 {
                return Err(small());
            }
            e.params.insert("window".into(), w.into());
        }
        _ => {
            e.params.insert("budget_tokens".into(), tokens.into());
            if sink + window >= tokens {
                let half = (rest / 2 / block.max(1)) * block;
                let w = half.max(cold_window);
                // A scored policy keeps at least one recent block.
                if w < block || sink + w >= tokens {
                    return Err(small());
                }
                e.params.insert("window".into(), w.into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvforge_engine::Registry;

    fn mech(src: &str) -> Mechanisms {
        Mechanisms::from_toml(
            src,
            std::path::Path::new("t.toml"),
            32,
            &Registry::builtin(),
        )
        .unwrap()
    }

    const SIZES: Sizes = Sizes {
        block: 32,
        hot: 1000,
        cold: Some(300),
    };

    #[test]
    fn a_tier_policy_has_no_knob() {
        let mut m = mech("cold = { format = \"int4\", window = 64 }");
        assert!(matches!(knob(&m), Ok(Knob::HotWindow)));
        m.tier = Some(kvforge_engine::mechanisms::PolicySpec {
            policy: "m:Every".into(),
            params: Default::default(),
        });
        let e = knob(&m).unwrap_err();
        assert!(
            e.starts_with("target_kv cannot size a tier policy (m:Every)"),
            "{e}"
        );
    }

    #[test]
    fn an_eviction_budget_is_the_target_share_of_the_blocks() {
        let m = mech("eviction = { policy = \"sink-window\", sink = 32, window = 512 }");
        // 128 blocks of 1000 bytes; a quarter is 32 blocks = 1024 tokens:
        // the sink's block, 30 blocks of window and the one the last
        // decoded token lands in (it straddles the window's start).
        let (r, tokens) = resolve(&m, 0.25, 128_000, SIZES, 1).unwrap();
        assert_eq!(tokens, 1024);
        let e = r.eviction.clone().unwrap();
        assert_eq!(e.params["window"], 960);
        assert_eq!(e.params["sink"], 32);
        // Measured after a chunk of two blocks: the window leaves them room.
        let (r, _) = resolve(&m, 0.25, 128_000, SIZES, 2).unwrap();
        assert_eq!(r.eviction.clone().unwrap().params["window"], 928);
        let m =
            mech("eviction = { policy = \"h2o\", sink = 32, window = 256, budget_tokens = 544 }");
        let (r, tokens) = resolve(&m, 0.125, 128_000, SIZES, 1).unwrap();
        assert_eq!(tokens, 512);
        let e = r.eviction.clone().unwrap();
        assert_eq!(e.params["budget_tokens"], 512);
        assert_eq!(e.params["window"], 256);
        // A budget under sink + window halves what is left after the sink.
        let (r, _) = resolve(&m, 0.0625, 128_000, SIZES, 1).unwrap();
        let e = r.eviction.clone().unwrap();
        assert_eq!(e.params["budget_tokens"], 256);
        assert_eq!(e.params["window"], 96);
        check_resolved(&r);
        // Under two blocks after the sink there is no recent window left.
        let e = resolve(&m, 0.5, 4_000, SIZES, 1).unwrap_err();
        assert!(e.contains("leaves no room after the sink"), "{e}");
    }

    /// A resolved configuration passes the engine's own checks.
    fn check_resolved(m: &Mechanisms) {
        m.check(32, &Registry::builtin()).unwrap();
    }

    #[test]
    fn with_a_cold_tier_the_budget_counts_quantized_blocks() {
        let m = mech(
            "cold = { format = \"int4\", window = 128, sink = 32 }\n\
             eviction = { policy = \"sink-window\", sink = 32, window = 1024 }",
        );
        // Target 25 000 bytes: 6 hot blocks (sink 1 + window 4 + the step's
        // one) = 6 000, then 19 000 / 300 = 63 cold blocks; 69 blocks =
        // 2208 tokens, the window 2208 - 32 - 32.
        let (r, tokens) = resolve(&m, 0.25, 100_000, SIZES, 1).unwrap();
        assert_eq!(tokens, 69 * 32);
        assert_eq!(r.eviction.as_ref().unwrap().params["window"], 2144);
        check_resolved(&r);
        // A step of two blocks: 7 000 hot, 18 000 / 300 = 60 cold; 67
        // blocks, the window 2144 - 32 - 64.
        let (r, tokens) = resolve(&m, 0.25, 100_000, SIZES, 2).unwrap();
        assert_eq!(tokens, 67 * 32);
        assert_eq!(r.eviction.as_ref().unwrap().params["window"], 2048);
        // Under the hot blocks alone there is no budget.
        let e = resolve(&m, 0.05, 100_000, SIZES, 1).unwrap_err();
        assert!(e.contains("alone hold 6.0%"), "{e}");
    }

    #[test]
    fn a_cold_tier_alone_sizes_its_hot_window_down_to_its_floor() {
        let m = mech("cold = { format = \"int4\", window = 128, sink = 32 }");
        // 100 blocks: the sink's and the last token's block in full
        // precision, floor = 2 000 + 98 * 300 = 31 400 bytes (31.4%).
        let (r, tokens) = resolve(&m, 0.5, 100_000, SIZES, 1).unwrap();
        // (50 000 - 31 400) / 700 = 26 blocks of window.
        assert_eq!(tokens, 26 * 32);
        assert_eq!(r.cold.as_ref().unwrap().window, 26 * 32);
        check_resolved(&r);
        // A step of two blocks: floor 3 000 + 97 * 300; 25 blocks.
        let (r, _) = resolve(&m, 0.5, 100_000, SIZES, 2).unwrap();
        assert_eq!(r.cold.as_ref().unwrap().window, 25 * 32);
        let e = resolve(&m, 0.25, 100_000, SIZES, 1).unwrap_err();
        assert!(e.contains("at least 31.4%"), "{e}");
    }

    #[test]
    fn what_has_no_knob_is_named() {
        assert!(knob(&mech("lifecycle = { policy = \"recent-turns\", keep = 4 }")).is_err());
        let e = knob(&mech(
            "eviction = { policy = \"lfu\", sink = 16, window = 64, high = 0.9, low = 0.5 }",
        ))
        .unwrap_err();
        assert!(e.contains("watermarks"), "{e}");
    }
}
