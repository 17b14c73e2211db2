"""GPU stages on ONNX Runtime's WebGPU EP, in CI on a software adapter (SwiftShader, from Debian's
chromium): the device a worker resolves to, KV resident in device memory, what crosses between
host and device per step, KV moves between device kinds, and a GPU worker serving the bundled model
beside CPU workers with the tokens of the single process on the same devices.

GPU code runs in child processes: the WebGPU EP is registered once per process, and only those
processes may see the software adapter (a local worker of another test must not pick it up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgepipe.runtime.devices import CPU, resolve

SWIFTSHADER_ICD = Path("/usr/lib/chromium/vk_swiftshader_icd.json")
SOFTWARE_GPU = {"VK_ICD_FILENAMES": str(SWIFTSHADER_ICD), "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": "1"}
ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str, env: dict, home: Path, timeout: float = 300):
    """Run ``code`` in a fresh interpreter; it prints ``RESULT <json>`` as its last line. A JSON
    object comes back with the child's stderr added under ``_stderr``."""
    full = {**os.environ, "EDGEPIPE_HOME": str(home), **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, f"child failed ({done.returncode}):\n{done.stderr[-3000:]}"
    value = json.loads(line[7:])
    return {**value, "_stderr": done.stderr} if isinstance(value, dict) else value


@pytest.fixture(scope="module")
def software_gpu():
    assert SWIFTSHADER_ICD.is_file(), f"{SWIFTSHADER_ICD} is missing: Debian's chromium ships SwiftShader (bootstrap.sh test installs it)"
    return SOFTWARE_GPU


def test_device_specs_and_the_cpu_fallback_say_why(home):
    assert resolve("cpu") == CPU and not CPU.is_gpu
    with pytest.raises(ValueError, match="--device must be"):
        resolve("tpu")
    # Without the software adapter allowed there is no GPU here: the CPU, with the reason in one line.
    env = {k: "" for k in SOFTWARE_GPU} | {"ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": "0"}
    got = run_child("""
        import json
        from edgepipe.runtime.devices import resolve
        d, n = resolve("gpu"), resolve("gpu:3")
        print("RESULT", json.dumps({"kind": d.kind, "note": d.note, "n_note": n.note, "auto": resolve("auto").kind}))
    """, env, home)
    assert got["kind"] == "cpu" and got["auto"] == "cpu"
    assert got["note"] and "\n" not in got["note"] and "adapter" in got["note"]
    assert got["n_note"] and "\n" not in got["n_note"]
    # Without the provider package (a worker installed without the gpu extra): the CPU, and the pip line.
    missing = run_child("""
        import json, sys
        sys.modules["onnxruntime_ep_webgpu"] = None  # import fails as if not installed
        from edgepipe.runtime.devices import resolve
        d = resolve("gpu")
        print("RESULT", json.dumps({"kind": d.kind, "note": d.note}))
    """, SOFTWARE_GPU, home)
    assert missing["kind"] == "cpu" and "pip install 'edgepipe[gpu]'" in missing["note"], missing


@pytest.mark.slow  # ~12-14 s: the default suite's 12-minute bound; a GPU stage's exact tokens stay checked by test_gpu_worker_serves_with_cpu_workers_exactly
def test_gpu_stage_keeps_kv_on_the_device_and_moves_only_activations(home, int4_pkg, software_gpu):
    """Units [1, 4) of the bundled model on the software GPU: KV buffers live in device memory, a
    decode step moves its input and output hidden rows (and lengths), a KV export from the GPU
    imported into another GPU runner continues with the same bits, batched rows give each
    sequence what it gets alone, and KV computed on the GPU continues on the CPU (a move or
    replay onto another kind of device) close to the GPU's own continuation. One child process:
    each start registers the EP and brings SwiftShader up again."""
    got = run_child("""
        import json, collections
        import numpy as np, onnxruntime as ort
        from edgepipe.model.store import resolve as open_pkg
        from edgepipe.runtime.devices import resolve
        pkg = open_pkg("smollm2", "int4")
        gpu = resolve("gpu")
        assert gpu.is_gpu, gpu.note
        H = pkg.manifest.config["hidden_size"]
        rng = np.random.default_rng(0)
        prompt = rng.standard_normal((1, 5, H)).astype(np.float32)
        steps = rng.standard_normal((3, 1, 1, H)).astype(np.float32)
        a = pkg.runner(1, 4, device=gpu)
        cpu = pkg.runner(1, 4)
        a.run("s", prompt); cpu.run("s", prompt)
        outs, moved = [], []
        for x in steps:
            outs.append(a.run("s", x)); moved.append(a.host_bytes)
        ref = [cpu.run("s", x) for x in steps]
        devices = sorted({v.device_name() for v in a._pool.arrays.values()})
        # KV export (host) -> a second GPU runner, then one more step on each: the same bits
        kv = a.export_kv("s")
        b = pkg.runner(1, 4, device=gpu)
        b.import_kv("s", kv, a.length("s"))
        nxt = rng.standard_normal((1, 1, H)).astype(np.float32)
        same_after_move = bool(np.array_equal(a.run("s", nxt), b.run("s", nxt)))
        # batched lanes on the device: t0 and t1 together, each also alone in a fresh runner
        lanes = pkg.runner(1, 4, device=gpu)
        alone = pkg.runner(1, 4, device=gpu)
        p2 = rng.standard_normal((2, 1, 4, H)).astype(np.float32)
        for i in range(2):
            lanes.run(f"t{i}", p2[i]); alone.run(f"t{i}", p2[i])
        y = rng.standard_normal((2, 1, H)).astype(np.float32)
        together = lanes.run_batch(["t0", "t1"], y)
        apart = np.concatenate([alone.run("t0", y[:1]), alone.run("t1", y[1:])])
        # KV computed on the GPU continues on the CPU (a move or replay onto another kind of device)
        g, c = pkg.runner(1, 4, device=gpu), pkg.runner(1, 4)
        g.run("k", rng.standard_normal((1, 6, H)).astype(np.float32))
        c.import_kv("k", g.export_kv("k"), g.length("k"))
        x = rng.standard_normal((1, 1, H)).astype(np.float32)
        yg, yc = g.run("k", x), c.run("k", x)
        kinds = {"diff": float(np.abs(yg - yc).max()), "scale": float(np.abs(yg).max()), "lengths": [g.length("k"), c.length("k")]}
        print("RESULT", json.dumps({"kinds": kinds, 
            "devices": devices, "moved": moved, "step_bytes": int(steps[0].nbytes),
            "max_diff_vs_cpu": float(max(np.abs(o - r).max() for o, r in zip(outs, ref))),
            "scale": float(np.abs(ref[0]).max()), "same_after_move": same_after_move,
            "lanes_diff": float(np.abs(together - apart).max()), "kv_bytes": a.kv_bytes}))
    """, software_gpu, home)
    assert got["devices"] == ["webgpu"]
    # quiet: ONNX Runtime's provider and sessions log errors only (a GPU worker used to print ~250 warnings)
    assert "[W:onnxruntime" not in got["_stderr"] and "XDG_RUNTIME_DIR" not in got["_stderr"], got["_stderr"][-2000:]
    assert got["kv_bytes"] > 0
    # input [1,1,H] + output [1,1,H] + seqlens_k and total length (int32): no KV crosses
    assert all(m == 2 * got["step_bytes"] + 8 for m in got["moved"]), got["moved"]
    assert got["max_diff_vs_cpu"] < 0.02 * got["scale"], got  # other arithmetic, the same model
    assert got["same_after_move"]
    assert got["lanes_diff"] < 1e-4 * got["scale"] + 1e-5, got
    # KV from the GPU continued on the CPU: the CPU's arithmetic on the GPU's cache, close to the GPU's own
    kinds = got["kinds"]
    assert kinds["lengths"] == [7, 7]
    assert kinds["diff"] < 0.02 * kinds["scale"], kinds


def test_gpu_worker_serves_with_cpu_workers_exactly(home, int4_pkg, software_gpu):
    """serve with two CPU workers, plus a worker on the software GPU holding a few units (memory
    placement, a small budget): its hello says gpu and the adapter, it is sent the GPU form of its
    stage, and the API's greedy tokens equal the single process on the same devices and cuts.
    SwiftShader would take minutes to calibrate, so the GPU worker's calibration is given as one a
    coordinator saved earlier (recalled by identity); the first plan's stages are still timed."""
    from harness import Server, remember_device

    adapter = run_child("""
        import json
        from edgepipe.runtime.devices import resolve
        print("RESULT", json.dumps(resolve("gpu").adapter))
    """, software_gpu, home)
    memory = 150 * 10**6
    emulation = {"slowdown": 1.0, "link_delay_ms": 0.0, "link_rate": None, "memory_budget": memory}
    remember_device(home, int4_pkg.manifest, ["gpu0", "native", memory, 1, repr(emulation), None, "gpu", adapter, None])
    with Server(home, workers=2, args=("--precision", "int4", "--placement", "memory", "--local-device", "cpu", "--worker-args", "--memory 1GB",
                                       "--min-workers", "3"), wait_up=False) as server:
        worker = server.worker("--name", "gpu0", "--device", "gpu", "--memory", str(memory), "--threads", "1", env=software_gpu)
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and len(s["plan"]["stages"]) == 3, timeout=300)
            stages = status["plan"]["stages"]
            on_gpu = [i for i, s in enumerate(stages) if "gpu0" in s["worker"]]
            assert len(on_gpu) == 1, stages
            gpu_worker = next(w for w in server.status()["workers"] if "gpu0" in w["id"])
            recalled = [e for e in server.client.get("/v1/cluster/events").json()["events"]
                        if e["kind"] == "calibrated" and e["worker"] == gpu_worker["id"]]
            r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name a colour."}],
                                                                  "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["token_ids"]
        finally:
            worker.terminate()
            worker.wait(30)
    assert gpu_worker["device"] == "gpu" and gpu_worker["adapter"] == adapter and gpu_worker["device_note"] is None, gpu_worker
    assert recalled and recalled[0]["reused"], recalled
    # The reference: the same cuts in one process, the GPU's stage on the software GPU.
    code = f"""
        import json
        from edgepipe.model.store import resolve as open_pkg
        from edgepipe.runtime.devices import resolve
        from edgepipe.runtime.local import generate
        from edgepipe.runtime.sequence import GenerationParams
        pkg = open_pkg("smollm2", "int4")
        tok = pkg.tokenizer
        ids = tok.encode(tok.format_chat([{{"role": "user", "content": "Name a colour."}}]))
        devices = [resolve("gpu") if i == {on_gpu[0]} else resolve("cpu") for i in range({len(stages)})]
        out = generate(pkg.pipeline({[s["start"] for s in stages[1:]]}, devices=devices), ids, GenerationParams(max_tokens=6), tok.decode,
                       pkg.manifest.eos_ids)
        print("RESULT", json.dumps([t for t in out.tokens if t not in pkg.manifest.eos_ids]))
    """
    assert got == run_child(code, software_gpu, home)


