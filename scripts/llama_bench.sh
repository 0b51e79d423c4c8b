#!/usr/bin/env bash
# Builds llama.cpp's llama-bench from the llama-cpp-python source
# distribution (PyPI; cmake and ninja from PyPI too, into .venv) and runs
# the comparison issue 10 names:
#   llama-bench -m MODEL -t 2 -p 512 -n 128 -d 2048 -fa 1
# Usage: scripts/llama_bench.sh [MODEL] [extra llama-bench flags...]
# Everything is built under target/llama-bench; a second run reuses it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift || true
DIR=target/llama-bench
BIN=$DIR/build/bin/llama-bench
if [ ! -x .venv/bin/python ]; then
    echo "llama_bench: .venv missing; run \`cargo xtask setup\` first" >&2
    exit 1
fi
if [ ! -f "$MODEL" ]; then
    echo "llama_bench: model $MODEL not found" >&2
    exit 1
fi
if [ ! -x "$BIN" ]; then
    .venv/bin/pip install --quiet cmake==4.4.4 ninja==1.13.2
    mkdir -p "$DIR"
    TAR=$DIR/llama_cpp_python-$VERSION.tar.gz
    if [ ! -f "$TAR" ]; then
        # The source distribution through pip, by name (no registry URL).
        .venv/bin/pip download --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$VERSION" -d "$DIR"
    fi
    echo "$SHA256  $TAR" | sha256sum -c --quiet
    rm -rf "$DIR/src" && mkdir -p "$DIR/src"
    tar -xzf "$TAR" -C "$DIR/src" --strip-components=1
    PATH=$PWD/.venv/bin:$PATH cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON
    PATH=$PWD/.venv/bin:$PATH cmake --build "$DIR/build" --target llama-bench -j "$(nproc)"
fi
"$BIN" -m "$MODEL" -t 2 -p 512 -n 128 -d 2048 -fa 1 "$@"
