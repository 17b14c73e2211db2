#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, `rpc-server` and `llama-bench` from the sources vendored in
# llama-cpp-python's source distribution (the machine reaches only package registries, so PyPI's
# sdist is the way to llama.cpp): the reference servers of benchmarks/serve.py.
# Usage: scripts/build_llama_cpp.sh [VERSION]   (default 0.3.36; JOBS=2 by default;
#   LLAMA_CPP_SDIST=path/to/llama_cpp_python-VERSION.tar.gz skips the download;
#   PRINT_CPU_FLAGS=1 [CPUINFO=file] prints the CPU flags it would build with, and builds nothing)
# Prints the bin directory: ${EDGEPIPE_LLAMA_CPP:-~/.cache/edgepipe/llama.cpp}/<version>/bin.
# Idempotent: when the three binaries are there, nothing is downloaded or built.
# CPU flags: native, except on an Intel CPU reporting AMX (`amx_tile`): there -march=native turns on
# ggml's AMX code, which crashes where the kernel has not granted AMX state, so the build takes
# GGML_NATIVE=OFF and the AVX/AVX2/AVX-512 flags the CPU reports, one by one.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.3.36}
ROOT=${EDGEPIPE_LLAMA_CPP:-$HOME/.cache/edgepipe/llama.cpp}/$VERSION
BIN=$ROOT/bin
TOOLS="llama-server rpc-server llama-bench"
JOBS=${JOBS:-2}
have_all() { for t in $TOOLS; do [ -x "$BIN/$t" ] || return 1; done; }
CPUINFO=${CPUINFO:-/proc/cpuinfo}  # another file: see which CPU flags a machine would get (with PRINT_CPU_FLAGS=1)
FLAGS=$(grep -m1 '^flags' "$CPUINFO" 2>/dev/null || true)
has() { [[ " $FLAGS " == *" $1 "* ]]; }
CPU=()
if grep -q GenuineIntel "$CPUINFO" 2>/dev/null && has amx_tile; then
  CPU=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  on() { if has "$1"; then CPU+=("-D$2=ON"); else CPU+=("-D$2=OFF"); fi; }
  on avx GGML_AVX; on avx2 GGML_AVX2; on fma GGML_FMA; on f16c GGML_F16C; on bmi2 GGML_BMI2
  on avx_vnni GGML_AVX_VNNI; on avx512f GGML_AVX512; on avx512vbmi GGML_AVX512_VBMI
  on avx512_vnni GGML_AVX512_VNNI; on avx512_bf16 GGML_AVX512_BF16
fi
if [ -n "${PRINT_CPU_FLAGS:-}" ]; then echo "${CPU[*]:-(native)}"; exit 0; fi
if have_all; then echo "$BIN"; exit 0; fi
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
mkdir -p "$ROOT"
SDIST=$(ls "$ROOT"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [ -z "$SDIST" ] && [ -n "${LLAMA_CPP_SDIST:-}" ]; then SDIST=$LLAMA_CPP_SDIST; fi  # an sdist at hand
if [ -z "$SDIST" ]; then
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$ROOT" "llama-cpp-python==$VERSION" >&2
  SDIST=$ROOT/llama_cpp_python-$VERSION.tar.gz
fi
SRC=$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then mkdir -p "$ROOT/src"; tar xzf "$SDIST" -C "$ROOT/src"; fi
# CMake: the system's when present, else the PyPI package in a private build venv.
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ]; then
  [ -x "$ROOT/venv/bin/cmake" ] || { "$PY" -m venv "$ROOT/venv" && "$ROOT/venv/bin/pip" install -q cmake ninja >&2; }
  CMAKE=$ROOT/venv/bin/cmake; export PATH=$ROOT/venv/bin:$PATH
fi
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
[ ${#CPU[@]} -gt 0 ] && echo "build_llama_cpp: Intel CPU with AMX: ${CPU[*]}" >&2
"$CMAKE" -S "$SRC" -B "$ROOT/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF "${CPU[@]}" >&2
# rpc-server's CMake target (and file) is ggml-rpc-server in this llama.cpp; installed as rpc-server.
"$CMAKE" --build "$ROOT/build" --config Release -j "$JOBS" --target llama-server ggml-rpc-server llama-bench >&2
mkdir -p "$BIN"
for t in $TOOLS; do
  f=$ROOT/build/bin/$t; [ "$t" = rpc-server ] && [ ! -x "$f" ] && f=$ROOT/build/bin/ggml-rpc-server
  cp "$f" "$BIN/$t.tmp" && mv "$BIN/$t.tmp" "$BIN/$t"
done
echo "$BIN"
