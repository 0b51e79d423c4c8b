#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, with
# target/gpu-check carried (`cargo xtask gpu-check` builds and stages it):
#
#   bash target/gpu-check/run.sh
#
# Finds the machine's torch (python3 on PATH, else /opt/torch/.venv) and
# the NVRTC its CUDA wheels bring, puts both on LD_LIBRARY_PATH, prints
# the GPU, and runs gpu_check, which writes $OUT/gpu-check.md.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
torch=""
for py in python3 /opt/torch/.venv/bin/python3; do
    torch=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null) && break
done
if [ -z "$torch" ]; then
    echo "gpu-check: no python with torch found" >&2
    exit 1
fi
nvrtc=""
for d in "$(dirname "$torch")"/nvidia/*/lib; do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then nvrtc=$d; break; fi
done
export LD_LIBRARY_PATH="$torch/lib${nvrtc:+:$nvrtc}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
exec "$here/gpu_check" --out "${OUT:-$here}" "$@"
