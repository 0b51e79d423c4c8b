#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama-cpp-python source
# distribution (PyPI; the llama.cpp it vendors), as llama_cpp_kquants.sh
# builds its tools, into target/llama.cpp/build-server/bin/llama-server.
# `cargo xtask serve-load --llama-server PATH` runs the same load on it.
# Idempotent; about 6 minutes on 2 cores the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/llama_cpp_source.sh
out=target/llama.cpp
version=0.3.36
bin="$out/build-server/bin/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
llama_cpp_source
PATH="$PWD/$out/venv/bin:$PATH" cmake -S "$out/llama_cpp_python-$version/vendor/llama.cpp" -B "$out/build-server" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=OFF > "$out/cmake-server.log"
PATH="$PWD/$out/venv/bin:$PATH" ninja -C "$out/build-server" llama-server > "$out/build-server.log"
echo "$bin"
