#!/usr/bin/env python3
"""kvforge's quantized cache against transformers' own QuantizedCache
(optimum-quanto backend) inside Hugging Face transformers, side by side.

SmolLM2-135M (our GGUF, f32 weights on the CPU) streams the longest
Wikipedia articles of `data/exllamav2/wiki.utf8`, concatenated to
`--context` tokens: a prefix of 512 tokens, then chunks of 64, every token
after the prefix scored (the protocol of the ablation's stream workload).
Each cache runs the very same tokens:

* `DynamicCache`, the full cache (the baseline);
* `kvforge.hf.QuantizedCache`: INT8 / INT4 / INT2, sink 32 and hot window
  128 in full precision, groups of 32, keys per channel (KIVI);
* transformers' `QuantoQuantizedCache`: INT4 / INT2, residual 128, groups
  of 64 (its defaults but the residual; axis 0).

Reported: perplexity and its change against the full cache with a 95%
paired moving-block bootstrap interval over the scored chunks (blocks of 8
chunks, seeded); the KV bytes each cache holds at the end, as in an f16
model (full-precision tokens at 2 bytes an element, quantized codes as
stored, group parameters at 2 bytes each); then decode: 3 interleaved
rounds of 8 greedy steps per cache after the stream, median seconds per
step.

Needs `cargo xtask setup --reference` (optimum-quanto). Usage:

    .venv/bin/python scripts/hf_cache_compare.py [--context 4096] [--out docs/results/hf-cache]
"""

import argparse
import csv
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "data/exllamav2/wiki.utf8"
PREFIX, CHUNK, BLOCK = 512, 64, 8


def articles(text):
    """The `<doc>` articles of an exllamav2 calibration file, longest first
    (as `kvforge_engine::ppl::articles`)."""
    docs, cur = [], []
    for line in text.splitlines():
        if line.startswith("<doc") or line.startswith("</doc>"):
            if "".join(cur).strip():
                docs.append("".join(cur))
            cur = []
            continue
        cur.append(line + "\n")
    if "".join(cur).strip():
        docs.append("".join(cur))
    return sorted(docs, key=len, reverse=True)


def caches(config):
    import kvforge.hf
    from transformers import DynamicCache, QuantizedCache

    kv = lambda fmt: lambda: kvforge.hf.QuantizedCache(config, format=fmt, window=128, sink=32, group=32)  # noqa: E731
    quanto = lambda bits: lambda: QuantizedCache(  # noqa: E731
        "quanto", config, nbits=bits, residual_length=128, q_group_size=64
    )
    return [
        ("full cache (DynamicCache)", DynamicCache),
        ("kvforge int8", kv("int8")),
        ("kvforge int4", kv("int4")),
        ("kvforge int2", kv("int2")),
        ("quanto int4", quanto(4)),
        ("quanto int2", quanto(2)),
    ]


def f16_bytes(cache):
    """KV bytes as in an f16 model: full-precision elements at 2 bytes,
    quantized codes as stored, group parameters at 2 bytes each."""
    import kvforge.hf

    if isinstance(cache, kvforge.hf.QuantizedCache):
        total = 0
        for layer in cache.layers:
            b = layer.nbytes()
            total += b["hot"] // layer.keys.element_size() * 2 + b["cold"]
        return total
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.numel() * 2
        for name in ("_quantized_keys", "_quantized_values"):
            q = getattr(layer, name, None)
            if q is None:
                continue
            total += stored_bytes(q)
    return total


def stored_bytes(t):
    """Bytes of a quanto tensor's storage: its inner tensors, recursively
    (a packed tensor reports its unpacked shape but holds uint8 storage);
    codes as stored, scales and shifts at 2 bytes an element."""
    if hasattr(t, "__tensor_flatten__"):
        inner, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, a)) for a in inner)
    return t.numel() * (t.element_size() if t.dtype in (torch.uint8, torch.int8) else 2)


def stream(model, ids, cache):
    """Per-chunk (tokens, NLL sum) after the prefix, and the seconds it took."""
    t0 = time.perf_counter()
    chunks = []
    with torch.no_grad():
        last = model(ids[:, :PREFIX], past_key_values=cache, use_cache=True).logits[:, -1:]
        for s in range(PREFIX, ids.shape[1], CHUNK):
            piece = ids[:, s:s + CHUNK]
            logits = torch.cat([last, model(piece, past_key_values=cache, use_cache=True).logits], dim=1)
            lp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
            nll = -lp.gather(1, piece[0, :, None]).sum().item()
            chunks.append((piece.shape[1], nll))
            last = logits[:, -1:]
    return chunks, last, time.perf_counter() - t0


def decode(model, cache, last, steps):
    """`steps` greedy steps from `last`'s logits; seconds per step."""
    out = []
    tok = last[:, -1].argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(tok, past_key_values=cache, use_cache=True).logits
            out.append(time.perf_counter() - t0)
            tok = logits[:, -1].argmax(-1, keepdim=True)
    return out, logits


