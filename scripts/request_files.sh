#!/usr/bin/env bash
# Which of the workspace's files one chat completion runs through in
# `kvforge serve`: the line coverage of a server that starts and stops
# against one that also answers one request (greedy, 16 tokens); a file
# counts when its executed-line counts grow. Builds the server at COMMIT
# (a git worktree) with `-C instrument-coverage` in target/request-files.
#
#   scripts/request_files.sh [COMMIT]     (default: HEAD)
#
# Needs `cargo xtask setup` (the venv, the model) and rustup's llvm-tools
# component (`rustup component add llvm-tools`). Not part of CI.
set -euo pipefail
root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$root" rev-parse --short "${1:-HEAD}")
out=$root/target/request-files
tree=$out/tree-$commit
bin=$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin
port=${PORT:-8931}
model=${MODEL:-SmolLM2-135M-Instruct.Q4_1}
mkdir -p "$out"
[ -x "$bin/llvm-profdata" ] || { echo "llvm-tools missing: rustup component add llvm-tools" >&2; exit 1; }
[ -d "$tree" ] || git -C "$root" worktree add -q --detach "$tree" "$commit"
ln -sfn "$root/.venv" "$tree/.venv"
ln -sfn "$root/models" "$tree/models"
(cd "$tree" && RUSTFLAGS="-C instrument-coverage" CARGO_TARGET_DIR=$out/target \
    cargo build -q -p kvforge-server --bin kvforge-serve)
serve=$out/serve-$commit
cp "$out/target/debug/kvforge-serve" "$serve"
rm -f "$out/$commit"-*.profraw
for run in idle request; do
    LLVM_PROFILE_FILE="$out/$commit-$run-%p.profraw" "$serve" --port "$port" --threads 2 \
        > "$out/$commit-$run.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
        curl -s -o /dev/null "http://127.0.0.1:$port/v1/models" && break
        sleep 0.5
    done
    if [ "$run" = request ]; then
        curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
            -d "{\"model\":\"$model\",\"messages\":[{\"role\":\"user\",\"content\":\"What is a KV cache?\"}],\"max_tokens\":16,\"temperature\":0}" \
            > "$out/$commit-answer.json"
        grep -q '"choices"' "$out/$commit-answer.json" || { cat "$out/$commit-answer.json" >&2; kill -TERM $pid; exit 1; }
    fi
    kill -TERM $pid
    wait $pid || true
    "$bin/llvm-profdata" merge -sparse "$out/$commit-$run"-*.profraw -o "$out/$commit-$run.profdata"
    "$bin/llvm-cov" export -format=lcov -instr-profile "$out/$commit-$run.profdata" "$serve" \
        > "$out/$commit-$run.lcov"
done
python3 - "$tree" "$out/$commit-idle.lcov" "$out/$commit-request.lcov" <<'PY'
import sys
tree, idle, request = sys.argv[1:]
def hits(path):
    out, cur = {}, None
    for line in open(path):
        if line.startswith("SF:"):
            cur = line[3:].strip()
            out.setdefault(cur, 0)
        elif line.startswith("DA:") and cur:
            out[cur] += int(line.split(",")[1])
    return {f[len(tree) + 1:]: n for f, n in out.items() if f.startswith(tree + "/")}
a, b = hits(idle), hits(request)
grew = sorted(f for f, n in b.items() if n > a.get(f, 0))
print(f"{len(grew)} files of the workspace ran more lines answering one request")
for f in grew:
    print("  ", f)
PY
