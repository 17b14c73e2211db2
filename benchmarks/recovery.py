"""Recovery: time from a worker's death to the next token (issue: under 1 s with the spare plan prefetched).

Each trial starts a fresh 3-worker cluster on loopback, streams a long greedy chat request,
SIGKILLs the worker of one pipeline stage right after chunk ``--kill-at`` arrived, and measures

- the client-side gap between the chunk before the kill and the next chunk (and kill -> next chunk),
- the coordinator's own ``recovered.seconds`` (pause of the request until its first token on the
  new plan) and the ``up`` event of the replacement plan (prepare_s, kv_recomputed),
- whether the streamed text equals the single-process reference (``edgepipe.runtime.local``),
- whether a ``spare`` event (files of a plan avoiding one stage's worker prefetched) preceded the kill.

Placement ``planner`` (default): every worker gets a memory budget (``--memory``, default
250MB) under the ~293 MB the whole model needs with the planner's accounting, so the plan must
pipeline over >= 2 workers; the victim is the stage worker that the prefetched spare plan avoids.
Placement ``memory``: layers split over all 3 workers in proportion to memory (no spare plan
exists for this placement); the victim is the last stage's worker.

    python benchmarks/recovery.py [--trials 5] [--tokens 160] [--kill-at 16,48] [--placement planner|memory]
    python benchmarks/recovery.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results

PROMPT = "Tell me a long story about a lighthouse keeper who finds a message in a bottle."


def reference_text(pkg, n: int, verify_form: bool = False) -> str:
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    from edgepipe.model.store import prepare_local_form

    form, _ = prepare_local_form(pkg)  # the form serve's local workers run (the file's own model: gguf where the library loads)
    result = generate(pkg.pipeline(precision=form, verify_form=verify_form), ids, GenerationParams(max_tokens=n, ignore_eos=True), tok.decode,
                      pkg.manifest.eos_ids)
    return tok.decode(result.tokens)


def events(server: Server) -> list[dict]:
    return server.events()


def stream(url: str, n: int, on_chunk, timeout: float) -> tuple[str, list[float]]:
    """Stream a greedy chat completion; returns the text and each content chunk's arrival time."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    pieces, times = [], []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=timeout) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream took longer than {timeout} s")
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            text = "".join(ch.get("delta", {}).get("content", "") for ch in chunk["choices"])
            if not text:
                continue
            times.append(time.monotonic())
            pieces.append(text)
            on_chunk(len(pieces))
    return "".join(pieces), times


