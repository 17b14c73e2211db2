#!/usr/bin/env bash
# EPYC measurements for issue 39, in sequence on a quiet machine.
set -u
cd /work/main
touch /tmp/QUIET
M15=$HOME/.cache/edgepipe/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
M05=$HOME/.cache/edgepipe/models/qwen2.5-coder-0.5b-instruct.gguf
B=$HOME/.cache/edgepipe/llama.cpp/0.3.36/bin
D=benchmarks/results/decode-epyc; mkdir -p $D
echo "start $(date -u) $(cat /proc/loadavg)"
.venv/bin/python benchmarks/serve.py --reps 2 --profile --stem serve-epyc-sched > /tmp/epyc/serve.log 2>&1; echo "serve rc=$? $(date -u) $(cat /proc/loadavg)"
echo "# llama-bench -m <1.5B> -m <0.5B> -t 1,2 -p 0 -n 128 -r 2 (scripts/build_llama_cpp.sh, llama-cpp-python 0.3.36's llama.cpp, native build)" > $D/llama-bench.txt
for r in 1 2; do
  .venv/bin/python benchmarks/decode.py --model $M15 --model $M05 --lengths 128 --reps 1 --no-synthetic --threads 1 2 --precisions gguf --out /tmp/epyc/d$r > /tmp/epyc/decode$r.log 2>&1
  echo "decode $r rc=$? $(date -u)"
  cp /tmp/epyc/d$r/decode.md $D/decode-rep$r.md; cp /tmp/epyc/d$r/decode.json $D/decode-rep$r.json
  echo "# after decode.py rep $r ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))" >> $D/llama-bench.txt
  $B/llama-bench -m $M15 -m $M05 -t 1,2 -p 0 -n 128 -r 2 2>/dev/null | grep tg128 >> $D/llama-bench.txt
done
echo "decode done $(date -u) $(cat /proc/loadavg)"
.venv/bin/python benchmarks/prefill.py --tokens 512 --threads 1 2 --reps 2 --samples 2 --stem prefill-epyc > /tmp/epyc/prefill.log 2>&1; echo "prefill rc=$? $(date -u) $(cat /proc/loadavg)"


# MoE decode (the README's EPYC MoE row was "not re-measured")
mkdir -p /tmp/moe
[ -f /tmp/moe/qwen3-30b-a3b-16.gguf ] || .venv/bin/python -c "
from pathlib import Path
from edgepipe.bench.arch_files import write_arch_gguf
from edgepipe.model.store import bundled_gguf
print(write_arch_gguf(Path('/tmp/moe/qwen3-30b-a3b-16.gguf'), 'qwen3-30b-a3b', bundled_gguf(), 16))"
[ -f /tmp/moe/gpt-oss-20b-8.gguf ] || .venv/bin/python benchmarks/gpt_oss_synthetic.py /tmp/moe/gpt-oss-20b-8.gguf --layers 8
echo "moe files $(date -u)"
sed -e 's/^sleep 45.*$/sleep 20/' -e 's|^OUT=/tmp/moe/res|OUT=/tmp/moe/res|' benchmarks/results/moe-intel-prefetch/moe_bench.sh > /tmp/moe/moe_bench.sh
bash /tmp/moe/moe_bench.sh > /tmp/moe/run.log 2>&1
echo "moe done $(date -u) $(cat /proc/loadavg)"
rm -f /tmp/QUIET; echo done
