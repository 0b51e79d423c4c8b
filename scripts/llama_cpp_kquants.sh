#!/usr/bin/env bash
# A K-quant file of our model, made by llama.cpp, read by kvforge.
#
# Builds llama.cpp's llama-quantize and llama-perplexity from the
# llama-cpp-python source distribution (PyPI), requantizes the setup's
# SmolLM2 Q4_1 GGUF to Q4_K_M, checks every tensor kvforge dequantizes
# against the gguf package's reference (needs `cargo xtask setup
# --reference`), generates with it, and prints kvforge's and
# llama.cpp's perplexity of both files on the same text (512-token windows,
# the second half of each scored, 4 windows). Everything goes under
# target/llama.cpp/. Needs `cargo xtask setup` and a release kvforge
# (`cargo build --release -p kvforge-engine`); takes about 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/llama_cpp_source.sh
out=target/llama.cpp
version=0.3.36
mkdir -p "$out"
if [ ! -x "$out/build/bin/llama-quantize" ]; then
  llama_cpp_source
  PATH="$PWD/$out/venv/bin:$PATH" cmake -S "$out/llama_cpp_python-$version/vendor/llama.cpp" -B "$out/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF > "$out/cmake.log"
  PATH="$PWD/$out/venv/bin:$PATH" ninja -C "$out/build" llama-quantize llama-perplexity > "$out/build.log"
fi
q41=models/SmolLM2-135M-Instruct.Q4_1.gguf
qkm=$out/SmolLM2-135M-Instruct.Q4_K_M.gguf
"$out/build/bin/llama-quantize" --allow-requantize "$q41" "$qkm" Q4_K_M 2 > "$out/quantize.log" 2>&1
.venv/bin/python -c "
from collections import Counter; from gguf import GGUFReader
print('tensor types:', dict(Counter(t.tensor_type.name for t in GGUFReader('$qkm').tensors)))" 2>/dev/null || true
# Every tensor of the file, kvforge against the gguf package's dequantizer.
cargo build --quiet --release -p kvforge-engine --example gguf_stats
./target/release/examples/gguf_stats "$qkm" | .venv/bin/python scripts/compare_gguf_stats.py "$qkm"
./target/release/kvforge generate --model "$qkm" --prompt "What is the capital of France?" --max-tokens 40
text=data/PaulGrahamEssays/worked.txt
for m in "$q41" "$qkm"; do
  k=$(./target/release/kvforge ppl --model "$m" --text "$text" --tokens 2048 --window 512 \
        --prefix 512 --chunk 512 --decode 0 | head -1)
  l=$("$out/build/bin/llama-perplexity" -m "$m" -f "$text" -c 512 --chunks 4 -t 2 2>&1 | grep "Final estimate")
  echo "$(basename "$m"): kvforge $k"
  echo "$(basename "$m"): llama.cpp $l"
done
