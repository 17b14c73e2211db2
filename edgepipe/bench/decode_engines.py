"""Greedy decoding through edgepipe, onnxruntime-genai and llama.cpp behind one interface.

``benchmarks/decode.py`` runs every engine in a process of its own, so that its peak RSS
(``ru_maxrss``) is that engine's alone::

    python -m edgepipe.bench.decode_engines run '<job as JSON>'      # prints one JSON line

A job names an engine and its settings, and a task:

- ``time``: one short warm-up generation, then greedy generations of exactly N new tokens each
  (EOS ignored), with time to first token (prefill + first sample) and decode time apart;
- ``reference``: greedy tokens only, for each of several prompts;
- ``agree``: teacher-forced argmax at every position of given (prompt, continuation) pairs.

A llama.cpp job may set ``"kv_cache": "f32"`` (its default keeps K and V in f16): the same
engine with one rounding fewer, which measures how far llama.cpp moves from itself.

Only the engine that a process runs is imported in it.

    python -m edgepipe.bench.decode_engines build-genai <out_dir> <precision> <work_dir>

builds onnxruntime-genai's own model of the bundled GGUF with its model builder. The builder
reads float GGUF files only, so the Q4_1 file is first dequantized by transformers into a
Hugging Face folder, which the builder then quantizes its own way. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "smollm2"
PROMPT = "Write a long story about a dragon who learns to bake bread."  # the timed chat prompt of the decode benchmarks
AGREE_PROMPTS = [  # chat prompts whose greedy continuations the agreement checks teacher-force
    "Why is the sky blue?",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Give me three tips for a job interview.",
]
# onnxruntime-genai has no "ignore EOS" switch (min_length masks EOS, which changes the argmax),
# so its EOS is moved to a special token that the chat model does not emit: <gh_stars>. A run
# that still stops early shows up as fewer generated tokens in the results.
GENAI_NEVER_EOS = 7


@dataclass(frozen=True)
class Run:
    tokens: list[int]
    ttft_s: float  # request start to first sampled token (prefill of the prompt + sampling)
    decode_s: float  # first token to last token

    def as_dict(self) -> dict:
        return {"generated": len(self.tokens), "ttft_s": self.ttft_s, "decode_s": self.decode_s, "tokens": self.tokens}


class EdgepipeEngine:
    """The single-process LocalPipeline, through the same ``generate`` loop as ``edgepipe generate``."""

    def __init__(self, job: dict):
        from ..model.store import resolve

        self.package = resolve(job.get("model", MODEL), job["precision"], job.get("home"))
        self.pipeline = self.package.pipeline(cuts=job.get("cuts", []), threads=job.get("threads"), batch_invariant=bool(job.get("batch_invariant")))

    def greedy(self, ids: list[int], n: int) -> Run:
        from ..runtime.local import generate
        from ..runtime.sequence import GenerationParams

        r = generate(self.pipeline, ids, GenerationParams(max_tokens=n), self.package.tokenizer.decode, eos_ids=())
        return Run(r.tokens, r.ttft_s, r.decode_s)

    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> list[int]:
        from ..runtime.stage_runner import SamplingBatch

        greedy, seq = SamplingBatch.greedy(1), "agree"
        try:
            predicted = [self.pipeline.step(seq, list(prompt), greedy)]
            for token in continuation[:-1]:
                predicted.append(self.pipeline.step(seq, [token], greedy))
        finally:
            self.pipeline.drop(seq)
        return predicted


class GenaiEngine:
    """onnxruntime-genai's Generator (its C++ loop, KV buffer shared between past and present)."""

    def __init__(self, job: dict):
        import numpy as np
        import onnxruntime_genai as og

        self.og, self.np = og, np
        config = og.Config(job["genai_dir"])
        overlay: dict = {"model": {"eos_token_id": GENAI_NEVER_EOS}}
        if job.get("threads"):
            overlay["model"]["decoder"] = {"session_options": {"intra_op_num_threads": job["threads"]}}
        config.overlay(json.dumps(overlay))
        self.model = og.Model(config)

    def _generator(self, max_length: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, do_sample=False)
        return self.og.Generator(self.model, params)

    def greedy(self, ids: list[int], n: int) -> Run:
        start = time.perf_counter()
        gen = self._generator(len(ids) + n)  # allocates the KV buffers: part of a request's cost
        gen.append_tokens(ids)
        gen.generate_next_token()
        tokens = [int(gen.get_next_tokens()[0])]
        first = time.perf_counter()
        while len(tokens) < n and not gen.is_done():
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        return Run(tokens, first - start, time.perf_counter() - first)

    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> list[int]:
        gen = self._generator(len(prompt) + len(continuation) + 1)
        gen.append_tokens(list(prompt))
        predicted = [self._argmax(gen)]
        for token in continuation[:-1]:
            gen.append_tokens([token])
            predicted.append(self._argmax(gen))
        return predicted

    def _argmax(self, gen) -> int:
        logits = self.np.asarray(gen.get_logits())  # [1, S, vocab]; the last row predicts the next token
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) on the original GGUF; greedy = argmax of the last logits."""

    def __init__(self, job: dict):
        import llama_cpp
        import numpy as np

        from ..model.store import bundled_gguf

        threads = job.get("threads") or os.cpu_count() or 1
        self.llama_cpp, self.np = llama_cpp, np
        kv = {}
        if job.get("kv_cache") == "f32":
            kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
        elif job.get("kv_cache") not in (None, "f16"):
            raise ValueError(f"kv_cache must be f16 or f32, got {job['kv_cache']!r}")
        self.llm = llama_cpp.Llama(model_path=str(job.get("model") or bundled_gguf(MODEL)), n_ctx=job.get("n_ctx", 2048), n_threads=threads,
                                   n_threads_batch=threads, verbose=False, logits_all=False, **kv)
        self.vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = self.np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))
        return int(logits.argmax())

    def greedy(self, ids: list[int], n: int) -> Run:
        self.llm.reset()  # the next eval drops the KV cache from position 0 on
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens = [self._argmax()]
        first = time.perf_counter()
        while len(tokens) < n:
            self.llm.eval([tokens[-1]])
            tokens.append(self._argmax())
        return Run(tokens, first - start, time.perf_counter() - first)

    def teacher_forced(self, prompt: list[int], continuation: list[int]) -> list[int]:
        self.llm.reset()
        self.llm.eval(list(prompt))
        predicted = [self._argmax()]
        for token in continuation[:-1]:
            self.llm.eval([token])
            predicted.append(self._argmax())
        return predicted


def matches(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Positions where two teacher-forced runs predict the same token, and the positions compared."""
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return sum(x == y for x, y in pairs), len(pairs)


