#!/usr/bin/env bash
# Decode and prefill speed of `kvforge bench` at an older commit against the
# working tree, interleaved (the order alternates every round) so machine
# noise hits both alike; prints the medians.
#
#   scripts/ab_commits.sh OLD_COMMIT [ROUNDS]
#
# Builds the old binary in a git worktree under /tmp (target dir
# target/oldbench), the new one with `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: scripts/ab_commits.sh OLD_COMMIT [ROUNDS]}
rounds=${2:-5}
tree=/tmp/kvforge-ab-$old
[ -d "$tree" ] || git worktree add -f "$tree" "$old" >/dev/null
root=$PWD
(cd "$tree" && LIBTORCH="$root/.venv/libtorch" CARGO_TARGET_DIR="$root/target/oldbench" \
  cargo build --release -q -p kvforge-engine --bin kvforge)
cargo build --release -q -p kvforge-engine --bin kvforge
OLD=target/oldbench/release/kvforge
NEW=target/release/kvforge
out=$(mktemp)
for cfg in "plain|" "int4|--kv-quant int4 --block-size 32"; do
  name=${cfg%%|*}; extra=${cfg#*|}
  for r in $(seq "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
    for w in $order; do
      bin=$OLD; [ "$w" = new ] && bin=$NEW
      # shellcheck disable=SC2086
      line=$($bin bench --text data/exllamav2/wiki.utf8 --context 1024 --max-tokens 48 --ignore-eos $extra 2>/dev/null | tail -1)
      echo "$name $w $line" >> "$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics as st, sys
runs = {}
for line in open(sys.argv[1]):
    name, which, js = line.split(" ", 2)
    j = json.loads(js)
    runs.setdefault((name, which), []).append((j["decode_tok_s"], j["prefill_tok_s"]))
for name in sorted({k[0] for k in runs}):
    o, n = runs[(name, "old")], runs[(name, "new")]
    md = lambda v, i: st.median(x[i] for x in v)
    print(f"{name}: decode tok/s old {md(o,0):.2f} new {md(n,0):.2f} (x{md(n,0)/md(o,0):.3f}); "
          f"prefill tok/s old {md(o,1):.1f} new {md(n,1):.1f} (x{md(n,1)/md(o,1):.3f})")
PY