def ppl_change(ours, base, seed=7, rounds=2000):
    """ppl / ppl_base − 1 over paired chunks, with a 95% moving-block
    bootstrap interval (blocks of BLOCK chunks)."""
    n = np.array([c[0] for c in ours], float)
    d = np.array([a[1] - b[1] for a, b in zip(ours, base)])
    point = np.exp(d.sum() / n.sum()) - 1
    rng = np.random.default_rng(seed)
    m = len(d)
    starts = max(m - BLOCK + 1, 1)
    stats = []
    for _ in range(rounds):
        idx = np.concatenate([np.arange(s, min(s + BLOCK, m)) for s in rng.integers(0, starts, -(-m // BLOCK))])[:m]
        stats.append(np.exp(d[idx].sum() / n[idx].sum()) - 1)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return point, lo, hi


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", default="docs/results/hf-cache")
    a = ap.parse_args()
    if a.context <= PREFIX + CHUNK:
        sys.exit(f"hf_cache_compare: --context must exceed {PREFIX + CHUNK} tokens")
    try:
        import optimum.quanto  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        sys.exit(f"hf_cache_compare: {e}; run `cargo xtask setup --reference`")
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    # quanto's kernels build with the venv's ninja, run by name.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    d, f = os.path.split(os.path.abspath(MODEL))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ids = []
    for art in articles(open(TEXT, encoding="utf-8").read()):
        ids += tok(art, add_special_tokens=False).input_ids
        if len(ids) >= a.context:
            break
    ids = torch.tensor([ids[: a.context]])
    # quanto compiles its C++ kernels on first use: once, before anything
    # is timed.
    warm = caches(model.config)[4][1]()
    warm.update(torch.randn(1, 3, 256, 64), torch.randn(1, 3, 256, 64), 0)
    warm.update(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), 0)
    t0 = time.time()
    rows, live = [], []
    for name, make in caches(model.config):
        cache = make()
        chunks, last, secs = stream(model, ids, cache)
        rows.append({"cache": name, "chunks": chunks, "stream_s": secs, "kv_bytes": f16_bytes(cache), "steps": []})
        live.append((cache, last))
        print(f"{name}: ppl {np.exp(sum(c[1] for c in chunks) / sum(c[0] for c in chunks)):.4f}, {secs:.0f} s", flush=True)
    for _ in range(3):
        for i, row in enumerate(rows):
            cache, last = live[i]
            steps, last = decode(model, cache, last, 8)
            row["steps"] += steps
            live[i] = (cache, last)
    base = rows[0]
    tokens = sum(c[0] for c in base["chunks"])
    os.makedirs(a.out, exist_ok=True)
    table = []
    for r in rows:
        ppl = np.exp(sum(c[1] for c in r["chunks"]) / tokens)
        ch = None if r is base else ppl_change(r["chunks"], base["chunks"])
        table.append((r["cache"], ppl, ch, r["kv_bytes"], r["kv_bytes"] / base["kv_bytes"],
                      float(np.median(r["steps"])), float(np.mean(r["steps"]))))
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["cache", "ppl", "change", "change_lo", "change_hi", "kv_bytes_f16", "kv_share",
                    "decode_s_per_step_median", "decode_s_per_step_mean"])
        for name, ppl, ch, kvb, share, step, avg in table:
            w.writerow([name, ppl, *(ch if ch else ("", "", "")), kvb, share, step, avg])
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short=12", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    from importlib.metadata import version

    md = [
        "# kvforge's quantized cache against transformers' QuantizedCache (quanto)",
        "",
        f"SmolLM2-135M (f32 weights, CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} threads), "
        f"{a.context} tokens of the longest Wikipedia articles of `{TEXT}`: prefix {PREFIX}, then chunks of "
        f"{CHUNK}, {tokens} tokens scored ({len(base['chunks'])} chunks). transformers {version('transformers')}, "
        f"optimum-quanto {version('optimum-quanto')}, kvforge at `{commit}`. kvforge: sink 32 and window 128 in full "
        "precision, groups of 32, keys per channel, values per token; quanto: residual 128, groups of 64, axis 0, no "
        "sink, and the 512-token prefix quantized at once (its own layer's behaviour); quanto requantizes its whole "
        "cache when the residual fills (every 128 tokens), kvforge quantizes one block as it leaves the window. "
        "Change: against the full cache on the very same chunks, 95% paired moving-block bootstrap interval (blocks of "
        f"{BLOCK} chunks); **bold** when it excludes zero. KV: bytes held after the stream, as in an f16 model "
        "(full-precision elements at 2 bytes, codes as stored, group parameters at 2 bytes). Decode: 3 interleaved "
        "rounds of 8 greedy steps per cache after the stream, median and mean (the mean carries the steps that "
        "requantize or demote).",
        "",
        "| cache | perplexity | change | KV MiB | KV vs full | decode ms/step (median) | mean | decode vs full (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, ppl, ch, kvb, share, step, avg in table:
        if ch is None:
            cell = "–"
        else:
            c = f"{100 * ch[0]:+.2f}% [{100 * ch[1]:+.2f}, {100 * ch[2]:+.2f}]"
            cell = f"**{c}**" if ch[1] > 0 or ch[2] < 0 else c
        md.append(
            f"| {name} | {ppl:.4f} | {cell} | {kvb / 2**20:.1f} | {share:.0%} | {1000 * step:.1f} | {1000 * avg:.1f} | "
            f"{table[0][5] / step:.2f}× |"
        )
    md += ["", f"`.venv/bin/python scripts/hf_cache_compare.py --context {a.context} --out {a.out}`, {time.time() - t0:.0f} s."]
    with open(os.path.join(a.out, "report.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