ENGINES = {"edgepipe": EdgepipeEngine, "genai": GenaiEngine, "llama.cpp": LlamaCppEngine}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_job(job: dict) -> dict:
    start = time.perf_counter()
    engine = ENGINES[job["engine"]](job)
    out: dict = {"load_s": time.perf_counter() - start}
    task = job["task"]
    if task == "time":
        prompt = job["prompt"]
        if job.get("warmup"):
            engine.greedy(prompt, job["warmup"])
        out["runs"] = []
        for n in job["lengths"]:
            load, cpu = os.getloadavg()[0], time.process_time()
            run = engine.greedy(prompt, n)
            # CPU time of this process (all its threads) per token: less sensitive than wall time
            # to other processes on a shared machine (spin-waiting threads count, though).
            cpu_ms = (time.process_time() - cpu) * 1e3 / len(run.tokens)
            out["runs"].append({"n": n, **run.as_dict(), "cpu_ms_per_token": cpu_ms, "load1": load})
    elif task == "reference":
        out["tokens"] = [engine.greedy(p, job["n"]).tokens for p in job["prompts"]]
    elif task == "agree":
        out["predicted"] = [engine.teacher_forced(p, c) for p, c in job["sequences"]]
    else:
        raise ValueError(f"unknown task {task!r}")
    out["peak_rss_mib"] = peak_rss_mib()
    return out


# -- onnxruntime-genai's own model ---------------------------------------------------------------

def export_hf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a float32 Hugging Face folder (weights, config, tokenizer)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy its dequantized weights into a plain one.
    plain = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # else the builder would look for the GGUF quantizer
    config_path.write_text(json.dumps(config, indent=2))


def build_genai(out_dir: Path, precision: str, work: Path) -> None:
    """Build onnxruntime-genai's model of the bundled GGUF at ``precision`` into ``out_dir``."""
    from ..model.store import bundled_gguf

    if importlib.util.find_spec("onnx_ir") is None:
        raise RuntimeError("onnxruntime-genai's model builder needs the onnx-ir package: pip install onnx-ir")
    work.mkdir(parents=True, exist_ok=True)
    hf, cache, partial = work / "hf", work / "builder-cache", out_dir.with_name(out_dir.name + ".partial")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        if not (hf / "config.json").is_file():
            _check([sys.executable, "-m", "edgepipe.bench.decode_engines", "export-hf", str(bundled_gguf(MODEL)), str(hf)], env)
        shutil.rmtree(partial, ignore_errors=True)
        _check([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(partial),
                "-p", precision, "-e", "cpu", "-c", str(cache)], env)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.replace(out_dir)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def _check(cmd: list[str], env: dict) -> None:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} … failed ({done.returncode}):\n{done.stderr[-3000:]}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["run"] and len(argv) == 2:
        print(json.dumps(run_job(json.loads(argv[1]))))
    elif argv[:1] == ["export-hf"] and len(argv) == 3:
        export_hf(Path(argv[1]), Path(argv[2]))
    elif argv[:1] == ["build-genai"] and len(argv) == 4:
        build_genai(Path(argv[1]), argv[2], Path(argv[3]))
    else:
        sys.exit("usage: decode_engines run JOB_JSON | export-hf GGUF OUT_DIR | build-genai OUT_DIR PRECISION WORK_DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
