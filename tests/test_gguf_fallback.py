"""The GGUF kernel library's fallback: who gets the `gguf` form and who the MatMulNBits one.

A worker says in its hello whether its kernel library loaded (`native_kernel`, or a one-line
`native_kernel_note`). Serving the file's own model, the coordinator sends the `gguf` form to CPU
workers with the library and the `native` (MatMulNBits) form to every other — no library, a GPU,
a browser — adding the missing form to the package when a worker needs it. With the library
turned off in a worker, that worker serves the single-process `native` tokens; a pipeline mixing a
kernel worker and a fallback worker serves exactly the single-process tokens of the same mix.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from edgepipe.cluster.rules import deploy
from edgepipe.worker.settings import gguf_kernel as _gguf_kernel
from edgepipe.model.importer import add_variant
from edgepipe.model.store import resolve
from edgepipe.native import reset_for_tests
from edgepipe.progress import LABELS
from edgepipe.net.messages import Hello
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from harness import Server

PROMPTS = ["Name three planets.", "Write a haiku about rain.", "What is 17 times 23?"]
KERNEL = Hello.from_fields({"kind": "native", "device": "cpu", "native_kernel": "gguf"})
NO_LIBRARY = Hello.from_fields({"kind": "native", "device": "cpu", "native_kernel_note": "turned off by EDGEPIPE_NATIVE=0"})
GPU = Hello.from_fields({"kind": "native", "device": "gpu", "native_kernel": "gguf"})  # a GPU stage runs on WebGPU: no custom ops
BROWSER = Hello.from_fields({"kind": "browser", "precision": "fp32"})
OLD_WORKER = Hello.from_fields({"kind": "native"})  # a hello from before the field: no library assumed


@pytest.fixture(scope="module")
def both_home(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-both-home")


@pytest.fixture(scope="module")
def both_forms(both_home):
    """The bundled SmolLM2 imported `native`, with the `gguf` form added."""
    package = resolve("smollm2", "native", both_home)
    add_variant(package.root, "gguf")
    package.reload()
    return package


def without(manifest, precision: str):
    units = tuple(dataclasses.replace(u, variants={k: v for k, v in u.variants.items() if k != precision}) for u in manifest.units)
    return dataclasses.replace(manifest, units=units)


@pytest.mark.parametrize("hello, serving, expected", [
    (KERNEL, None, "gguf"),
    (KERNEL, "gguf", "gguf"),
    (NO_LIBRARY, None, "native"),
    (NO_LIBRARY, "gguf", "native"),
    (OLD_WORKER, None, "native"),
    (GPU, None, "native"),
    (BROWSER, None, "fp32"),  # what it asks for
    (dataclasses.replace(KERNEL, precision="native"), None, "native"),
    (KERNEL, "int4", "int4"),  # not the file's own model: as asked
])
def test_each_worker_is_sent_the_form_it_can_run(both_forms, hello, serving, expected):
    assert deploy.worker_variant(hello, both_forms.manifest, serving) == expected


def test_a_package_with_one_form_sends_it_and_says_which_to_add(both_forms):
    native_only, gguf_only = without(both_forms.manifest, "gguf"), without(both_forms.manifest, "native")
    assert deploy.worker_variant(KERNEL, native_only, None) is None  # the package's own: native
    assert deploy.form_to_add(KERNEL, native_only, None) == "gguf"
    assert deploy.form_to_add(NO_LIBRARY, native_only, None) is None
    assert deploy.form_to_add(GPU, native_only, None) is None
    assert deploy.form_to_add(NO_LIBRARY, dataclasses.replace(gguf_only, precision="gguf"), None) == "native"
    assert deploy.form_to_add(KERNEL, both_forms.manifest, None) is None
    assert deploy.form_to_add(BROWSER, native_only, None) is None  # the browser's own request is handled apart
    assert deploy.form_to_add(KERNEL, native_only, "int4") is None


def test_the_hello_says_whether_the_library_loaded(monkeypatch, caplog):
    try:
        reset_for_tests()
        assert _gguf_kernel(on_gpu=False) == ("gguf", None)
        assert _gguf_kernel(on_gpu=True) == (None, None)
        monkeypatch.setenv("EDGEPIPE_NATIVE", "0")
        reset_for_tests()
        with caplog.at_level(logging.WARNING, logger="edgepipe.worker"):
            assert _gguf_kernel(on_gpu=False) == (None, "turned off by EDGEPIPE_NATIVE=0")
        assert [r.getMessage() for r in caplog.records] == [
            "no GGUF kernel library (turned off by EDGEPIPE_NATIVE=0): falling back to the MatMulNBits graphs"]
    finally:
        reset_for_tests()


def reference(pkg, prompt: str, cuts: list[int], precisions: list[str], n: int) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    out = generate(pkg.pipeline(cuts, precisions=precisions), ids, GenerationParams(max_tokens=n), tok.decode, pkg.manifest.eos_ids).tokens
    return [t for t in out if t not in pkg.manifest.eos_ids]


def served(server, prompt: str, n: int) -> list[int]:
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                                          "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def start_worker(server, name: str, home, kernel: bool):
    return server.worker("--name", name, "--memory", "1GB", home=home, env={"EDGEPIPE_NATIVE": "1" if kernel else "0"})


def stop(*workers) -> str:
    logs = []
    for w in workers:
        w.terminate()
        logs.append(w.communicate(timeout=30)[1])
    return "".join(logs)


@pytest.mark.slow  # a few seconds too long for the default suite's bound; -m slow runs it
def test_a_worker_without_the_library_serves_the_native_tokens(both_forms, both_home):
    """The package carries both forms; the one worker has its library turned off: it is sent the
    MatMulNBits graphs, says why in its hello, logs one line, and serves the single-process
    `native` tokens."""
    with Server(both_home, workers=0, args=("--precision", "native", "--placement", "memory", "--min-workers", "1"),
                wait_up=False) as server:
        worker = start_worker(server, "fallback", both_home, kernel=False)
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and s.get("plan"), timeout=180)
            hello = next(w for w in server.status()["workers"] if "fallback" in w["id"])
            got = [served(server, prompt, 24) for prompt in PROMPTS]
        finally:
            log = stop(worker)
    assert [s["precision"] for s in status["plan"]["stages"]] == ["native"]
    assert hello.get("native_kernel") is None and hello.get("native_kernel_note") == "turned off by EDGEPIPE_NATIVE=0", hello
    assert log.count("falling back to the MatMulNBits graphs") == 1, log
    native = [reference(both_forms, prompt, [], ["native"], 24) for prompt in PROMPTS]
    assert got == native
    assert native != [reference(both_forms, prompt, [], ["gguf"], 24) for prompt in PROMPTS]  # the forms are told apart


def test_a_kernel_worker_beside_a_fallback_worker_serves_the_same_mix_exactly(tmp_path_factory):
    """A `native`-imported package; the kernel worker's join adds the `gguf` form (the
    coordinator's own library builds). Two stages: the kernel worker's runs `gguf`, the fallback
    worker's `native` (joined in that order: memory placement puts the first joiner first), and
    the tokens equal one process running the same cuts and forms — and differ from either form
    alone, so the test tells which stage ran which."""
    home = tmp_path_factory.mktemp("gguf-mix-home")
    pkg = resolve("smollm2", "native", home)
    assert "gguf" not in pkg.manifest.units[1].variants
    with Server(home, workers=0, args=("--precision", "native", "--placement", "memory", "--min-workers", "2"),
                wait_up=False) as server:
        workers = [start_worker(server, "kernel", home, kernel=True)]
        try:
            server.wait_for(lambda s: any("kernel" in w["id"] for w in s["workers"]), timeout=180)
            workers.append(start_worker(server, "fallback", home, kernel=False))
            status = server.wait_for(lambda s: s["state"] == "up" and s.get("plan") and len(s["plan"]["stages"]) == 2, timeout=240)
            hellos = {w["id"].split("-", 1)[1]: w for w in server.status()["workers"]}
            got = [served(server, prompt, 24) for prompt in PROMPTS]
        finally:
            stop(*workers)
    stages = status["plan"]["stages"]
    assert [(s["worker"].split("-", 1)[1], s["precision"]) for s in stages] == [("kernel", "gguf"), ("fallback", "native")], stages
    assert hellos["kernel"].get("native_kernel") == "gguf" and hellos["fallback"].get("native_kernel") is None
    pkg.reload()
    assert all("gguf" in u.variants for u in pkg.manifest.units)  # added on the kernel worker's join
    cut = [stages[1]["start"]]
    mixed = [reference(pkg, prompt, cut, ["gguf", "native"], 24) for prompt in PROMPTS]
    assert got == mixed
    assert mixed != [reference(pkg, prompt, cut, ["native", "native"], 24) for prompt in PROMPTS]
    assert mixed != [reference(pkg, prompt, cut, ["gguf", "gguf"], 24) for prompt in PROMPTS]


@pytest.mark.slow  # ~6 s (suite time): the fallback itself is tested by the library-absent worker and the mixed-pipeline tests
def test_a_coordinator_without_the_library_keeps_the_native_form(tmp_path_factory, monkeypatch):
    """The `gguf` form is added only where the coordinator's own library builds: with it turned
    off there, a kernel worker's join says why the form was skipped, and the worker is sent the
    MatMulNBits graphs and serves the single-process `native` tokens."""
    home = tmp_path_factory.mktemp("gguf-nolib-home")
    pkg = resolve("smollm2", "native", home)
    monkeypatch.setenv("EDGEPIPE_NATIVE", "0")  # the coordinator's process inherits it; the worker is given 1
    log = home / "serve.log"
    with Server(home, workers=0, args=("--placement", "memory", "--min-workers", "1"), wait_up=False, log=log) as server:
        worker = start_worker(server, "kernel", home, kernel=True)
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and s.get("plan"), timeout=180)
            skipped = [e for e in server.client.get("/v1/cluster/events").json()["events"] if e["kind"] == "variant"]
            got = served(server, PROMPTS[0], 24)
        finally:
            stop(worker)
    assert [s["precision"] for s in status["plan"]["stages"]] == ["native"]
    # serve's default is the file's own model, and it says in one line that it has no library
    assert "no GGUF kernel library (turned off by EDGEPIPE_NATIVE=0): running the MatMulNBits graphs" in log.read_text().splitlines()
    assert [(e["precision"], e["status"], e["reason"]) for e in skipped] == [
        ("gguf", "skipped", "the coordinator has no GGUF kernel library: turned off by EDGEPIPE_NATIVE=0")], skipped
    assert "gguf" not in resolve("smollm2", "native", home).manifest.units[1].variants
    assert got == reference(pkg, PROMPTS[0], [], ["native"], 24)


PROGRESS = re.compile("(" + "|".join(map(re.escape, LABELS.values())) + "): ")  # edgepipe.progress's plain lines


def test_generate_runs_the_files_own_model_by_default_and_says_when_it_falls_back(tmp_path_factory):
    """`edgepipe generate` with no --precision: the file's own model. Without the kernel library it
    runs the MatMulNBits graphs, says so in one line and adds no `gguf` form; with it, the `gguf`
    form is added and run, silently. Each prints the single-process tokens of its form."""
    import os
    import subprocess
    import sys

    from edgepipe.model.package import Package

    home = tmp_path_factory.mktemp("gguf-cli-home")

    def cli_generate(kernel: bool) -> subprocess.CompletedProcess:
        env = {**os.environ, "EDGEPIPE_NATIVE": "1" if kernel else "0"}
        return subprocess.run([sys.executable, "-m", "edgepipe", "generate", PROMPTS[0], "-m", "smollm2", "-t", "0", "-n", "24", "--home", str(home)], env=env,
                              capture_output=True, text=True, timeout=180)

    fallback = cli_generate(kernel=False)
    assert fallback.returncode == 0, fallback.stderr
    said = [line for line in fallback.stderr.splitlines() if line and not PROGRESS.match(line)]  # the import's progress comes first
    assert said[0] == "no GGUF kernel library (turned off by EDGEPIPE_NATIVE=0): running the MatMulNBits graphs"
    pkg = Package(home / "models" / "smollm2-135m-instruct-native")
    assert pkg.manifest.precision == "native" and "gguf" not in pkg.manifest.units[1].variants
    kernel = cli_generate(kernel=True)
    assert kernel.returncode == 0, kernel.stderr
    assert "GGUF kernel library" not in kernel.stderr and "re-quantization" not in kernel.stderr, kernel.stderr
    pkg.reload()
    assert all("gguf" in u.variants for u in pkg.manifest.units)
    want = {form: pkg.tokenizer.decode(reference(pkg, PROMPTS[0], [], [form], 24)) for form in ("native", "gguf")}
    assert want["native"] != want["gguf"]  # the forms are told apart on this prompt
    assert (fallback.stdout, kernel.stdout) == (want["native"] + "\n", want["gguf"] + "\n")
