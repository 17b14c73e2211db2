"""GPU stage vs CPU stage on one machine, and a pipeline that mixes them.

    python benchmarks/gpu.py                                  # 1B- and 8B-shaped synthetic GGUFs
    python benchmarks/gpu.py --shapes tiny --software         # the same path on SwiftShader (CI-sized)

Writes synthetic GGUFs of Llama-3.2-1B's and Llama-3-8B's shapes on this machine (random Q4_K /
Q6_K blocks, ``edgepipe.bench.synthetic``: no model file has to travel to a GPU machine), imports
them, and times one stage holding the whole model, greedy, after a 128-token prompt:

- the CPU worker's stage (``--threads``, 16 on the GPU machines this project is lent);
- the same stage on the GPU through ONNX Runtime's WebGPU EP, KV pool in GPU memory, in the
  graph form the coordinator sends GPU workers (``graphs.gpu_form``) and in the CPU form.

Each configuration runs in its own process, interleaved per shape. Reported: decode tok/s (median
step), weight GB/s (the stage's weight bytes per step), prefill time, host<->device bytes per
decode step (``StageRunner.host_bytes``), and how many of the first greedy tokens equal the CPU's
(random weights give near-ties, so arithmetic can flip a few; the exact contract is the single
process on the same devices, checked by the cluster run).

Then a cluster on this machine: ``edgepipe serve`` with three workers, one on the GPU and two on the
CPU (``--placement memory``, equal budgets: a stage each), a greedy request through the API, and
its token ids compared with ``Package.pipeline`` run in one process on the same devices and cuts.

Results: ``benchmarks/results/gpu.json`` and ``.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import RESULTS, write_results

ROOT = Path(__file__).resolve().parents[1]  # children import ``benchmarks.gpu`` from here (their working directory)

SOFTWARE_ENV = {"VK_ICD_FILENAMES": "/usr/lib/chromium/vk_swiftshader_icd.json", "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": "1"}


# -- one configuration, in a child process ----------------------------------------------------------

def child(job: dict) -> dict:
    import numpy as np

    from edgepipe.model.package import Package
    from edgepipe.runtime.devices import resolve
    from edgepipe.runtime.stage_runner import SamplingBatch

    pkg = Package(job["package"])
    n = len(pkg.manifest.units)
    device = resolve(job["device"])
    if job["device"] != "cpu" and not device.is_gpu:
        return {"error": f"no GPU: {device.note}"}
    t0 = time.perf_counter()
    gpu_form = device.is_gpu and job["form"] == "gpu"
    runner = pkg.runner(0, n, threads=job["threads"], verify=False, device=device) if gpu_form or not device.is_gpu else None
    if runner is None:  # the CPU form on the GPU
        from edgepipe.runtime.stage_runner import StageRunner
        runner = StageRunner(pkg.blob(pkg.stage_graph(0, n)), threads=job["threads"], max_context=pkg.manifest.max_context, device=device)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    prompt = rng.integers(300, runner.vocab - 1, job["prompt"]).astype(np.int64)[None, :]
    greedy = SamplingBatch.greedy(1)
    t0 = time.perf_counter()
    token = int(runner.run("s", prompt, greedy)[0])
    prefill_s = time.perf_counter() - t0
    tokens, times, moved = [token], [], []
    deadline = time.monotonic() + job["budget_s"]
    for _ in range(job["steps"]):
        if time.monotonic() > deadline:
            break
        t0 = time.perf_counter()
        token = int(runner.run("s", np.array([[token]], np.int64), greedy)[0])
        times.append(time.perf_counter() - t0)
        tokens.append(token)
        moved.append(runner.host_bytes)
    steady = times[2:] if len(times) > 4 else times
    step = float(np.median(steady))
    weights = sum(pkg.manifest.variant(u.index).weight_bytes for u in pkg.manifest.units)
    return {"device": device.describe(), "form": job["form"] if device.is_gpu else "cpu", "threads": job["threads"],
            "load_s": round(load_s, 2), "prefill_s": round(prefill_s, 3), "prompt": job["prompt"], "steps": len(times),
            "step_ms": round(step * 1e3, 2), "tok_s": round(1 / step, 2), "weight_gb_s": round(weights / step / 1e9, 1),
            "host_bytes_per_step": int(np.median(moved)) if moved else None, "kv_bytes": runner.kv_bytes,
            "providers": runner.session.get_providers(), "tokens": tokens}


def profile_child(job: dict) -> dict:
    """Where a GPU decode step goes: the layers and the head timed as stages of their own, then
    ONNX Runtime's profiler over a few steps of each (host-side time per op type and provider;
    a GPU EP's waits land in its Memcpy nodes)."""
    import collections

    import numpy as np
    import onnxruntime as ort

    from edgepipe.model.package import Package
    from edgepipe.runtime.devices import resolve
    from edgepipe.runtime.stage_runner import SamplingBatch

    pkg = Package(job["package"])
    n = len(pkg.manifest.units)
    device = resolve(job["device"])
    out = {}
    real = ort.InferenceSession
    for name, (a, b) in (("layers", (0, n - 1)), ("head", (n - 1, n))):
        for profiled in (False, True):
            def make(path, options=None, providers=None, **kw):
                if profiled:
                    options.enable_profiling = True
                    options.profile_file_prefix = f"/tmp/edgepipe-prof-{name}"
                return real(path, options, providers=providers)
            ort.InferenceSession = make
            try:
                runner = pkg.runner(a, b, threads=job["threads"], verify=False, device=device)
            finally:
                ort.InferenceSession = real
            greedy = SamplingBatch.greedy(1) if runner.emits_tokens else None
            hidden = pkg.manifest.units[1].out_bytes_per_token // 4
            x = np.array([[5] * 16], np.int64) if runner.takes_token_ids else np.random.default_rng(0).random((1, 16, hidden), np.float32)
            runner.run("s", x, greedy)
            step = x[:, -1:]
            times = []
            for _ in range(12 if profiled else 24):
                t0 = time.perf_counter()
                runner.run("s", step, greedy)
                times.append(time.perf_counter() - t0)
            if not profiled:
                out[name + "_step_ms"] = round(float(np.median(times[2:])) * 1e3, 2)
                if name == "head":  # the same head on the CPU, for a split of layers on the GPU, head on the CPU
                    cpu_head = pkg.runner(a, b, threads=job.get("cpu_threads", 16), verify=False)
                    cpu_head.run("s", x, greedy)
                    cpu_times = []
                    for _ in range(12):
                        t0 = time.perf_counter()
                        cpu_head.run("s", step, greedy)
                        cpu_times.append(time.perf_counter() - t0)
                    out["head_on_cpu_step_ms"] = round(float(np.median(cpu_times[2:])) * 1e3, 2)
                continue
            events = json.load(open(runner.session.end_profiling()))
            by_op = collections.Counter()
            for e in events:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    by_op[f"{e['args'].get('op_name')}@{e['args'].get('provider', '?').replace('ExecutionProvider', '')}"] += e["dur"]
            runs = [e["dur"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
            out[name + "_profile"] = {"model_run_ms": round(float(np.median(runs)) / 1e3, 2) if runs else None,
                                      "top_ops_ms_per_step": {k: round(v / 13 / 1e3, 2) for k, v in by_op.most_common(10)}}
    return out


def products_child(job: dict) -> dict:
    """One ``[1, K] x [K, N]`` product per session on the GPU, as 4-bit and 8-bit MatMulNBits and as
    a float MatMul, timed alone (median of 30 runs, output read back): which kernels a GPU form
    should use, e.g. for the head's vocab-wide product."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgepipe.runtime.devices import add_to_session, resolve

    device = resolve(job["device"])
    rng = np.random.default_rng(0)
    out = {}
    for n, k in job["shapes"]:
        for kind in ("nbits4", "nbits8", "float32"):
            x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
            y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
            if kind == "float32":
                inits = [numpy_helper.from_array(rng.standard_normal((k, n), np.float32) * 0.01, "w")]
                node = helper.make_node("MatMul", ["x", "w"], ["y"])
            else:
                bits = 4 if kind == "nbits4" else 8
                blocks = k // 32
                inits = [numpy_helper.from_array(rng.integers(0, 255, (n, blocks, 32 * bits // 8), dtype=np.uint8), "q"),
                         numpy_helper.from_array((rng.random(n * blocks, np.float32) * 0.01), "s")]
                node = helper.make_node("MatMulNBits", ["x", "q", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=32)
            model = helper.make_model(helper.make_graph([node], kind, [x], [y], inits),
                                      opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
            options = ort.SessionOptions()
            session = ort.InferenceSession(model.SerializeToString(), options, providers=add_to_session(options, device))
            feed = {"x": rng.standard_normal((1, k), np.float32)}
            for _ in range(3):
                session.run(None, feed)
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                session.run(None, feed)
                times.append(time.perf_counter() - t0)
            out[f"{kind} N={n} K={k}"] = round(float(np.median(times)) * 1e3, 3)
    return out


def run_child(job: dict, env: dict, timeout: float) -> dict:
    entry = "profile_child" if job.get("profile") else "products_child" if job.get("products") else "child"
    code = "import json, sys; from benchmarks.gpu import %s; print('RESULT', json.dumps(%s(json.loads(sys.argv[1]))))" % (entry, entry)
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode or line is None:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:400]}
    return json.loads(line[7:])


# -- the cluster check ------------------------------------------------------------------------------

def cluster_check(package: Path, home: Path, env: dict, gpu_env: dict, max_tokens: int = 16) -> dict:
    """serve + one GPU worker + two CPU workers; the API's greedy ids vs the one-process pipeline."""
    from edgepipe.bench.cluster import Server

    server, procs = None, []
    result: dict = {}
    try:
        server = Server(home, workers=0, args=("--model", str(package), "--placement", "memory", "--min-workers", "3"), wait_up=False,
                        timeout=120, env=env, client_timeout=600)
        for name, device, extra in (("gpu0", "gpu", gpu_env), ("cpu1", "cpu", {}), ("cpu2", "cpu", {})):
            procs.append(server.worker("--name", name, "--device", device, "--memory", "64GB", "--threads", "4", home=home,
                                       env={**env, **extra}, log=home / f"worker-{name}.log"))
        status = server.wait_for(lambda s: s["state"] == "up" and bool(s["plan"]) and len(s["plan"]["stages"]) == 3, 400)
        stages = status["plan"]["stages"]
        r = server.client.post("/v1/completions", json={"prompt": "hello world, this is a pipeline", "max_tokens": max_tokens, "temperature": 0,
                                                        "return_token_ids": True})
        r.raise_for_status()
        got = r.json()["choices"][0]["token_ids"]
        result = {"stages": stages, "api_tokens": got}
    except Exception as e:  # reported, not raised: the speed table is still worth keeping
        result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if server is not None:
            server.close()
    if "error" in result:
        return result
    code = "import json, sys; from benchmarks.gpu import reference; print('RESULT', json.dumps(reference(*json.loads(sys.argv[1]))))"
    done = subprocess.run([sys.executable, "-c", code, json.dumps([str(package), result["stages"], max_tokens])],
                          env={**env, "EDGEPIPE_HOME": str(home), **gpu_env}, capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {**result, "error": "reference failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    result["reference_tokens"] = json.loads(line[7:])
    result["equal"] = result["api_tokens"] == [t for t in result["reference_tokens"]][: len(result["api_tokens"])]
    return result


def reference(package: str, stages: list[dict], max_tokens: int) -> list[int]:
    """The same prompt, cuts and devices in one process (what the cluster must equal)."""
    from edgepipe.model.package import Package
    from edgepipe.runtime.devices import resolve
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    pkg = Package(package)
    cuts = [s["start"] for s in stages[1:]]
    devices = [resolve("gpu" if "gpu0" in s["worker"] else "cpu") for s in stages]  # the workers are named gpu0, cpu1, cpu2
    tok = pkg.tokenizer
    ids = tok.encode("hello world, this is a pipeline")
    out = generate(pkg.pipeline(cuts, threads=4, devices=devices), ids, GenerationParams(max_tokens=max_tokens), tok.decode, pkg.manifest.eos_ids)
    return [t for t in out.tokens if t not in pkg.manifest.eos_ids]


# -- the run ------------------------------------------------------------------------------------

def gpu_names() -> str | None:
    """The GPUs ``nvidia-smi -L`` lists, None without one."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--forms", default="gpu,cpu", help="graph forms to time on the GPU (gpu: graphs.gpu_form, cpu: as the CPU runs it)")
    ap.add_argument("--software", action="store_true", help="use SwiftShader (Debian chromium's) as the GPU: CI-sized runs")
    ap.add_argument("--cluster-shape", default=None, help="shape for the GPU + 2 CPU cluster check (default: the first shape; 'none' skips)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("GPU_BENCH_WORK", "/tmp/edgepipe-gpu-bench")))
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu", help="results path without suffix (default benchmarks/results/gpu)")
    ap.add_argument("--products", action="store_true", help="time single 4-bit / 8-bit / float products on the GPU first")
    ap.add_argument("--product-shapes", default="128256x2048,128256x4096,8192x2048,4096x4096", help="NxK, comma-separated")
    ap.add_argument("--profile", action="store_true", help="also time the layers and the head apart on the GPU, with ONNX Runtime's profiler")
    ap.add_argument("--budget-s", type=float, default=120, help="decode time limit per configuration")
    args = ap.parse_args()

    from edgepipe.bench.synthetic import SHAPES, write_synthetic_gguf
    from edgepipe.model.importer import import_model

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    gpu_env = dict(SOFTWARE_ENV) if args.software else {}
    args.work.mkdir(parents=True, exist_ok=True)
    run = Conditions.start()
    run.machine["gpu"] = gpu_names()
    report = {**run.as_dict(), "args": {k: str(v) for k, v in vars(args).items()},
              "software_adapter": args.software, "shapes": []}
    packages = {}
    if args.products:
        report["products_ms"] = run_child({"products": True, "device": "gpu", "shapes": [[int(v) for v in p.split("x")] for p in args.product_shapes.split(",")]},
                                          {**env, **gpu_env}, timeout=300)
        print("== products (ms):", report["products_ms"], flush=True)
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        gguf_path = args.work / f"{name}.gguf"
        t0 = time.perf_counter()
        if not gguf_path.exists():
            write_synthetic_gguf(gguf_path, **shape)
        written = time.perf_counter() - t0
        t0 = time.perf_counter()
        package = import_model(gguf_path, args.work / "home" / "models", measure_cost=False)
        packages[name] = package
        entry = {"shape": name, **shape, "file_gb": round(gguf_path.stat().st_size / 1e9, 2), "write_s": round(written, 1),
                 "import_s": round(time.perf_counter() - t0, 1), "runs": []}
        print(f"== {name}: file {entry['file_gb']} GB, import {entry['import_s']} s", flush=True)
        jobs = [{"device": "cpu", "form": "cpu", "threads": args.threads}]
        jobs += [{"device": "gpu", "form": f, "threads": 2} for f in args.forms.split(",")]
        for job in jobs:
            job.update(package=str(package), prompt=args.prompt, steps=args.steps, budget_s=args.budget_s)
            result = run_child(job, {**env, **(gpu_env if job["device"] == "gpu" else {})}, timeout=args.budget_s + 300)
            result.setdefault("device", job["device"])
            result.setdefault("form", job["form"])
            print("  ", {k: v for k, v in result.items() if k != "tokens"}, flush=True)
            entry["runs"].append(result)
        cpu_tokens = entry["runs"][0].get("tokens") or []
        for r in entry["runs"][1:]:
            if r.get("tokens"):
                r["same_tokens_as_cpu"] = sum(1 for _ in zip(cpu_tokens, r["tokens"]) if _[0] == _[1])
                r["speedup_vs_cpu"] = round(r["tok_s"] / entry["runs"][0]["tok_s"], 2) if entry["runs"][0].get("tok_s") else None
        if args.profile:
            entry["gpu_profile"] = run_child({"profile": True, "device": "gpu", "threads": 2, "package": str(package), "cpu_threads": args.threads},
                                             {**env, **gpu_env}, timeout=args.budget_s + 300)
            print("   profile:", entry["gpu_profile"], flush=True)
        report["shapes"].append(entry)
        _write(report, args.out, run)
    cluster_shape = args.cluster_shape or args.shapes.split(",")[0]
    if cluster_shape != "none":
        print(f"== cluster: 1 GPU + 2 CPU workers, {cluster_shape}", flush=True)
        report["cluster"] = {"shape": cluster_shape, **cluster_check(packages[cluster_shape], args.work / "home", env, gpu_env)}
        print("  ", report["cluster"], flush=True)
    _write(report, args.out, run)


def _write(report: dict, out: Path, run: Conditions) -> None:
    """Write (and rewrite after each shape) ``out``.json and .md, with the load at the time of writing."""
    report.update(run.finish().as_dict())
    m = report["machine"]
    lines = [f"# GPU stage vs CPU stage ({report['date']})", "",
             f"{run.line()} · GPU: {m['gpu'] or ('SwiftShader (software)' if report['software_adapter'] else 'none found')} · "
             f"Python {m['python']}", "",
             "| shape | engine | graph form | decode tok/s | x CPU | weight GB/s | prefill s | host<->device B/step | tokens = CPU's |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in report["shapes"]:
        for r in s["runs"]:
            if "error" in r:
                lines.append(f"| {s['shape']} | {r['device']} | {r['form']} | error: {r['error'][:120]} | | | | | |")
                continue
            engine = f"CPU, {r['threads']} threads" if r["form"] == "cpu" and r["device"].startswith("cpu") else r["device"]
            lines.append(f"| {s['shape']} | {engine} | {r['form']} | {r['tok_s']} | {r.get('speedup_vs_cpu', 1.0)} | {r['weight_gb_s']} | "
                         f"{r['prefill_s']} | {r['host_bytes_per_step']} | {r.get('same_tokens_as_cpu', '-')} / {len(r['tokens'])} |")
    c = report.get("cluster")
    if c:
        lines += ["", f"Cluster on this machine ({c['shape']}): " + (
            f"stages {[(st['worker'], st['start'], st['end']) for st in c['stages']]}; "
            f"API tokens equal the one-process pipeline on the same devices: **{c.get('equal')}** ({len(c.get('api_tokens', []))} tokens)"
            if "error" not in c else f"error: {c['error']}")]
    write_results(out.name, report, "\n".join(lines), out.parent)


if __name__ == "__main__":
    main()
