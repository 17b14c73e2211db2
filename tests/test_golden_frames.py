"""Golden frames: the Python worker and the browser worker answer the coordinator's recorded frames alike.

``tests/data/golden_frames/`` holds the frames a coordinator sends one worker (welcome, ping,
two loads, forwards with float32 and float16 activations, a partial replay frame, drop, a
stale frame of the dropped id (discarded, alone and beside a live sequence),
failing frames of each error code (one of them a lost frame: a ``pos`` gap), activate, a
prefetch, probes, emulate, a final bye) as
encoded bytes, the answers a correct worker gives, and ``script.json``; ``make.py`` there
regenerates them. Here each worker is fed the frames in order: the Python worker in process over
``net.channel.memory_pair`` (its real message handling; unit files over HTTP from a local server),
the browser worker (``/worker`` in headless chromium) over a real WebSocket from the same server.

Answers are compared field for field: equal values, except measured ones (times, load
seconds, queue and KV sizes: finite and non-negative, lists of the recorded length), error
messages (one non-empty line; the code, sequence, step and request must be equal) and
activations, within |got - want| <= atol + rtol * |want| with atol = rtol = 2e-3 (script.json:
both workers run fp32 kernels of their own onnxruntime). Token ids must be equal. A field the
golden answer lacks is accepted only if its message dataclass declares it (new optional fields).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
import zlib
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from edgepipe.net import messages as M
from edgepipe.net.channel import ChannelClosed, StarletteChannel, memory_pair
from edgepipe.net.protocol import Message, ProtocolError, decode

GOLDEN = Path(__file__).parent / "data" / "golden_frames"
CLASSES = {cls.TYPE: cls for cls in vars(M).values() if isinstance(cls, type) and issubclass(cls, M.Wire) and cls is not M.Wire}
WORKER_ID = json.loads((GOLDEN / "script.json").read_text())["worker_id"]  # the welcome's: its timings are measured
LOAD_TIMEOUT_S, ANSWER_TIMEOUT_S = 90.0, 20.0  # a load fetches and builds up to ~115 MB of fp32 units


class Golden:
    def __init__(self, root: Path = GOLDEN):
        self.script = json.loads((root / "script.json").read_text())
        self.frames = {p.name: p.read_bytes() for p in root.glob("*.frame")}
        self.atol, self.rtol = self.script["atol"], self.script["rtol"]

    @property
    def steps(self) -> list[dict]:
        return self.script["steps"]


@pytest.fixture(scope="module")
def golden() -> Golden:
    return Golden()


# -- playing the coordinator's part --------------------------------------------------------------
async def play(channel, golden: Golden) -> tuple[Message, list[list[Message]], list[str]]:
    """Send each frame, collect as many answers as recorded; (hello, answers per step, extra frames)."""
    hello = decode(await asyncio.wait_for(channel.recv(), timeout=60))
    got: list[list[Message]] = []
    for step in golden.steps:
        await channel.send(golden.frames[step["send"]])
        answers = []
        timeout = LOAD_TIMEOUT_S if step["send"].endswith("_load.frame") else ANSWER_TIMEOUT_S
        for _ in step["answers"]:
            try:
                answers.append(decode(await asyncio.wait_for(channel.recv(), timeout=timeout)))
            except (asyncio.TimeoutError, ChannelClosed):
                break
        got.append(answers)
    extra = []
    try:  # after the final bye nothing more may come
        while True:
            frame = await asyncio.wait_for(channel.recv(), timeout=0.5)
            extra.append(decode(frame).type.value)
    except (asyncio.TimeoutError, ChannelClosed):
        pass
    return hello, got, extra


# -- comparing answers ---------------------------------------------------------------------------
def _measured(want, got) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_measured(w, g) for w, g in zip(want, got))
    if isinstance(want, bool) or isinstance(got, bool):
        return False
    if isinstance(want, int):
        return isinstance(got, int) and got >= 0
    return isinstance(got, (int, float)) and math.isfinite(got) and got >= 0


def compare(got: Message, want: Message, rules: dict, atol: float, rtol: float) -> list[str]:
    if got.type is not want.type:
        return [f"a {got.type.value} frame ({str(got.fields)[:200]}) where {want.type.value} was due"]
    problems = []
    declared = {f.name for f in fields(CLASSES[want.type])}
    for name in sorted(set(got.fields) - set(want.fields) - declared):
        problems.append(f"{name}: not a field of messages.{CLASSES[want.type].__name__}")
    for name, value in want.fields.items():
        if name not in got.fields:
            problems.append(f"{name}: missing")
        elif name in rules.get("measured", ()):
            if not _measured(value, got[name]):
                problems.append(f"{name}: {got[name]!r} is not a measurement like {value!r}")
        elif name in rules.get("text", ()):
            if not (isinstance(got[name], str) and got[name].strip() and "\n" not in got[name]):
                problems.append(f"{name}: {got[name]!r} is not one line of text")
        elif name == "timings":
            ok = isinstance(got[name], list) and len(got[name]) == len(value) and all(
                isinstance(g, list) and len(g) == 5 and g[0] == w[0] and g[2:] == w[2:] and (_measured(w[1], g[1]) if w[0] == WORKER_ID else g[1] == w[1])
                for g, w in zip(got[name], value))
            if not ok:
                problems.append(f"timings: {got[name]!r} != {value!r} (seconds of this worker's entry aside)")
        elif got[name] != value:
            problems.append(f"{name}: {got[name]!r} != {value!r}")
    if set(got.tensors) != set(want.tensors):
        problems.append(f"tensors {sorted(got.tensors)} != {sorted(want.tensors)}")
    for name, w in want.tensors.items():
        g = got.tensors.get(name)
        if g is None:
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"tensor {name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
        elif name in rules.get("any_bytes", ()):  # a link probe's payload is only timed: its size counts, and that
            if len(zlib.compress(g.tobytes())) < 0.9 * g.nbytes:  # no compressing hop on the way can shrink it
                problems.append(f"tensor {name}: a link probe's payload must be incompressible (random bytes)")
            continue
        elif w.dtype.kind == "f":
            err = np.abs(g.astype(np.float64) - w) - (atol + rtol * np.abs(w))
            if not (np.isfinite(g).all() and err.max(initial=-1) <= 0):
                problems.append(f"tensor {name}: max |got - want| {np.abs(g - w).max():.3g} beyond atol {atol} + rtol {rtol}")
        elif not np.array_equal(g, w):
            problems.append(f"tensor {name}: values differ")
    return problems


def check_hello(hello: Message, kind: str) -> list[str]:
    problems = []
    if hello.type is not M.T.HELLO:
        return [f"first frame is {hello.type.value}, not hello"]
    declared = {f.name for f in fields(M.Hello)}
    problems += [f"hello.{n}: not a field of messages.Hello" for n in hello.fields if n not in declared]
    # every field, null ones too, as ``Hello.to_message`` writes it: a field added to the message
    # and not to a worker shows here, not as a default the coordinator silently assumed
    problems += [f"hello.{n}: missing" for n in sorted(declared) if n not in hello.fields]
    try:
        M.parse(hello)
    except ProtocolError as exc:
        problems.append(f"hello: {exc}")
    if hello.get("kind") != kind or hello.get("protocol") != 1:
        problems.append(f"hello says kind {hello.get('kind')!r}, protocol {hello.get('protocol')!r}")
    return problems


def verdict(golden: Golden, hello: Message, got: list[list[Message]], extra: list[str], kind: str) -> list[str]:
    """Every difference from the golden answers, one line each ('step NN_type: ...')."""
    problems = check_hello(hello, kind)
    for step, answers in zip(golden.steps, got):
        where = step["send"].removesuffix(".frame")
        if len(answers) != len(step["answers"]):
            problems.append(f"{where}: {len(answers)} answers, {len(step['answers'])} due")
        for answer, rule in zip(answers, step["answers"]):
            want = decode(golden.frames[rule["frame"]])
            problems += [f"{where}: {p}" for p in compare(answer, want, rule, golden.atol, golden.rtol)]
    problems += [f"after the final bye: an unexpected {t} frame" for t in extra]
    return problems


# -- a coordinator stand-in: the unit files over HTTP, and (for a tab) the golden frames over /v1/worker ---
class GoldenServer:
    """Serves the package's unit files named in the golden frames, the browser worker's page and
    code (the real routes), and plays the golden frames to the first worker on ``/v1/worker``."""

    def __init__(self, pkg, golden: Golden):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import FileResponse, Response
        from starlette.routing import Route, WebSocketRoute

        from edgepipe.api import browser_routes

        self.golden, self.done = golden, threading.Event()
        self.result, self.error = None, None
        allowed = set(golden.script["blobs"])

        async def blob(request):
            sha = request.path_params["sha"]
            if sha not in allowed or not pkg.blob(sha).is_file():
                return Response("no such blob\n", 404)
            return FileResponse(pkg.blob(sha), media_type="application/octet-stream")

        async def coordinator(ws):
            await ws.accept()
            try:
                self.result = await play(StarletteChannel(ws), golden)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            finally:
                self.done.set()
                await StarletteChannel(ws).close()

        app = Starlette(routes=[*(e.route() for e in browser_routes.routes), Route("/v1/blobs/{sha}", blob), WebSocketRoute("/v1/worker", coordinator)])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "GoldenServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "the golden frame server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def pkg(fp32_pkg, golden):
    missing = [sha for sha in golden.script["blobs"] if not fp32_pkg.blob(sha).is_file()]
    if missing:
        pytest.fail(f"the golden load frames name {len(missing)} unit files this import of {golden.script['model']} lacks "
                    f"(the import or the stage graphs changed): regenerate with .venv/bin/python tests/data/golden_frames/make.py "
                    f"and review the diff")
    return fp32_pkg


# -- the frames themselves -------------------------------------------------------------------------
def test_golden_frames_are_small_typed_coordinator_frames(golden):
    sizes = {p.name: p.stat().st_size for p in GOLDEN.glob("*.frame")}
    assert max(sizes.values()) < 100_000 and sum(sizes.values()) < 500_000, sizes
    referenced = {s["send"] for s in golden.steps} | {a["frame"] for s in golden.steps for a in s["answers"]}
    assert referenced == set(sizes), "script.json and the frames on disk disagree"
    for name, frame in golden.frames.items():
        msg = decode(frame)  # every frame decodes ...
        cls = CLASSES[msg.type]
        known = {f.name for f in fields(cls)}
        assert set(msg.fields) <= known, f"{name}: fields {sorted(set(msg.fields) - known)} are not in messages.{cls.__name__}"
        cls(**msg.fields)  # ... into its dataclass (a required field added since: regenerate)
    sent = [decode(golden.frames[s["send"]]).type.value for s in golden.steps]
    assert {"welcome", "ping", "load", "forward", "drop", "activate", "probe", "emulate", "bye"} <= set(sent)
    codes = {decode(golden.frames[a["frame"]]).get("code") for s in golden.steps for a in s["answers"]}
    assert {"no_stage", "bad_input", "corrupt_input", "context"} <= codes


def test_compare_catches_what_a_worker_gets_wrong(golden):
    """The comparison fails on a wrong token, activations off by more than the tolerance, an
    error without its code, an undeclared field, and a missing answer."""
    step = next(s for s in golden.steps if s["answers"] and decode(golden.frames[s["answers"][0]["frame"]]).type is M.T.TOKEN)
    rule = step["answers"][0]
    want = decode(golden.frames[rule["frame"]])
    assert compare(want, want, rule, golden.atol, golden.rtol) == []
    wrong = Message(want.type, {**want.fields, "tokens": [t + 1 for t in want["tokens"]]})
    assert any(p.startswith("tokens:") for p in compare(wrong, want, rule, golden.atol, golden.rtol))
    odd = Message(want.type, {**want.fields, "favourite": 1})
    assert compare(odd, want, rule, golden.atol, golden.rtol) == ["favourite: not a field of messages.Token"]

    step = next(s for s in golden.steps if s["answers"] and decode(golden.frames[s["answers"][0]["frame"]]).tensors.get("x") is not None)
    rule = step["answers"][0]
    want = decode(golden.frames[rule["frame"]])
    x = want.tensors["x"].copy()
    x.flat[7] += 10 * (golden.atol + golden.rtol * abs(x.flat[7]))
    assert any("beyond atol" in p for p in compare(Message(want.type, want.fields, {"x": x}), want, rule, golden.atol, golden.rtol))

    step = next(s for s in golden.steps if s["answers"] and decode(golden.frames[s["answers"][0]["frame"]]).type is M.T.ERROR)
    rule = step["answers"][0]
    want = decode(golden.frames[rule["frame"]])
    uncoded = Message(M.T.ERROR, {k: v for k, v in want.fields.items() if k != "code"} | {"message": "boom"})
    assert compare(uncoded, want, rule, golden.atol, golden.rtol) == ["code: missing"]
    step = next(s for s in golden.steps if s["answers"] and "any_bytes" in s["answers"][0])
    rule = step["answers"][0]
    want = decode(golden.frames[rule["frame"]])
    zeros = Message(want.type, want.fields, {"payload": np.zeros_like(want.tensors["payload"])})
    assert compare(zeros, want, rule, golden.atol, golden.rtol) == ["tensor payload: a link probe's payload must be incompressible (random bytes)"]
    hello = M.Hello(name="x", token=None, protocol=1, kind="native", memory_bytes=1, threads=1, data_url=None, held=()).to_message()
    got = [[decode(golden.frames[a["frame"]]) for a in s["answers"]] for s in golden.steps]
    assert verdict(golden, hello, got, [], "native") == []
    got[2] = []
    assert verdict(golden, hello, got, ["token"], "native") == ["02_load: 0 answers, 1 due", "after the final bye: an unexpected token frame"]


def test_a_hello_must_carry_every_field_of_the_typed_message_and_parse():
    full = M.Hello(name="x", token=None, protocol=1, kind="native", memory_bytes=1, threads=1, data_url=None, held=()).to_message()
    assert check_hello(full, "native") == []
    short = Message(M.T.HELLO, {k: v for k, v in full.fields.items() if k != "power_idle_w"})
    assert check_hello(short, "native") == ["hello.power_idle_w: missing"]
    bad = Message(M.T.HELLO, {**full.fields, "memory_bytes": -1})
    assert check_hello(bad, "native") == ["hello: hello: memory_bytes must be a number >= 0, got '-1'"]


def test_the_simulated_worker_declares_itself_with_the_typed_hello():
    """The simulation's worker sends the hello the shipped worker sends: every field of
    ``messages.Hello``, parsed by the one ``parse``."""
    from edgepipe.cluster.simulation.sim_worker import FakeWorker

    hello = FakeWorker(None, "n0", 3 << 30).hello().to_message()
    assert check_hello(hello, "native") == []
    assert M.parse(hello).memory_budget == 3 << 30


# -- the Python worker -----------------------------------------------------------------------------
def test_python_worker_answers_the_golden_frames(pkg, golden, tmp_path):
    from edgepipe.worker import Worker, WorkerSettings

    async def main(url: str):
        coordinator_end, worker_end = memory_pair("coordinator", "worker")
        worker = Worker(WorkerSettings(coordinator=url, name="golden", threads=1, cache_dir=tmp_path / "cache"))
        task = asyncio.create_task(worker.run(control=worker_end))
        result = await play(coordinator_end, golden)
        await asyncio.wait_for(task, 10)  # the final bye ends it
        return result

    with GoldenServer(pkg, golden) as server:
        hello, got, extra = asyncio.run(main(server.url))
    problems = verdict(golden, hello, got, extra, "native")
    assert problems == [], "\n".join(problems)


# -- the browser worker ----------------------------------------------------------------------------
@pytest.mark.browser
@pytest.mark.parametrize("webgpu", [False, pytest.param(True, marks=pytest.mark.slow, id="webgpu")])  # SwiftShader: ~45 s more
def test_browser_worker_answers_the_golden_frames_as_the_python_worker(pkg, golden, webgpu):
    """On WebAssembly, and on WebGPU (SwiftShader): the frames load fp32 units, which a WebGPU tab runs too."""
    from browser import browser_context

    with GoldenServer(pkg, golden) as server, browser_context(webgpu=webgpu) as context:
        page = context.new_page()
        page.goto(f"{server.url}/worker?name=golden&memory=2GB")
        # The socket closes 0.5 s after the final bye and the tab then shows 'disconnected': note 'stopped' when it is shown.
        page.evaluate("""() => new MutationObserver(() => { if (document.body.dataset.state === "stopped") self.saidBye = true; })
                              .observe(document.body, { attributes: true, attributeFilter: ["data-state"] })""")
        assert server.done.wait(300), "the tab did not get through the golden frames in 300 s"
        assert server.error is None, f"playing the frames failed: {server.error!r}"
        hello, got, extra = server.result
        page.wait_for_function("self.saidBye === true", timeout=10000)  # a final bye stops the tab
        assert hello.get("device") == ("gpu" if webgpu else "cpu")
    problems = verdict(golden, hello, got, extra, "browser")
    assert problems == [], "\n".join(problems)


def test_every_recorded_frame_parses_both_ways_and_round_trips(golden):
    """One ``parse`` types every frame, the coordinator's and the worker's answers: a field
    renamed or retyped in ``net.messages`` breaks here (and the workers' answers above), not
    silently in one worker. A typed frame the coordinator sent encodes back to the same fields."""
    for name, raw in sorted(golden.frames.items()):
        msg = decode(raw)
        typed = M.parse(msg)
        if not name.split(".")[-2].startswith("answer") and isinstance(typed, M.Wire):
            assert typed.to_message().fields == msg.fields, name
