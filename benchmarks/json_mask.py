"""What constrained decoding (``response_format``) costs the coordinator per step.

Usage: python benchmarks/json_mask.py [GGUF ...]   (default: the bundled SmolLM2 and, when
present: scripts/fetch_qwen05.sh). For each vocabulary: the one-off index
build (``api.structured.vocabulary_for``), then a json_schema's mask for every prefix of a
valid answer, 5 times, as the request loop computes it (``TokenMask`` + ``controls.packed_mask``):
median, p90 and worst milliseconds per step and the bytes each step sends. Writes
benchmarks/results/json_mask.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from edgepipe.api.structured import Constraint, JsonFormat, vocabulary_for
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.gguf_source import GGUFSource
from edgepipe.model.store import bundled_gguf, reference_gguf
from edgepipe.model.tokenizer import TextTokenizer
from edgepipe.runtime.controls import packed_mask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}, "ok": {"type": "boolean"},
    "score": {"type": "number"}}}
ANSWER = '{"name": "Annabel Lee", "age": 41, "tags": ["red", "blue"], "ok": true, "score": 12.5}'


def measure(path: Path) -> dict:
    src = GGUFSource(path)
    info = src.tokenizer_info()
    tok = TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)
    t0 = time.perf_counter()
    vocab = vocabulary_for(tok)
    build = time.perf_counter() - t0
    constraint = Constraint(vocab, vocab.compile(JsonFormat("json_schema", SCHEMA, strict=True)))
    ids = tok.encode(ANSWER)
    times, size = [], 0
    for _ in range(5):
        mask = constraint.token_mask()
        for k in range(len(ids) + 1):
            t0 = time.perf_counter()
            size = len(packed_mask(mask(ids[:k]), vocab.size))
            times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1e3
    return {"file": path.name, "vocab": vocab.size, "build_s": build, "steps": len(times), "median_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90)), "max_ms": float(ms.max()), "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: the bundled SmolLM2 and the 0.5B Qwen if present)")
    args = ap.parse_args()
    paths = args.gguf or [bundled_gguf(), reference_gguf("qwen05")]
    run = Conditions.start()
    rows = [measure(p) for p in paths if p.is_file()]
    lines = ["# JSON output: the coordinator's cost per step", "",
             f"{run.finish().line()} (`python benchmarks/json_mask.py`)", "",
             "| model file | vocabulary | index build (once) | mask per step: median | p90 | worst | bytes per step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['vocab']} | {r['build_s']:.2f} s | {r['median_ms']:.2f} ms | {r['p90_ms']:.2f} ms | "
                     f"{r['max_ms']:.2f} ms | {r['bytes']} |")
    lines += ["", f"{rows[0]['steps'] if rows else 0} steps per model: every prefix of a {len(ANSWER)}-character answer to a "
              "5-property json_schema, 5 times (llguidance 1.9.1 mask, then packed to ceil(V/8) bytes)."]
    write_results("json_mask", None, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