TEACHER_TEXT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''


@pytest.mark.slow  # ~25 s on SwiftShader; the default suite keeps the mixed GPU + CPU pipeline and the KV-on-device checks
@pytest.mark.parametrize("gpu_units", [1, None], ids=["1-gpu-layer", "all-layers"])
def test_gpu_form_agrees_with_the_cpu_on_qwen(home, software_gpu, gpu_units):
    """Teacher-forced top-1 of Qwen2.5-Coder-0.5B (the file's own blocks) through a pipeline whose
    first layer (``-m slow``: all 24) runs on the software GPU in the GPU form, against the same
    pipeline on the CPU: >= 99% of 106 positions (one prefill returns every position's top id). The
    embedding and head stay on the CPU in both: the head's vocab-wide product over every prompt
    row is minutes on SwiftShader, and it is the layers' arithmetic that differs between kinds.
    One layer holds every operator of the GPU form (norms, rope, grouped-query attention over all
    positions, the quantized projections, the MLP), and its error passes through the 23 CPU layers
    to the top-1; a second layer on SwiftShader cost ~8 s of compute (quiet box), ~40 s in the suite."""
    from edgepipe.model.store import missing_reference, reference_gguf

    assert missing_reference("qwen05") is None, missing_reference("qwen05")
    code = f"""
        import json
        import numpy as np
        from edgepipe.model.store import resolve as open_pkg
        from edgepipe.runtime.devices import resolve
        from edgepipe.runtime.stage_runner import SamplingBatch
        pkg = open_pkg({str(reference_gguf("qwen05"))!r}, "native")
        ids = pkg.tokenizer.encode({TEACHER_TEXT!r})
        n = len(pkg.manifest.units)
        top1 = {{}}
        cut = {gpu_units!r} and 1 + {gpu_units!r} or n - 1
        first, rest = pkg.runner(0, 1), pkg.runner(cut, n)
        g = SamplingBatch.greedy(1)
        asked = SamplingBatch(g.do_sample, g.temperature, g.top_k, g.top_p, g.uniform, None, 1, np.array([ids[1:] + [0]], np.int64))
        embedded = first.run("s", np.array([ids], np.int64))
        for name in ("cpu", "gpu"):
            hidden = pkg.runner(1, cut, device=resolve(name)).run("s", embedded)
            rest.run(name, hidden, asked)
            top1[name] = rest.last_head[1].prompt_top_ids[:-1, 0].tolist()
        agree = float(np.mean(np.array(top1["cpu"]) == np.array(top1["gpu"])))
        print("RESULT", json.dumps({{"agree": agree, "positions": len(top1["cpu"])}}))
    """
    got = run_child(code, software_gpu, home, timeout=600)
    assert got["positions"] >= 100
    assert got["agree"] >= 0.99, got


