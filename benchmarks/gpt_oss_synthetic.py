"""A synthetic gpt-oss GGUF with gpt-oss-20b's per-layer shapes, for agreement checks against llama.cpp.

    python benchmarks/gpt_oss_synthetic.py /tmp/gpt-oss-synthetic.gguf            # 2 layers (~1 GB)
    python benchmarks/gpt_oss_synthetic.py /tmp/gpt-oss-synthetic.gguf --layers 4
    python benchmarks/agreement_floor.py --model /tmp/gpt-oss-synthetic.gguf --variants base                     # MatMulNBits form
    python benchmarks/agreement_floor.py --model /tmp/gpt-oss-synthetic.gguf --variants base --precision gguf    # kernel form

The file (``edgepipe.bench.moe_files.synthetic_gpt_oss``): hidden 2880, 64 query heads and 8 kv
heads of 64, 32 experts of width 2880 (MXFP4, GGML type 39), top 4, a 128-token window on the even
layers, YaRN factor 32 over 4096 positions (base 150000), attention sinks, biases everywhere
gpt-oss has them; random weights scaled so that logits are peaked (the Q8_0 head's rows have unit
RMS), the bundled SmolLM2's tokenizer and chat template (49152 tokens: llama.cpp loads any vocabulary
with any architecture; the real model's o200k vocabulary is a `gpt-4o` pre-tokenizer, which
edgepipe's tokenizer also knows). `agreement_floor.py` then has llama.cpp greedily continue its
three chat prompts and teacher-forces llama.cpp (f16 and f32 KV) and edgepipe through them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgepipe.bench.moe_files import synthetic_gpt_oss
from edgepipe.model.store import bundled_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the GGUF to write")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path, _ = synthetic_gpt_oss(args.out, bundled_gguf(), seed=args.seed, layers=args.layers)
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
