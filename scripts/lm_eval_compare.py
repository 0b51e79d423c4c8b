"""lm-evaluation-harness on `kvforge serve` beside the same model in transformers.

Run by `cargo xtask lm-eval` (which builds the server and the harness's
venv): builds a multiple-choice task from the bench's own essays (which
sentence comes next: the essay's own or one of three from other essays),
serves the default GGUF with `kvforge serve` on a loopback port, runs the
harness's `local-completions` model on it (loglikelihoods through `echo`
and `logprobs`, tokens through the server's `/tokenize`), runs the
harness's `hf` model on the same GGUF (transformers dequantizes it to
f32), and writes both accuracies, their difference against its standard
error, and the per-choice loglikelihood differences to OUT.
"""

import argparse
import glob
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

TASK = "kvforge_next_sentence"


def sentences(text):
    text = re.sub(r"\s+", " ", text)
    # The essays' paragraphs run together ("accelerating.We"): cut there too.
    text = re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text)
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text) if s.strip()]


def build_task(essays_dir, items, task_dir, seed=0):
    """`items` questions: three sentences of an essay, then the next one
    among three sentences of other essays (the gold's place drawn)."""
    rng = random.Random(seed)
    essays = {}
    for path in sorted(glob.glob(os.path.join(essays_dir, "*.txt"))):
        with open(path, encoding="utf-8") as f:
            ok = [s for s in sentences(f.read()) if 40 <= len(s) <= 200]
        if len(ok) >= 8:
            essays[os.path.basename(path)] = ok
    if len(essays) < 2:
        raise SystemExit(f"too few essays in {essays_dir}: run `cargo xtask setup`")
    names = sorted(essays)
    docs = []
    while len(docs) < items:
        name = rng.choice(names)
        ss = essays[name]
        i = rng.randrange(3, len(ss))
        others = [n for n in names if n != name]
        wrong = [rng.choice(essays[rng.choice(others)]) for _ in range(3)]
        gold = rng.randrange(4)
        choices = wrong[:gold] + [ss[i]] + wrong[gold:]
        docs.append({"id": len(docs), "essay": name, "context": " ".join(ss[i - 3:i]),
                     "choices": choices, "gold": gold})
    os.makedirs(task_dir, exist_ok=True)
    data = os.path.join(task_dir, "next_sentence.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(os.path.join(task_dir, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(data)}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return len(docs)


def start_server(serve, model, name):
    p = subprocess.Popen([serve, "--model", model, "--port", "0", "--served-model-name", name,
                          "--max-batch", "4"], stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    m = re.search(r"http://(\S+)", line)
    if not m:
        p.kill()
        raise SystemExit(f"kvforge serve did not start: {line!r}")
    # Keep draining its log so it never blocks.
    import threading
    threading.Thread(target=lambda: p.stderr.read(), daemon=True).start()
    return p, m.group(1)


def lm_eval(args, out):
    cmd = [sys.executable, "-m", "lm_eval", *args, "--output_path", out, "--log_samples"]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, check=True, env=env)


def read_run(out):
    """The results and the per-document loglikelihoods of one run."""
    results = sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))
    samples = sorted(glob.glob(os.path.join(out, "**", f"samples_{TASK}_*.jsonl"), recursive=True))
    if not results or not samples:
        raise SystemExit(f"no lm-eval output under {out}")
    with open(results[-1]) as f:
        r = json.load(f)["results"][TASK]
    lls = {}
    with open(samples[-1]) as f:
        for line in f:
            s = json.loads(line)
            lls[s["doc_id"]] = [float(x[0][0]) for x in s["resps"]]
    return r, lls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", required=True, help="the kvforge-serve binary")
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--essays", required=True, help="the essays' directory")
    ap.add_argument("--limit", type=int, default=300, help="questions (default 300)")
    ap.add_argument("--work", required=True, help="a scratch directory")
    ap.add_argument("--out", required=True, help="where the comparison goes")
    a = ap.parse_args()
    if a.limit < 1:
        raise SystemExit("--limit must be at least 1")
    task_dir = os.path.join(a.work, "task")
    n = build_task(a.essays, a.limit, task_dir)
    name = os.path.splitext(os.path.basename(a.model))[0]
    runs = {}
    server, addr = start_server(a.serve, a.model, name)
    try:
        t0 = time.time()
        lm_eval(["--model", "local-completions", "--model_args",
                 f"model={name},base_url=http://{addr}/v1/completions,num_concurrent=1,"
                 "max_retries=1,tokenized_requests=True,tokenizer_backend=remote",
                 "--tasks", TASK, "--include_path", task_dir], os.path.join(a.work, "kvforge"))
        runs["kvforge serve"] = time.time() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    t0 = time.time()
    lm_eval(["--model", "hf", "--model_args",
             f"pretrained={os.path.dirname(os.path.abspath(a.model))},"
             # transformers reads this GGUF's tokenizer as LLaMA's, which
             # prepends <|im_start|> as a BOS; SmolLM2 has none, and kvforge
             # adds none.
             f"gguf_file={os.path.basename(a.model)},dtype=float32,add_bos_token=False",
             "--device", "cpu", "--batch_size", "1",
             "--tasks", TASK, "--include_path", task_dir], os.path.join(a.work, "hf"))
    runs["transformers"] = time.time() - t0
    (kr, kll), (hr, hll) = read_run(os.path.join(a.work, "kvforge")), read_run(os.path.join(a.work, "hf"))
    diffs = [abs(x - y) for d in kll if d in hll for x, y in zip(kll[d], hll[d])]
    same_pick = sum(max(range(4), key=lambda i: kll[d][i]) == max(range(4), key=lambda i: hll[d][i])
                    for d in kll if d in hll)
    rows = []
    for metric in ("acc,none", "acc_norm,none"):
        k, h = kr[metric], hr[metric]
        se = math.hypot(kr[metric.replace(",", "_stderr,")], hr[metric.replace(",", "_stderr,")])
        rows.append((metric.split(",")[0], k, h, k - h, se))
    os.makedirs(a.out, exist_ok=True)
    summary = {"task": TASK, "questions": n, "chance": 0.25,
               "kvforge": kr, "transformers": hr, "seconds": runs,
               "loglikelihood_abs_diff_max": max(diffs), "loglikelihood_abs_diff_mean": sum(diffs) / len(diffs),
               "same_choice": same_pick}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    lines = [f"# lm-evaluation-harness: kvforge serve beside transformers ({n} questions)", "",
             "| metric | kvforge serve | transformers | difference | its standard error |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {m} | {k:.4f} | {h:.4f} | {d:+.4f} | {se:.4f} |" for m, k, h, d, se in rows]
    lines += ["", f"Per choice, |loglikelihood difference|: max {max(diffs):.2e}, mean "
              f"{sum(diffs) / len(diffs):.2e} over {len(diffs)} choices; the same choice picked "
              f"in {same_pick} of {len(kll)} questions. Wall time: kvforge serve "
              f"{runs['kvforge serve']:.0f} s, transformers {runs['transformers']:.0f} s."]
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    worst = max(abs(d) / max(se, 1e-9) for _, _, _, d, se in rows)
    if worst > 2:
        raise SystemExit(f"the accuracies differ by {worst:.1f} standard errors")


if __name__ == "__main__":
    main()