def trial(home: Path, args, expected: str, index: int, kill_at: int, replay: str = "steps") -> dict:
    worker_flags = f"--memory {args.memory}" if args.placement == "planner" and args.memory else ""
    sargs = ("--model", args.model, "--precision", args.precision, "--placement", args.placement, "--worker-threads", str(args.threads), "--max-active", "1")
    if replay == "chunk":  # the verify form: a replay is one prefill (graphs.verify_form)
        sargs += ("--verify-form",)
    # checkpoint: the KV is copied to the spare every --checkpoint-tokens tokens; the others replay everything
    sargs += ("--kv-checkpoint-tokens", str(args.checkpoint_tokens if replay == "checkpoint" else 0))
    sargs += tuple(args.serve_args.split())
    if worker_flags:
        sargs += ("--worker-args", worker_flags)
    with Server(home, workers=3, args=sargs, timeout=240) as server:
        # the spare plan is prefetched right after the plan is up (planner placement only)
        spare = None
        deadline = time.monotonic() + 30
        while args.placement == "planner" and time.monotonic() < deadline:
            spare = next((e for e in reversed(events(server)) if e["kind"] == "spare"), None)
            if spare:
                break
            time.sleep(0.2)
        # a short warm-up request so that the first timed steps are not first-run steps
        server.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}).raise_for_status()
        kill, chosen = {}, {}

        def choose() -> None:
            """The victim from the plan serving now (the planner may have moved it since the warm-up)."""
            status = server.status()
            stages = status["plan"]["stages"]
            spare = next((e for e in reversed(events(server)) if e["kind"] == "spare"), None)
            spare_workers = {w for w, _, _ in spare["stages"]} if spare else set()
            stage_workers = [s["worker"] for s in stages]
            candidates = [w for w in stage_workers if w not in spare_workers] if spare else []
            victim_id = candidates[0] if candidates else stage_workers[-1]
            chosen.update(stages=stages, spare=spare, spare_workers=spare_workers, victim_id=victim_id,
                          victim=next(w for w in status["workers"] if w["id"] == victim_id))

        choose()

        def on_chunk(n: int) -> None:
            if n == max(1, kill_at - 4):  # a few chunks before the kill: the status request must not delay the kill itself
                choose()
            if n == kill_at and not kill:
                kill["wall"] = time.time()
                kill["t"] = time.monotonic()
                os.kill(chosen["victim"]["pid"], signal.SIGKILL)

        t0 = time.monotonic()
        text, times = stream(server.url, args.tokens, on_chunk, timeout=args.request_timeout)
        total_s = time.monotonic() - t0
        evs = events(server)
        stages, spare, spare_workers, victim_id = chosen["stages"], chosen["spare"], chosen["spare_workers"], chosen["victim_id"]
        after = [e for e in evs if e["t"] >= kill.get("wall", float("inf")) - 0.001]
        recovered = [e for e in after if e["kind"] == "recovered"]
        resumed = next((e for e in after if e["kind"] == "resume"), None)
        ups = [e for e in after if e["kind"] == "up"]
        leave = next((e for e in after if e["kind"] == "leave" and e["worker"] == victim_id), None)
        k = kill_at
        gaps = [b - a for a, b in zip(times, times[1:])]
        normal = [g for i, g in enumerate(gaps) if i not in (k - 1,)]
        row = {
            "trial": index, "kill_at": kill_at, "replay": replay, "placement": args.placement, "plan_stages": [[s["worker"], s["start"], s["end"]] for s in stages],
            "victim": victim_id, "victim_units": [[s["start"], s["end"]] for s in stages if s["worker"] == victim_id][0],
            "spare_before_kill": bool(spare and spare["t"] < kill.get("wall", 0)),
            "spare_stages": spare["stages"] if spare else None,
            "spare_avoids_victim": bool(spare) and victim_id not in spare_workers,
            "tokens_match": text == expected, "chunks": len(times),
            "first_difference": next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), None if text == expected else min(len(text), len(expected))),
            "text_at_difference": None if text == expected else text[max(0, len(text[:next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), 0)]) - 40):][:120],
            "gap_s": times[k] - times[k - 1] if len(times) > k else None,
            "kill_to_next_chunk_s": times[k] - kill["t"] if len(times) > k and kill else None,
            "median_chunk_gap_s": statistics.median(normal) if normal else None,
            "recovered_s": recovered[0]["seconds"] if recovered else None,
            "detect_s": leave["t"] - kill["wall"] if leave and kill else None,
            "new_plan_prepare_s": ups[0]["prepare_s"] if ups else None,
            "new_plan_stages": next(([st for st in e["stages"]] for e in after if e["kind"] == "prepare"), None),
            "kv_recomputed": ups[0].get("kv_recomputed") if ups else None,
            "resumed_at": resumed["position"] if resumed else None,  # checkpoint: the position the KV was restored to
            "replayed": resumed["replayed"] if resumed else None,  # tokens replayed after it
            "checkpoints_before_kill": sum(1 for e in evs if e["kind"] == "checkpoint" and e["t"] < kill.get("wall", 0)),
            # timeline from the coordinator's events (wall clock, seconds after the kill)
            "timeline_s": {(e["kind"] if e["kind"] != "state" else "state:" + e["state"]): round(e["t"] - kill["wall"], 3) for e in reversed(after)
                           if e["kind"] in ("leave", "pause", "state", "prepare", "up", "recovered", "spare")} if kill else None,
            "request_s": total_s,
        }
        tl = row["timeline_s"] or {}
        if all(k in tl for k in ("leave", "prepare", "up", "recovered")):
            row["phases_s"] = {"detect": tl["leave"], "plan": round(tl["prepare"] - tl["leave"], 3), "load": round(tl["up"] - tl["prepare"], 3),
                               "replay_and_step": round(tl["recovered"] - tl["up"], 3)}
        else:
            row["phases_s"] = None
        print(json.dumps(row), flush=True)
        return row