@pytest.mark.slow  # a few seconds too long for the default suite's bound; -m slow runs it
def test_gpu_sliding_windows_logprobs_and_masks_work_as_on_the_cpu(home, int4_pkg, software_gpu, tmp_path):
    """On the GPU, as on the CPU: a tiny Gemma 3's window layers keep only their window in device
    memory and give the tokens of the same runners never trimmed; the head's logprobs are the
    CPU's within float tolerance, and a token mask (structured output) is obeyed."""
    got = run_child(f"""
        import json, sys
        sys.path.insert(0, "tests")
        import numpy as np
        from edgepipe.model.importer import import_model
        from edgepipe.model.package import Package
        from edgepipe.model.store import resolve as open_pkg
        from edgepipe.runtime import stage_runner
        from edgepipe.runtime.devices import resolve
        from edgepipe.runtime.stage_runner import RowControls, SamplingBatch, logit_adjust, window_positions
        from test_families import PROMPT, write_tiny_gguf
        gpu = resolve("gpu")
        path = write_tiny_gguf({str(tmp_path / "gemma3.gguf")!r}, "gemma3", seed=11)
        pkg = Package(import_model(path, {str(tmp_path / "models")!r}, "fp32", max_context=256, measure_cost=False))
        ids = pkg.tokenizer.encode(PROMPT)
        def decode(n=12):  # the 19-token prompt is past the window; 12 steps cross two more drops (slack 8)
            pipe = pkg.pipeline([], devices=[gpu])
            feed, out = ids, []
            for _ in range(n):
                out.append(pipe.step("s", feed, SamplingBatch.greedy(1)))
                feed = out[-1:]
            return out, pipe.runners[0]
        trimmed, runner = decode()
        window_buffers = max(v.shape()[2] for k, v in runner._pool.arrays.items() if k in runner._pool.window_names)
        stage_runner.window_start = lambda length, window: 0
        untrimmed, _ = decode()
        # the head: logprobs and a mask, GPU vs CPU
        pkg2 = open_pkg("smollm2", "int4")
        n = len(pkg2.manifest.units)
        x = np.random.default_rng(3).standard_normal((1, 1, pkg2.manifest.config["hidden_size"])).astype(np.float32)
        allowed = np.zeros(pkg2.manifest.config["vocab_size"], bool); allowed[[17, 400, 4000]] = True
        mask = np.packbits(allowed, bitorder="little").tobytes()
        heads = {{}}
        for name in ("cpu", "gpu"):
            head = pkg2.runner(n - 1, n, device=resolve(name))
            g = SamplingBatch.greedy(1)
            plain = SamplingBatch(g.do_sample, g.temperature, g.top_k, g.top_p, g.uniform, None, 5)
            token = int(head.run("a", x, plain)[0])
            out = head.last_head[1]
            masked = SamplingBatch(g.do_sample, g.temperature, g.top_k, g.top_p, g.uniform,
                                   logit_adjust([RowControls(mask=mask)], len(allowed)), 5)
            heads[name] = {{"token": token, "top_ids": out.top_ids[0].tolist(), "top_logprobs": out.top_logprobs[0].tolist(),
                           "masked": int(head.run("b", x, masked)[0])}}
        print("RESULT", json.dumps({{"trimmed": trimmed, "untrimmed": untrimmed, "window_buffers": window_buffers,
                                    "window_limit": window_positions(8), "heads": heads}}))
    """, software_gpu, home)
    assert got["trimmed"] == got["untrimmed"]
    assert got["window_buffers"] <= got["window_limit"]
    cpu, gpu = got["heads"]["cpu"], got["heads"]["gpu"]
    assert gpu["token"] == cpu["token"] and gpu["top_ids"][:3] == cpu["top_ids"][:3]
    assert max(abs(a - b) for a, b in zip(gpu["top_logprobs"], cpu["top_logprobs"])) < 0.05
    assert gpu["masked"] in (17, 400, 4000) and gpu["masked"] == cpu["masked"]


@pytest.mark.pure
def test_private_runtime_dir_is_one_per_user_and_private(tmp_path, monkeypatch):
    """Workers without XDG_RUNTIME_DIR share one private directory (one per process piled up in
    /tmp, never removed); a name held by something not ours and private gets a fresh directory."""
    import os
    import tempfile

    from edgepipe.runtime import devices

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = devices._private_runtime_dir(), devices._private_runtime_dir()
    assert first == second == str(tmp_path / f"edgepipe-xdg-{os.getuid()}")
    assert os.stat(first).st_mode & 0o777 == 0o700
    os.chmod(first, 0o755)  # someone else's or world-readable: not used
    third = devices._private_runtime_dir()
    assert third != first and os.stat(third).st_mode & 0o777 == 0o700
