"""Regenerate the golden frames: ``.venv/bin/python tests/data/golden_frames/make.py``.

Writes, next to this file, the frames a coordinator sends to one worker (``NN_<type>.frame``:
exactly the bytes ``net.protocol.encode`` makes of the coordinator's own messages, from
``cluster.deploy.load_message`` and ``net.messages``), the answers a correct worker gives
(``NN_<type>.answer<i>.frame``) and ``script.json`` (order and matching rules). The model is the
bundled SmolLM2-135M, fp32 variant (what a browser worker gets): a one-layer stage (units
``[1, 2)``, plan 7, relaying its activations) and the head (``[31, 32)``, plan 8, sampling).
No weights are written here: the load frames name unit files by sha256, and the test serves
them from the same package imported at test time. Expected activations and tokens come from
``Package.runner`` (a StageRunner run directly, not through any worker's message handling).

Regenerate when the wire format, the model import or the stage graphs change (the test then
says the load frames name files the package lacks), and review the diff.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from edgepipe.cluster.rules.deploy import load_message  # noqa: E402
from edgepipe.net import messages as M  # noqa: E402
from edgepipe.net.protocol import Message, encode  # noqa: E402
from edgepipe.runtime.stage_runner import SamplingBatch  # noqa: E402

WORKER_ID, NEXT_ID, PREVIOUS_ID = "w1-golden", "w2-golden", "w0-golden"
LAYER_PLAN, HEAD_PLAN, LAYER, HEAD = 7, 8, (1, 2), (31, 32)
MAX_CONTEXT = 16  # the layer stage's context (small, so one frame can overflow it)
GREEDY = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0}
SAMPLED = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "uniform": 0.37}
ATOL, RTOL = 2e-3, 2e-3  # activations: |got - want| <= ATOL + RTOL * |want| (fp32 kernels differ in the last bits)


def package(home: str | None):
    from edgepipe.model.store import resolve

    return resolve("smollm2", "fp32", home or os.environ.get("EDGEPIPE_HOME") or tempfile.mkdtemp(prefix="golden-home-"))


def item(seq: str, step: int, sampling=GREEDY, **extra) -> dict:
    return {"seq": seq, "step": step, "rid": seq.split(".")[0], "sampling": dict(sampling), **extra}


def timing(positions: int, batch: int, worker=WORKER_ID, seconds=0.0) -> list:
    return [worker, seconds, positions, 4, batch]


def build(pkg) -> tuple[list[dict], dict]:
    """(steps, model facts): each step {"send": Message, "answers": [(Message, rules)], "ends": bool}."""
    m = pkg.manifest
    tok = pkg.tokenizer
    ids = tok.encode("The golden frames of edgepipe say hello to every worker")[:6]
    assert len(ids) == 6, ids  # 6 positions; twice that (12) + 5 overflows MAX_CONTEXT
    embed, layer, head = pkg.runner(0, 1), pkg.runner(*LAYER), pkg.runner(*HEAD)
    x0 = embed.run("g", np.array([ids], np.int64))  # [1, 6, H]: what unit 0 hands unit 1
    x1 = np.concatenate([embed.run("g", np.array([[ids[2]]], np.int64)),  # g's next position, and h's first (a one-token prompt)
                         embed.run("h", np.array([[ids[1]]], np.int64))]).astype(np.float16)  # [2, 1, H] float16
    xc = embed.run("c", np.array([ids * 2], np.int64)).astype(np.float16)  # [1, 12, H]
    hidden = x0.shape[2]

    next_hop = {"kind": "worker", "id": NEXT_ID, "url": "ws://127.0.0.1:9/", "relay": True}
    load_layer = dataclasses.replace(load_message(pkg, LAYER_PLAN, *LAYER, "fp32", next_hop, [LAYER_PLAN], data_secret="golden-secret"),
                                     max_context=MAX_CONTEXT)
    load_head = load_message(pkg, HEAD_PLAN, *HEAD, "fp32", {"kind": "coordinator"}, [LAYER_PLAN, HEAD_PLAN])
    prefetch = dataclasses.replace(load_message(pkg, -3, *LAYER, "fp32", next_hop, [LAYER_PLAN, HEAD_PLAN]), prefetch=True)
    files = lambda load: [load.graph, *load.files]  # noqa: E731
    size = lambda shas: sum(pkg.blob(s).stat().st_size for s in shas)  # noqa: E731
    weights = lambda load: size(load.files)  # noqa: E731

    def forward(plan, batch, x, timings=None):
        return M.Forward(plan, batch, timings).to_message({"x": x})

    def relayed(plan, batch, x, timings):  # a stage's output as the worker sends it on (relay: over its control channel)
        return Message(M.T.FORWARD, {"plan": plan, "batch": batch, "timings": timings, "relay_to": NEXT_ID}, {"x": x})

    def token(plan, batch, tokens, timings):
        return Message(M.T.TOKEN, {"plan": plan, "batch": batch, "tokens": [int(t) for t in tokens], "timings": timings})

    def error(code, b, text):  # the text is an example: any one line will do, the code must be this one
        return Message(M.T.ERROR, {"message": text, "code": code.value, "seq": b["seq"], "step": b["step"], "rid": b["rid"]})

    steps = []

    def step(msg, *answers, ends=False):
        steps.append({"send": msg, "answers": list(answers), "ends": ends})

    step(M.Welcome(WORKER_ID).to_message())
    step(M.Ping(12.5).to_message(), (M.Pong(12.5).to_message(), {"measured": ["kv_bytes", "queue", "busy_s", "computed"]}))
    step(load_layer.to_message(), (M.Loaded(True, LAYER_PLAN, fetched_bytes=size(files(load_layer)), load_s=0.0,
                                            weight_bytes=weights(load_layer)).to_message(), {"measured": ["load_s"]}))
    step(load_head.to_message(), (M.Loaded(True, HEAD_PLAN, fetched_bytes=size(files(load_head)), load_s=0.0,
                                           weight_bytes=weights(load_head)).to_message(), {"measured": ["load_s"]}))
    # Prefill through the layer stage, relayed on (a frame that already passed stage 0: its timing comes along).
    b = [item("g.0", 0)]
    y0 = layer.run("g.0", x0)
    step(forward(LAYER_PLAN, b, x0, [timing(6, 1, PREVIOUS_ID, 0.0125)]),
         (relayed(LAYER_PLAN, b, y0, [timing(6, 1, PREVIOUS_ID, 0.0125), timing(6, 1)]), {"tensors": True}))
    # The head samples greedily from it.
    step(forward(HEAD_PLAN, b, y0, [timing(6, 1, NEXT_ID, 0.02)]),
         (token(HEAD_PLAN, b, head.run("g.0", y0, SamplingBatch.greedy(1)), [timing(6, 1, NEXT_ID, 0.02), timing(6, 1)]), {}))
    # A decode lane of two sequences, float16 activations on the wire.
    b = [item("g.0", 1), item("h.0", 0, SAMPLED)]
    y1 = layer.run_batch(["g.0", "h.0"], x1.astype(np.float32))
    step(forward(LAYER_PLAN, b, x1), (relayed(LAYER_PLAN, b, y1, [timing(1, 2)]), {"tensors": True}))
    sampling = SamplingBatch(True, np.array([1.0, 0.8], np.float32), np.array([1, 40], np.int64), np.array([1.0, 0.95], np.float32),
                             np.array([0.0, 0.37], np.float32))
    step(forward(HEAD_PLAN, b, y1), (token(HEAD_PLAN, b, head.run_batch(["g.0", "h.0"], y1, sampling), [timing(1, 2)]), {}))
    # A replay frame before the last (partial): the head computes and sends nothing.
    step(forward(HEAD_PLAN, [item("p.0", 0, partial=True)], y0))
    # Drop frees the sequence, and its id is never run again: a frame of it that comes after (one that
    # sat behind a stall while the coordinator replayed the request) is stale, discarded without an
    # answer, lest it bring the dropped KV back. The replay runs under the next epoch's id from an empty KV.
    step(M.Drop("g.0").to_message())
    x2 = x1[:1].astype(np.float32)
    step(forward(LAYER_PLAN, [item("g.0", 2)], x2))
    b = [item("g.1", 0)]  # in a frame beside a stale entry: its row alone runs
    step(forward(LAYER_PLAN, [item("g.0", 2), *b], np.concatenate([x2 + 1, x2])),
         (relayed(LAYER_PLAN, b, layer.run("g.1", x2), [timing(1, 1)]), {"tensors": True}))
    # Failures, each with its code.
    b = [item("e.0", 0)]
    step(forward(99, b, x2), (error(M.ErrorCode.NO_STAGE, b[0], f"worker {WORKER_ID} holds no stage for plan 99"), {"text": ["message"]}))
    step(forward(LAYER_PLAN, b, np.concatenate([x2, x2])), (error(M.ErrorCode.BAD_INPUT, b[0], "forward frame: x has 2 rows for 1 sequences"), {"text": ["message"]}))
    bad = x2.copy()
    bad[0, 0, 3] = np.nan
    step(forward(LAYER_PLAN, b, bad), (error(M.ErrorCode.CORRUPT_INPUT, b[0], f"plan {LAYER_PLAN}: non-finite activations: 1 of {hidden} values are NaN or infinite"), {"text": ["message"]}))
    b = [item("c.0", 0)]
    step(forward(LAYER_PLAN, b, xc), (relayed(LAYER_PLAN, b, layer.run("c.0", xc.astype(np.float32)), [timing(12, 1)]), {"tensors": True}))
    b = [item("c.0", 1, pos=14)]  # c.0 holds 12 positions: a frame in between was lost
    step(forward(LAYER_PLAN, b, x2), (error(M.ErrorCode.CORRUPT_INPUT, b[0], f"plan {LAYER_PLAN}: c.0 holds 12 positions, the frame starts at 14 "
                                                                              "(a frame was lost)"), {"text": ["message"]}))
    b = [item("c.0", 1)]
    step(forward(LAYER_PLAN, b, xc[:, :5]), (error(M.ErrorCode.CONTEXT, b[0], f"sequence c.0 would reach 17 tokens, over the context of {MAX_CONTEXT}"), {"text": ["message"]}))
    # The layer stage is let go; its plan is then unknown here.
    step(M.Activate([HEAD_PLAN]).to_message())
    b = [item("g.1", 1)]
    step(forward(LAYER_PLAN, b, x2), (error(M.ErrorCode.NO_STAGE, b[0], f"worker {WORKER_ID} holds no stage for plan {LAYER_PLAN}"), {"text": ["message"]}))
    # A spare's prefetch: files held already, nothing fetched or built.
    step(prefetch.to_message(), (M.Loaded(True, -3, fetched_bytes=0, prefetched=True).to_message(), {}))
    step(M.Probe(5, kind="link", bytes=4096).to_message(),
         (M.Probed(5, True).to_message({"payload": np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)}),
          {"tensors": True, "any_bytes": ["payload"]}))
    step(M.Probe(6, plan=HEAD_PLAN, reps=2, context=4).to_message(), (M.Probed(6, True, [0.0, 0.0]).to_message(), {"measured": ["times"]}))
    step(M.Emulate(1.0).to_message())
    step(M.Ping(99.25).to_message(), (M.Pong(99.25).to_message(), {"measured": ["kv_bytes", "queue", "busy_s", "computed"]}))
    step(M.Bye(final=True).to_message(), ends=True)
    facts = {"model": m.name, "precision": "fp32", "hidden": hidden, "worker_id": WORKER_ID,
             "blobs": sorted(set(files(load_layer) + files(load_head))), "atol": ATOL, "rtol": RTOL}
    return steps, facts


def write(steps: list[dict], facts: dict, out: Path = HERE) -> None:
    for old in out.glob("*.frame"):
        old.unlink()
    script = {"about": "frames a coordinator sends one worker, in order, and the answers a correct worker gives "
                       "(made by make.py; see docs/protocol.md, golden frames)", **facts, "steps": []}
    for i, s in enumerate(steps):
        name = f"{i:02d}_{s['send'].type.value}"
        (out / f"{name}.frame").write_bytes(encode(s["send"]))
        answers = []
        for j, (msg, rules) in enumerate(s["answers"]):
            (out / f"{name}.answer{j}.frame").write_bytes(encode(msg))
            answers.append({"frame": f"{name}.answer{j}.frame", **rules})
        script["steps"].append({"send": f"{name}.frame", "answers": answers, **({"ends": True} if s["ends"] else {})})
    (out / "script.json").write_text(json.dumps(script, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", help="edgepipe home holding (or to import) the bundled model")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    steps, facts = build(package(args.home))
    write(steps, facts, args.out)
    sizes = [p.stat().st_size for p in args.out.glob("*.frame")]
    print(f"{len(steps)} steps, {len(sizes)} frames, largest {max(sizes)} bytes, {sum(sizes)} bytes in all -> {args.out}")


if __name__ == "__main__":
    main()
