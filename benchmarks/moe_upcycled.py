"""The bundled SmolLM2 upcycled into 4 experts (top 2): greedy tokens of edgepipe and llama.cpp, MoE against dense.

    python benchmarks/moe_upcycled.py                                   # edgepipe only
    python benchmarks/moe_upcycled.py --llama-python /tmp/llvenv/bin/python  # and llama.cpp (llama-cpp-python there)

Writes ``tied`` (router rows in equal pairs: each weight exactly 1/2, each layer the dense one to
the bit) and ``random`` (a random router) upcycled files (``edgepipe/bench/moe_files.py``), runs 32 greedy
tokens of three chat prompts on each file and the dense one in edgepipe's kernel form, and, given
an interpreter with ``llama_cpp``, in llama.cpp (one thread, the same prompt token ids); prints
the first position where each pair of runs differs (32: none).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


PROMPTS = ["List three facts about the Moon.", "Write a short poem about a cat.", "What is the tallest mountain on Earth?"]
TOKENS = 32
LLAMA = """
import json, sys
import llama_cpp
data = json.load(open(sys.argv[1]))
out = {}
for name, path in data["files"].items():
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=1, verbose=False)
    runs = []
    for ids in data["prompts"]:
        llm.reset()
        run = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            run.append(int(t))
            if len(run) == data["tokens"]:
                break
        runs.append(run)
    out[name] = runs
json.dump(out, open(sys.argv[2], "w"))
"""


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="a Python with llama_cpp installed (its own venv)")
    args = parser.parse_args()
    from edgepipe.bench.moe_files import upcycle

    from edgepipe.model.store import bundled_gguf, resolve
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    work = Path(tempfile.mkdtemp(prefix="edgepipe-moe-"))
    files = {"dense": str(bundled_gguf()), "tied": str(upcycle(bundled_gguf(), work / "smollm2-moe-tied.gguf", seed=2, tied=True)),
             "random": str(upcycle(bundled_gguf(), work / "smollm2-moe-random.gguf", seed=1))}
    packages = {name: resolve(path, "gguf", work / "home") for name, path in files.items()}
    tok = packages["dense"].tokenizer
    prompts = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in PROMPTS]
    runs = {("edgepipe", name): [generate(pkg.pipeline([], precision="gguf"), ids, GenerationParams(max_tokens=TOKENS), tok.decode,
                                          eos_ids=()).tokens for ids in prompts] for name, pkg in packages.items()}
    if args.llama_python:
        (work / "in.json").write_text(json.dumps({"files": files, "prompts": prompts, "tokens": TOKENS}))
        (work / "llama.py").write_text(LLAMA)
        subprocess.run([args.llama_python, str(work / "llama.py"), str(work / "in.json"), str(work / "out.json")], check=True)
        runs.update({("llama.cpp", name): r for name, r in json.loads((work / "out.json").read_text()).items()})
    pairs = [((engine, name), (engine, "dense")) for engine, name in runs if name != "dense"]
    pairs += [(("edgepipe", name), ("llama.cpp", name)) for name in files if ("llama.cpp", name) in runs]
    for a, b in pairs:
        print(f"{' '.join(a):>18} vs {' '.join(b):<18} first difference at", [first_difference(x, y) for x, y in zip(runs[a], runs[b])])


if __name__ == "__main__":
    main()
