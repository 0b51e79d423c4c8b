#!/usr/bin/env python3
"""The pass-key items of a kvforge ablation through NVIDIA kvpress's presses.

`cargo xtask ablate --config configs/passkey.toml` writes the items it ran
(context and question token ids, the key) to `passkey_items.jsonl`; this
script runs the very same tokens through Hugging Face transformers (our GGUF
loaded as LlamaForCausalLM) with each press compressing the context during
prefill, then asks the question with greedy decoding, as kvpress's own
pipeline does (positions continue from the uncompressed length). The press
never sees the question, unless the items were written with
`question_seen = true`: then their context holds the question but its last
token, and the press compresses both. It writes `kvpress.csv`, then a table and a plot that
hold both: kvforge's results (`results.csv` beside the items) and the
presses', accuracy against the share of the context's KV kept.

Needs `cargo xtask setup --reference` (kvpress 0.5.5, transformers 4.57.6,
matplotlib). Usage:

    .venv/bin/python scripts/kvpress_passkey.py [RUN_DIR] [--ratios 0.25,0.5,0.75]
        [--presses KeyDiff,StreamingLLM] [--kvforge-press]

`--kvforge-press` adds kvforge's numpy KeyDiff run inside kvpress's pipeline
(`kvforge.kvpress.PolicyPress`, configs/passkey-press.toml's sink and
windows): plotted with kvforge's squares, labelled as a press.

Presses that download from the Hugging Face hub (QFilter, KVzip's trained
variants, DuoAttention's patterns, ExpectedAttention with precomputed
statistics) cannot run offline and are left out.
"""

import argparse
import csv
import json
import os
import re
import shlex
import sys
import time

import torch

MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def presses(kv_kept):
    """(name, press, needs eager attention) for a share of the KV kept."""
    from kvpress import (
        AdaKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        ObservedAttentionPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    r = 1.0 - kv_kept  # kvpress's compression ratio: the share removed
    return [
        ("StreamingLLM", StreamingLLMPress(compression_ratio=r), False),
        ("SnapKV", SnapKVPress(compression_ratio=r), False),
        ("TOVA", TOVAPress(compression_ratio=r), False),
        ("KeyDiff", KeyDiffPress(compression_ratio=r), False),
        ("Knorm", KnormPress(compression_ratio=r), False),
        ("ExpectedAttention", ExpectedAttentionPress(compression_ratio=r), False),
        ("ObservedAttention", ObservedAttentionPress(compression_ratio=r), True),
        ("AdaKV(SnapKV)", AdaKVPress(SnapKVPress(compression_ratio=r)), False),
    ]


def kvforge_presses(kv_kept):
    """kvforge's numpy KeyDiff (kvforge/examples/keydiff.py) as a kvpress
    press, each layer choosing its own blocks and all layers choosing
    together (as kvforge's engine does): the sink and window of
    configs/passkey-press.toml's rows."""
    from kvforge.examples.keydiff import KeyDiff
    from kvforge.kvpress import PolicyPress

    window = 256 if kv_kept >= 0.5 else 128
    out = []
    for across, how in ((False, "per layer"), (True, "across layers")):
        press = PolicyPress(
            lambda budget: KeyDiff(budget_tokens=budget, sink=32, window=window),
            compression_ratio=1.0 - kv_kept,
            block_size=32,
            across_layers=across,
        )
        out.append((f"kvforge KeyDiff press (numpy, pages of 32, window {window}, {how})", press, False))
    return out


def rust_twin(run, press, share):
    """The per-item results of kvforge's own run of a kvforge press's
    policy (configs/passkey-press.toml's `keydiff-kvNN` rows), or None."""
    path = os.path.join(run, "results.csv")
    if not press.startswith("kvforge KeyDiff press") or not os.path.exists(path):
        return None
    config = f"keydiff-kv{round(share * 100)}"
    got = {r["item"]: int(float(r["correct"])) for r in csv.DictReader(open(path)) if r["config"] == config and r["correct"]}
    return (config, got) if got else None


def first_number(text):
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


@torch.no_grad()
def answer(model, press, context, question, max_new_tokens=8):
    """kvpress's pipeline, on token ids: prefill the context under the press,
    then greedy decoding of the question at the uncompressed positions."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = torch.tensor([context])
    if press is None:
        model.model(input_ids=ctx, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ctx, past_key_values=cache)
    kept = cache.get_seq_length()
    n = len(context)
    q = torch.tensor([question])
    pos = torch.arange(n, n + len(question)).unsqueeze(0)
    out = model(input_ids=q, past_key_values=cache, position_ids=pos, logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    p = n + len(question)
    for i in range(max_new_tokens - 1):
        out = model(
            input_ids=torch.tensor([[ids[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[p + i]]),
        )
        ids.append(int(out.logits[0, -1].argmax()))
    return ids, kept


def load(attn):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(MODEL))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=torch.float32, attn_implementation=attn
    ).eval()
    return tok, model


def kvforge_rows(run):
    """kvforge's pass-key rows: (config, share of the full run's KV after
    the answer, share of its peak KV, correct, items)."""
    path = os.path.join(run, "results.csv")
    if not os.path.exists(path):
        return []
    rows = [r for r in csv.DictReader(open(path)) if r["workload"] == "passkey" and not r["error"]]
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    full = by.get("full") or by.get("baseline")
    if not full:
        return []
    def mean(rs, col):
        return sum(float(r.get(col) or r["kv_bytes"]) for r in rs) / len(rs)

    out = []
    for name, rs in by.items():
        end = mean(rs, "end_kv_bytes") / mean(full, "end_kv_bytes")
        peak = mean(rs, "kv_bytes") / mean(full, "kv_bytes")
        out.append((name, end, peak, sum(int(float(r["correct"])) for r in rs), len(rs)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", default="target/ablate/passkey")
    ap.add_argument("--ratios", default="0.25,0.5,0.75", help="shares of the KV kept")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="another kvforge run on the very same items whose configurations join the table",
    )
    ap.add_argument(
        "--presses",
        default="",
        help="comma-separated kvpress press names to run (default: all)",
    )
    ap.add_argument(
        "--kvforge-press",
        action="store_true",
        help="also run kvforge's numpy KeyDiff inside kvpress's pipeline (kvforge.kvpress.PolicyPress)",
    )
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="rebuild the table and plot from kvpress.csv and results.csv (no model run)",
    )
    a = ap.parse_args()
    items_path = os.path.join(a.run, "passkey_items.jsonl")
    if not os.path.exists(items_path):
        sys.exit(f"kvpress_passkey: {items_path} is missing; run `cargo xtask ablate --config configs/passkey.toml` first")
    try:
        import kvpress  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as e:
        sys.exit(f"kvpress_passkey: {e}; run `cargo xtask setup --reference`")
    items = [json.loads(l) for l in open(items_path)]
    same = [(it["item"], it["context"], it["question"], it["key"]) for it in items]
    for other in a.also:
        path = os.path.join(other, "passkey_items.jsonl")
        if not os.path.exists(path):
            sys.exit(f"kvpress_passkey: {path} is missing")
        theirs = [json.loads(l) for l in open(path)]
        if [(it["item"], it["context"], it["question"], it["key"]) for it in theirs] != same:
            sys.exit(f"kvpress_passkey: {path} holds other items than {items_path}")
    kept = [float(x) for x in a.ratios.split(",")]
    out_csv = os.path.join(a.run, "kvpress.csv")
    if a.table_only:
        if not os.path.exists(out_csv):
            sys.exit(f"kvpress_passkey: {out_csv} is missing; run without --table-only first")
        rows = []
        for r in csv.DictReader(open(out_csv)):
            for k in ("kv_kept", "depth"):
                r[k] = float(r[k])
            for k in ("correct", "kv_tokens", "context_tokens"):
                r[k] = int(r[k])
            rows.append(r)
        report(a, items, items_path, rows, out_csv, time.time())
        return
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    models = {}
    rows = []
    t0 = time.time()

    def run(name, press, eager, share):
        attn = "eager" if eager else "sdpa"
        if attn not in models:
            models[attn] = load(attn)
        tok, model = models[attn]
        for it in items:
            ids, cached = answer(model, press, it["context"], it["question"])
            text = tok.decode(ids, skip_special_tokens=True)
            rows.append(
                {
                    "press": name,
                    "kv_kept": share,
                    "item": it["item"],
                    "depth": it["depth"],
                    "correct": int(first_number(text) == it["key"]),
                    "kv_tokens": cached,
                    "context_tokens": len(it["context"]),
                    "answer": text.strip(),
                }
            )
        done = [r for r in rows if r["press"] == name and r["kv_kept"] == share]
        print(f"{name} at {share:.2f}: {sum(r['correct'] for r in done)}/{len(done)}  ({time.time() - t0:.0f} s)", flush=True)

    run("full cache", None, False, 1.0)
    only = {p for p in a.presses.split(",") if p}
    for share in kept:
        chosen = [p for p in presses(share) if not only or p[0] in only]
        if a.kvforge_press:
            chosen += kvforge_presses(share)
        for name, press, eager in chosen:
            run(name, press, eager, share)

    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    report(a, items, items_path, rows, out_csv, t0)


def report(a, items, items_path, rows, out_csv, t0):
    """kvpress.md and passkey_vs_kvpress.png: the presses' rows and
    kvforge's."""
    # One table, one plot: kvforge's configurations and the presses.
    from importlib.metadata import version

    table = []
    for (name, share) in dict.fromkeys((r["press"], r["kv_kept"]) for r in rows):
        rs = [r for r in rows if r["press"] == name and r["kv_kept"] == share]
        kv = sum(r["kv_tokens"] / r["context_tokens"] for r in rs) / len(rs)
        if name.startswith("AdaKV"):
            # AdaKV masks entries instead of removing them: the cache keeps
            # its length, the share attended to is the target.
            kv, name = share, name + " (masked; target share)"
        label = name if name.startswith("kvforge ") else "kvpress " + name
        table.append((label, share, kv, None, sum(r["correct"] for r in rs), len(rs)))
    seen_names = set()
    for run in [a.run] + a.also:
        for name, kv, peak, ok, n in kvforge_rows(run):
            if name not in seen_names:
                seen_names.add(name)
                table.append(("kvforge " + name, None, kv, peak, ok, n))
    lengths = sorted({it["length"] for it in items})
    seen = any(it.get("question_seen") for it in items)
    if seen:
        how = (
            "The question is seen by the compression: kvpress compresses the context and the question "
            "but its last token; kvforge prefills the same tokens in one chunk and evicts once, before "
            "the last token's step."
        )
    else:
        how = (
            "The question is not seen by the compression: kvpress compresses the context after prefill; "
            "kvforge evicts while the context streams in (chunks of the experiment file), then the "
            "question is asked."
        )
    md = [
        "# Pass key: kvforge and kvpress on the same items",
        "",
        f"{len(items)} items of {'/'.join(map(str, lengths))} tokens from `{items_path}` (SmolLM2-135M, "
        f"f32 weights on CPU; kvforge's hot KV in f16). kvpress {version('kvpress')} runs in "
        "transformers (sdpa; eager for ObservedAttention). " + how + " `KV kept` is the cache after "
        "compression against the full cache's (kvpress: tokens kept per layer and head, mean, against "
        "the context; kvforge: KV bytes after the answer, question and answer included); `peak` is "
        "kvforge's largest KV footprint during the item against the full cache's.",
        "",
        "| method | target KV | KV kept | peak | correct | accuracy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, share, kv, peak, ok, n in sorted(table, key=lambda t: (t[2], t[0])):
        tgt = "–" if share is None else f"{share:.0%}"
        pk = "–" if peak is None else f"{peak:.0%}"
        md.append(f"| {name} | {tgt} | {kv:.0%} | {pk} | {ok}/{n} | {ok / n:.0%} |")
    md.append("")
    pairs = []
    for name, share in dict.fromkeys((r["press"], r["kv_kept"]) for r in rows):
        twin = rust_twin(a.run, name, share)
        if twin is None:
            continue
        config, rust = twin
        rs = [r for r in rows if r["press"] == name and r["kv_kept"] == share and r["item"] in rust]
        agree = sum(r["correct"] == rust[r["item"]] for r in rs)
        only_press = sum(r["correct"] and not rust[r["item"]] for r in rs)
        only_rust = sum(rust[r["item"]] and not r["correct"] for r in rs)
        pairs.append(f"| {name} | kvforge {config} | {agree}/{len(rs)} | {only_press} | {only_rust} |")
    if pairs:
        md += [
            "Item by item, each kvforge press against kvforge's own run of the same policy at the same share:",
            "",
            "| press | kvforge run | same outcome | right only in the press | right only in kvforge |",
            "|---|---|---:|---:|---:|",
            *pairs,
            "",
        ]
    command = " ".join(shlex.quote(x) for x in [".venv/bin/python", "scripts/kvpress_passkey.py", *sys.argv[1:]])
    if a.table_only:
        md.append(f"This table rebuilt by `{command}` from the presses' `kvpress.csv` and kvforge's `results.csv`.")
    else:
        md.append(f"`{command}`, {time.time() - t0:.0f} s.")
    with open(os.path.join(a.run, "kvpress.md"), "w") as f:
        f.write("\n".join(md) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for prefix, marker in (("kvpress ", "o"), ("kvforge ", "s")):
        pts = [t for t in table if t[0].startswith(prefix)]
        for name, _, kv, _, ok, n in pts:
            ax.scatter(kv, ok / n, marker=marker)
            ax.annotate(name, (kv, ok / n), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("share of the context's KV kept")
    ax.set_ylabel("pass-key accuracy")
    q = "question seen" if seen else "question not seen"
    ax.set_title(f"Pass key at {'/'.join(map(str, lengths))} tokens, {q}: kvforge (squares) and kvpress (circles)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.run, "passkey_vs_kvpress.png"), dpi=110)
    print(f"wrote {out_csv}, kvpress.md, passkey_vs_kvpress.png in {a.run}")


if __name__ == "__main__":
    main()
