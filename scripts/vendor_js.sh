#!/usr/bin/env bash
# Vendor the browser worker's JavaScript dependencies into edgepipe/api/static/vendor/.
#
# Run once when bumping a version; the copied files are committed, so a fresh clone serves
# the /worker page with no npm at run time. Of onnxruntime-web's builds only one is kept:
# ort.webgpu.min.js with its asyncify WebAssembly binary (~27 MB), which carries both the WebGPU
# execution provider (ONNX Runtime's native one, built for the web: MatMulNBits, GroupQueryAttention)
# and the WebAssembly CPU provider, so one file serves tabs with and without a GPU. (ort.min.js and
# ort.all.min.js use the older JSEP kernels, ort.wasm.min.js has no GPU provider.)
set -euo pipefail

ORT_VERSION=1.30.0
MSGPACK_VERSION=3.1.3

here="$(cd "$(dirname "$0")/.." && pwd)"
dest="$here/edgepipe/api/static/vendor"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

npm install --silent --no-audit --no-fund --ignore-scripts --prefix "$tmp" \
    "onnxruntime-web@$ORT_VERSION" "@msgpack/msgpack@$MSGPACK_VERSION"

ort="$tmp/node_modules/onnxruntime-web/dist"
msgpack="$tmp/node_modules/@msgpack/msgpack"
rm -rf "$dest"
mkdir -p "$dest"
cp "$ort/ort.webgpu.min.js" "$ort/ort-wasm-simd-threaded.asyncify.mjs" "$ort/ort-wasm-simd-threaded.asyncify.wasm" "$dest/"
cp "$msgpack/dist.umd/msgpack.min.js" "$dest/"
cp "$msgpack/LICENSE" "$dest/LICENSE.msgpack"
cat > "$dest/VERSIONS.txt" <<TXT
onnxruntime-web $ORT_VERSION (MIT, Microsoft): ort.webgpu.min.js, ort-wasm-simd-threaded.asyncify.{mjs,wasm} (WebGPU + WebAssembly)
@msgpack/msgpack $MSGPACK_VERSION (ISC): msgpack.min.js (UMD build, global MessagePack)
Written by scripts/vendor_js.sh; do not edit by hand.
TXT
du -sh "$dest"
