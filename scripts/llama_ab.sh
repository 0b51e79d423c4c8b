#!/usr/bin/env bash
# kvforge beside llama.cpp's llama-bench on the same GGUF, same 2 threads,
# interleaved (issue 44's anchor): each round runs
#   llama-bench -t 2 -fa 1 -p 512 -n 128 -d 0,2048 -r 1 -o jsonl
# then `kvforge bench --max-tokens 128` at contexts 1 (tg128 at depth 0),
# 512 (pp512 and its decode) and 2048 (tg128 at depth 2048), and prints
# the medians over rounds of each side and their ratios.
# Usage: scripts/llama_ab.sh [ROUNDS] [MODEL] [extra kvforge bench flags]
# Needs `cargo build --release -p kvforge-engine --bin kvforge` and
# scripts/llama_bench.sh's build (run it once). Raw lines go to
# target/llama-ab/raw.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
MODEL=${2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift 2 || shift $# || true
LLAMA=target/llama-bench/build/bin/llama-bench
KV=target/release/kvforge
TEXT=data/exllamav2/wiki.utf8
for f in "$LLAMA" "$KV"; do
    if [ ! -x "$f" ]; then
        echo "llama_ab: $f missing (scripts/llama_bench.sh; cargo build --release -p kvforge-engine --bin kvforge)" >&2
        exit 1
    fi
done
OUT=target/llama-ab
mkdir -p "$OUT"
RAW=$OUT/raw.jsonl
: > "$RAW"
export LD_LIBRARY_PATH="$PWD/.venv/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for r in $(seq 1 "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    "$LLAMA" -m "$MODEL" -t 2 -fa 1 -p 512 -n 128 -d 0,2048 -r 1 -o jsonl 2>/dev/null |
        sed "s/^{/{\"side\":\"llama.cpp\",\"round\":$r,/" >> "$RAW"
    for ctx in 1 512 2048; do
        "$KV" bench --model "$MODEL" --text "$TEXT" --context "$ctx" --max-tokens 128 \
            --threads 2 "$@" 2>/dev/null |
            sed "s/^{/{\"side\":\"kvforge\",\"round\":$r,/" >> "$RAW"
    done
done
python3 - "$RAW" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = lambda xs: statistics.median(xs) if xs else float("nan")
def llama(n_prompt, n_gen, depth):
    return med([r["avg_ts"] for r in rows if r["side"] == "llama.cpp"
                and r["n_prompt"] == n_prompt and r["n_gen"] == n_gen
                and r.get("n_depth", 0) == depth])
def kv(ctx, key):
    return med([r[key] for r in rows if r["side"] == "kvforge" and r["context"] == ctx])
n = len({r["round"] for r in rows})
print(f"{n} rounds, interleaved, medians (tokens/s)\n")
print("| measure | llama.cpp | kvforge | × llama.cpp |\n|---|---:|---:|---:|")
for name, l, k in [
    ("tg128 @ d0", llama(0, 128, 0), kv(1, "decode_tok_s")),
    ("tg128 @ d2048", llama(0, 128, 2048), kv(2048, "decode_tok_s")),
    ("pp512 @ d0", llama(512, 0, 0), kv(512, "prefill_tok_s")),
]:
    print(f"| {name} | {l:.2f} | {k:.2f} | {k / l:.2f} |")
print(f"\nkvforge decode at 512 tokens of context: {kv(512, 'decode_tok_s'):.2f}; "
      f"llama.cpp pp512 @ d2048: {llama(512, 0, 2048):.2f}")
EOF
