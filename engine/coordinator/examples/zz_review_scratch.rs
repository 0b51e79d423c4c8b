//! TEMPORARY review scratch (to be deleted): random open/import/plan/commit/abort/register/close
//! with every invariant checked, small budgets, hot and cold imports.
#![allow(clippy::unwrap_used)]
use kvforge_coordinator::{COLD, ColdConfig, CoordError, Coordinator, CoordinatorConfig, HOT, Planned, PrefixConfig, TurnTail, EvictionConfig};
use kvforge_pool::{KvLayout, StorageFormat};
use kvforge_prefix::ExtraKeys;

fn main() {
    let mut rng: u64 = 0x1234_5678_9abc_def1;
    let mut rnd = move |n: u64| { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; rng % n.max(1) };
    let mut failures = 0;
    for round in 0..400 {
        let layout = KvLayout::new(2, 2, 8, 4, StorageFormat::F16).unwrap();
        let mut cfg = CoordinatorConfig::new(layout, 6 + rnd(20) as usize);
        let tail = [TurnTail::Seal, TurnTail::Copy, TurnTail::Skip][rnd(3) as usize];
        cfg.prefix = Some(PrefixConfig { seed: Some(3), tail, ..PrefixConfig::default() });
        let with_cold = rnd(2) == 0;
        if with_cold {
            let int4 = StorageFormat::Int4 { group_size: 8 };
            cfg.cold = Some(ColdConfig { format: int4, value_format: int4, window: 8, sink: 0 });
        }
        if rnd(2) == 0 { cfg.budget_bytes = (2 + rnd(10)) * layout.block_bytes(); }
        if rnd(2) == 0 { cfg.eviction = Some(EvictionConfig::SinkWindow { sink: 4, window: 8 }); }
        let Ok(mut c) = Coordinator::new(cfg) else { continue };
        c.check_every_call(true);
        let e = ExtraKeys::default();
        let mut seqs: Vec<(u64, Vec<u32>, usize)> = Vec::new(); // seq, tokens, held len
        let mut pending: Vec<u64> = Vec::new();
        for step in 0..200 {
            let op = rnd(7);
            let r: Result<(), CoordError> = (|| {
                match op {
                    0 => {
                        let base = rnd(3) as u32;
                        let len = 1 + rnd(40) as usize;
                        let toks: Vec<u32> = (0..len as u32).map(|i| base * 1000 + i).collect();
                        let o = c.open(&toks, &e)?;
                        let mut held = o.reused;
                        if held % 4 == 0 && held + 4 < toks.len() {
                            let tier = if with_cold && rnd(2) == 0 { COLD } else { HOT };
                            let want = (toks.len() - 1) / 4 - held / 4;
                            let got = c.import(o.seq, tier, want)?;
                            held += got.len() * 4;
                            assert_eq!(c.table(o.seq)?.positions() as usize, held);
                        }
                        seqs.push((o.seq, toks, held));
                    }
                    1 | 2 if !seqs.is_empty() => {
                        let i = rnd(seqs.len() as u64) as usize;
                        let (s, toks, held) = seqs[i].clone();
                        if pending.contains(&s) { return Ok(()); }
                        let n = (toks.len().saturating_sub(held)).max(1).min(1 + rnd(8) as usize);
                        match c.plan(s, n)? {
                            Planned::Step(_) => { pending.push(s); seqs[i].2 = held + n; }
                            Planned::Full(_) => {}
                        }
                    }
                    3 if !pending.is_empty() => {
                        let s = pending.swap_remove(rnd(pending.len() as u64) as usize);
                        if rnd(3) == 0 { c.abort(s)?; let i = seqs.iter().position(|x| x.0 == s).unwrap(); seqs[i].2 = c.table(s)?.positions() as usize; }
                        else { c.commit(s)?; let i = seqs.iter().position(|x| x.0 == s).unwrap(); seqs[i].2 = c.table(s)?.positions() as usize; }
                    }
                    4 | 5 if !seqs.is_empty() => {
                        let i = rnd(seqs.len() as u64) as usize;
                        let (s, mut toks, _) = seqs[i].clone();
                        if pending.contains(&s) { return Ok(()); }
                        let pos = c.table(s)?.positions() as usize;
                        while toks.len() < pos { toks.push(7); }
                        if op == 4 { c.register(s, &toks[..pos], &e)?; }
                        c.close(s)?; seqs.swap_remove(i);
                        let _ = c.take_freed_cold();
                    }
                    _ => {}
                }
                Ok(())
            })();
            if let Err(err) = r {
                if matches!(err, CoordError::Invariant(_)) {
                    failures += 1;
                    println!("round {round} step {step} op {op}: {err}");
                    break;
                }
            }
        }
    }
    println!("done, {failures} invariant failures");
}
