#!/usr/bin/env bash
# Sourced by llama_cpp_kquants.sh and llama_server.sh: llama_cpp_source
# makes sure target/llama.cpp/ holds a venv with cmake and ninja and the
# llama-cpp-python $version source distribution (PyPI) unpacked, whose
# vendor/llama.cpp both scripts build. Expects $out and $version set.
llama_cpp_source() {
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
}
