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
    # The source distribution through pip, by name (no registry URL).
    "$out/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$version" -d "$out"
    tar xzf "$out/llama_cpp_python-$version.tar.gz" -C "$out"
  fi
}
