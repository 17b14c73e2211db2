#!/usr/bin/env bash
# Quiet MoE decode: edgepipe (decode.py, kernel form) interleaved with llama-bench tg128, 2 reps.
set -u
cd /work/main
BIN=$HOME/.cache/edgepipe/llama.cpp/0.3.36/bin
OUT=/tmp/moe/res; mkdir -p $OUT
touch /tmp/QUIET
sleep 20
for f in qwen3-30b-a3b-16 gpt-oss-20b-8; do
  for rep in 1 2; do
    echo "== $(date -u +%T) rep $rep $f edgepipe load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python benchmarks/decode.py --model /tmp/moe/$f.gguf --lengths 128 --reps 1 --no-synthetic --threads 1 2 --precisions gguf --out $OUT/$f-rep$rep 2>&1 | grep -v "^WARNING" | tail -15
    echo "== $(date -u +%T) rep $rep $f llama-bench load $(cut -d' ' -f1-3 /proc/loadavg)"
    $BIN/llama-bench -m /tmp/moe/$f.gguf -t 1,2 -p 0 -n 128 -r 2 2>&1 | tail -6
  done
done
echo "== $(date -u +%T) done load $(cut -d' ' -f1-3 /proc/loadavg)"
rm -f /tmp/QUIET
