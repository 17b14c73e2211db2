"""A real model upcycled into 4 experts (top 2): greedy tokens of edgepipe and llama.cpp, MoE against dense.

    python benchmarks/moe_upcycled.py                                   # the bundled SmolLM2, edgepipe only
    python benchmarks/moe_upcycled.py --model qwen05 --llama-server     # Qwen2.5-Coder-0.5B, and llama-server
    python benchmarks/moe_upcycled.py --llama-python /tmp/llvenv/bin/python  # llama.cpp through llama-cpp-python

Writes ``tied`` (router rows in equal pairs: each weight exactly 1/2, each layer the dense one to
the bit) and ``random`` (a random router) upcycled files (``edgepipe/bench/moe_files.py``), runs 32 greedy
tokens of three chat prompts on each file and the dense one in edgepipe's kernel form, and in
llama.cpp (the same prompt token ids, one thread): through ``llama-server``'s ``/completion``
(``--llama-server``: scripts/build_llama_cpp.sh's binary, or the path given) or an interpreter
with ``llama_cpp``; prints the first position where each pair of runs differs (32: none).

``qwen05`` (a ``qwen2`` file) is upcycled as ``llama`` with experts, its q/k rows permuted to
``llama``'s RoPE layout; ``as-llama`` is that rewrite without experts (``moe_files.as_llama``):
``tied`` equals it to the bit, and it differs from the ``qwen2`` file only in the order attention
sums ``q . k`` (rounding, which the int8 quantisation of activations can turn into a step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

PROMPTS = ["List three facts about the Moon.", "Write a short poem about a cat.", "What is the tallest mountain on Earth?"]
TOKENS = 32
LLAMA_BIN = Path(os.environ.get("EDGEPIPE_LLAMA_CPP") or Path.home() / ".cache" / "edgepipe" / "llama.cpp") / "0.3.36" / "bin"
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


def llama_server_tokens(binary: Path, path: str, prompts: list[list[int]], tokens: int, logdir: Path) -> list[list[int]]:
    """Greedy ``tokens`` tokens of each prompt (token ids) from ``llama-server`` on ``path``
    (one slot, one thread, no prompt cache, EOS ignored)."""
    import httpx

    from edgepipe.bench.cluster import free_port
    from edgepipe.bench.serving import llama_server_argv

    port = free_port()
    with open(logdir / f"llama-server-{Path(path).stem}.log", "wb") as log:
        proc = subprocess.Popen(llama_server_argv(str(binary), path, port, 1, 1, 1024), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} (log in {logdir})")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy (log in {logdir})")
            time.sleep(0.5)
        runs = []
        for ids in prompts:
            r = httpx.post(f"{url}/completion", timeout=900, json={
                "prompt": ids, "n_predict": tokens, "temperature": 0, "top_k": 1, "samplers": ["top_k"], "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            runs.append([int(t) for t in r.json()["tokens"]])
        return runs
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "qwen05"), default="smollm2",
                        help="smollm2: the bundled SmolLM2-135M; qwen05: Qwen2.5-Coder-0.5B-Instruct (scripts/fetch_qwen05.sh)")
    parser.add_argument("--llama-server", nargs="?", const=str(LLAMA_BIN / "llama-server"), type=Path,
                        help="llama.cpp through llama-server (default: scripts/build_llama_cpp.sh's)")
    parser.add_argument("--llama-python", help="a Python with llama_cpp installed (its own venv)")
    parser.add_argument("--keep", type=Path, help="write the files here and keep them (default: a temporary folder)")
    args = parser.parse_args()
    from edgepipe.bench.moe_files import as_llama, upcycle
    from edgepipe.model.store import bundled_gguf, missing_reference, reference_gguf, resolve
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    if args.model == "qwen05" and (missing := missing_reference("qwen05")):
        raise SystemExit(missing)
    source = bundled_gguf() if args.model == "smollm2" else reference_gguf("qwen05")
    work = args.keep or Path(tempfile.mkdtemp(prefix="edgepipe-moe-"))
    work.mkdir(parents=True, exist_ok=True)
    files = {"dense": str(source)}
    if args.model == "qwen05":
        files["as-llama"] = str(as_llama(source, work / f"{args.model}-as-llama.gguf"))
    files["tied"] = str(upcycle(source, work / f"{args.model}-moe-tied.gguf", seed=2, tied=True))
    files["random"] = str(upcycle(source, work / f"{args.model}-moe-random.gguf", seed=1))
    print("files:", json.dumps(files), flush=True)
    packages = {name: resolve(path, "gguf", work / "home") for name, path in files.items()}
    tok = packages["dense"].tokenizer
    prompts = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in PROMPTS]
    runs = {("edgepipe", name): [generate(pkg.pipeline([], precision="gguf"), ids, GenerationParams(max_tokens=TOKENS), tok.decode,
                                          eos_ids=()).tokens for ids in prompts] for name, pkg in packages.items()}
    if args.llama_server:
        runs.update({("llama.cpp", name): llama_server_tokens(args.llama_server, path, prompts, TOKENS, work) for name, path in files.items()})
    elif args.llama_python:
        (work / "in.json").write_text(json.dumps({"files": files, "prompts": prompts, "tokens": TOKENS}))
        (work / "llama.py").write_text(LLAMA)
        subprocess.run([args.llama_python, str(work / "llama.py"), str(work / "in.json"), str(work / "out.json")], check=True)
        runs.update({("llama.cpp", name): r for name, r in json.loads((work / "out.json").read_text()).items()})
    pairs = [((engine, name), (engine, "dense")) for engine, name in runs if name != "dense"]
    pairs += [((engine, name), (engine, "as-llama")) for engine, name in runs if name in ("tied", "random") and (engine, "as-llama") in runs]
    pairs += [(("edgepipe", name), ("llama.cpp", name)) for name in files if ("llama.cpp", name) in runs]
    for a, b in pairs:
        print(f"{' '.join(a):>18} vs {' '.join(b):<18} first difference at", [first_difference(x, y) for x, y in zip(runs[a], runs[b])])
    (work / "runs.json").write_text(json.dumps({" ".join(k): v for k, v in runs.items()}))
    for (engine, name), texts in runs.items():
        print(f"{engine} {name}:", json.dumps([tok.decode(t) for t in texts]))


if __name__ == "__main__":
    main()