def summarise(rows: list[dict]) -> dict:
    def med(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None

    def mx(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return max(vals) if vals else None

    out = {
        "gap_s_median": med("gap_s"), "gap_s_max": mx("gap_s"),
        "kill_to_next_chunk_s_median": med("kill_to_next_chunk_s"), "kill_to_next_chunk_s_max": mx("kill_to_next_chunk_s"),
        "recovered_s_median": med("recovered_s"), "recovered_s_max": mx("recovered_s"),
        "new_plan_prepare_s_median": med("new_plan_prepare_s"), "median_chunk_gap_s": med("median_chunk_gap_s"),
        "all_tokens_match": all(r["tokens_match"] for r in rows), "spare_before_kill": sum(r["spare_before_kill"] for r in rows),
        "trials": len(rows), "goal_s": 1.0, "seed_s": 7.0,
    }
    out["goal_met"] = out["kill_to_next_chunk_s_max"] is not None and out["kill_to_next_chunk_s_max"] < 1.0 and out["all_tokens_match"]
    return out


def report(rows: list[dict], args, run: Conditions) -> None:
    positions = sorted({(r["replay"], r["kill_at"]) for r in rows})
    conditions = (f"{run.line()} · {args.model} {args.precision} · 3 local workers, {args.threads} thread each, "
                  f"placement {args.placement}" + (f", EMULATED memory budget {args.memory}/worker" if args.placement == "planner" else "") +
                  f" · greedy chat, {args.tokens} tokens, victim SIGKILLed after chunk {'/'.join(sorted({str(k) for _, k in positions}))} · "
                  f"{len(rows)} trials, "
                  f"fresh cluster each · loopback · shared noisy machine")
    summary = {f"{m} {k}": summarise([r for r in rows if (r["replay"], r["kill_at"]) == (m, k)]) for m, k in positions}
    summary["all"] = summarise(rows)

    def f(x, d=3):
        return "–" if x is None else f"{x:.{d}f}"

    def resumed(r) -> str:
        return "–" if r.get("resumed_at") is None else f"{r['resumed_at']} / {r['replayed']}"

    lines = ["# Recovery after a worker is SIGKILLed mid-stream", "", conditions, "",
             "| trial | replay | kill after chunk | plan (worker units) | victim | spare before kill | gap before/after kill s | kill → next chunk s | coordinator recovered s | new plan prepare s | detect / plan / load / replay+step s | resumed at / replayed | tokens match |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plan = " ".join(f"{w}[{a},{b})" for w, a, b in r["plan_stages"])
        lines.append(f"| {r['trial']} | {r['replay']} | {r['kill_at']} | {plan} | {r['victim']} | {'yes' if r['spare_before_kill'] else 'no'} | {f(r['gap_s'])} | "
                     f"{f(r['kill_to_next_chunk_s'])} | {f(r['recovered_s'])} | {f(r['new_plan_prepare_s'])} | "
                     f"{' / '.join(f(v, 2) for v in r['phases_s'].values()) if r['phases_s'] else '–'} | "
                     f"{resumed(r)} | {'yes' if r['tokens_match'] else 'NO'} |")
    lines += ["", "| replay, killed after chunk (tokens to replay) | trials | client gap around the kill s, median / max | kill → next chunk s, median / max | "
              "coordinator `recovered.seconds`, median / max | new plan prepare s (median) | normal chunk gap s | tokens match | spare before kill | < 1 s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for key in [f"{m} {k}" for m, k in positions] + (["all"] if len(positions) > 1 else []):
        m = summary[key]
        lines.append(f"| {key} | {m['trials']} | {f(m['gap_s_median'])} / {f(m['gap_s_max'])} | {f(m['kill_to_next_chunk_s_median'])} / "
                     f"{f(m['kill_to_next_chunk_s_max'])} | {f(m['recovered_s_median'])} / {f(m['recovered_s_max'])} | "
                     f"{f(m['new_plan_prepare_s_median'])} | {f(m['median_chunk_gap_s'])} | {'all' if m['all_tokens_match'] else 'NO'} | "
                     f"{m['spare_before_kill']}/{m['trials']} | {'yes' if m['goal_met'] else 'no'} |")
    lines += ["", "Goal (issue): death → next token under 1 s for the default model; seed 000 reports 7 s. "
              "The coordinator rebuilds a paused request's KV by replaying prompt + generated tokens on the new plan: `steps` "
              "(the plain graphs) replays each generated token as a decode step, so the time grows with the tokens generated before "
              "the kill; `chunk` (`serve --verify-form`: every position of a chunk has a decode step's bits) replays them in one "
              "prefill. Each replay's text is checked against the single-process reference of its own graph form."]
    if any(m == "checkpoint" for m, _ in positions):
        lines.append(f"`checkpoint` (`serve --kv-checkpoint-tokens {args.checkpoint_tokens}`; `steps` and `chunk` run with 0): every "
                     f"{args.checkpoint_tokens} generated tokens the sequence's new KV positions are copied to the spare plan's workers; "
                     "the recovery onto the spare resumes at the last checkpoint every holder acknowledged and replays the tokens after it "
                     "step by step (`resumed at / replayed`). A kill right after a multiple of the interval finds the round for that "
                     "token still under way, so those trials replay a whole interval: the worst case.")
    if args.placement == "planner":
        lines.append("Memory budgets are emulation (a worker refuses a stage above its budget); compute is not slowed.")
    text = "\n".join(lines)
    print(text)
    name = "recovery" + ("-chunk" if "chunk" in args.replay.split(",") else "") + ("-checkpoint" if "checkpoint" in args.replay.split(",") else "") + ("-smoke" if args.smoke else "") + ("" if args.placement == "planner" else f"-{args.placement}") + ("" if args.model == "smollm2" else "-" + Path(args.model).stem.replace(".", "").lower())
    write_results(name, {"conditions": conditions, **run.as_dict(), "summary": summary, "trials": rows}, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5, help="trials per kill position")
    ap.add_argument("--model", default="smollm2", help="what serve serves (the bundled SmolLM2-135M, or a GGUF path)")
    ap.add_argument("--precision", default="int4", help="serve --precision (int4: the figures recorded so far)")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--kill-at", default="16,48", help="SIGKILL right after this content chunk arrived (comma list: trials rotate)")
    ap.add_argument("--placement", choices=("planner", "memory"), default="planner")
    ap.add_argument("--memory", default="250MB", help="EMULATED per-worker budget (planner placement), forcing >= 2 stages")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=180)
    ap.add_argument("--smoke", action="store_true", help="2 trials of 64 tokens, kill after chunk 16")
    ap.add_argument("--serve-args", default="", help="more serve flags for every trial (e.g. --no-prefix-cache)")
    ap.add_argument("--replay", default="steps", help="comma list of steps (plain graphs: a decode step per generated token), "
                                                        "chunk (--verify-form: one prefill) and checkpoint (KV checkpoints on the "
                                                        "spare: only the tokens since the last are replayed); trials rotate")
    ap.add_argument("--checkpoint-tokens", type=int, default=32, help="checkpoint: serve --kv-checkpoint-tokens")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.tokens, args.kill_at = 2, 64, "16"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (servers closed)
    home = bench_home()
    os.environ["EDGEPIPE_HOME"] = str(home)
    from edgepipe.model.store import resolve

    run = Conditions.start()
    replays = args.replay.split(",")
    if set(replays) - {"steps", "chunk", "checkpoint"}:
        ap.error("--replay takes steps, chunk and/or checkpoint")
    expected = {m: reference_text(resolve(args.model, args.precision, home), args.tokens, verify_form=m == "chunk") for m in replays}
    rows = []
    positions = [int(k) for k in str(args.kill_at).split(",")]
    if max(positions) >= args.tokens:
        ap.error("--kill-at must be below --tokens")
    cells = [(m, k) for k in positions for m in replays]  # interleaved: each replay mode beside the other at every position
    for i in range(args.trials * len(cells)):
        m, k = cells[i % len(cells)]
        rows.append(trial(home, args, expected[m], i + 1, k, m))
    report(rows, args, run.finish())


if __name__ == "__main__":
    main()
