#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama-cpp-python source
# distribution (PyPI; the llama.cpp it vendors), as llama_cpp_kquants.sh
# builds its tools, into target/llama.cpp/build-server/bin/llama-server.
# `cargo xtask serve-load --llama-server PATH` runs the same load on it.
# Idempotent; about 6 minutes on 2 cores the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/llama.cpp
version=0.3.36
bin="$out/build-server/bin/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$out"
if [ ! -x "$out/venv/bin/cmake" ]; then
  python3 -m venv "$out/venv"
  "$out/venv/bin/pip" install -q cmake ninja
fi
if [ ! -d "$out/llama_cpp_python-$version" ]; then
  url=$(python3 - "$version" <<'PY'
import json, sys, urllib.parse, urllib.request
base = "https://pypi.org/pypi/llama-cpp-python/json"
meta = json.load(urllib.request.urlopen(base))
files = meta["releases"][sys.argv[1]]
sdist = next(u["url"] for u in files if u["packagetype"] == "sdist")
print(urllib.parse.urljoin(base, sdist))
PY
)
  python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$out/llama.tar.gz"
  tar xzf "$out/llama.tar.gz" -C "$out"
fi
PATH="$PWD/$out/venv/bin:$PATH" cmake -S "$out/llama_cpp_python-$version/vendor/llama.cpp" -B "$out/build-server" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=OFF > "$out/cmake-server.log"
PATH="$PWD/$out/venv/bin:$PATH" ninja -C "$out/build-server" llama-server > "$out/build-server.log"
echo "$bin"
