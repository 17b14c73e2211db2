"""Issue 12's attacks at full size against a real cluster (2 local workers, a join token).

The tests (tests/test_security*.py) run the same attacks scaled down; this script sends the
issue's sizes: a 1,000 MB unauthenticated frame to /v1/worker, 1,500 MB and 30 prefills of
1,500 tokens to a worker's data port, cluster control with Infinity, 600 wrong-token joins.
It records the coordinator's and the worker's memory while each attack runs, what the
attacker got back, and whether a greedy request afterwards returns the same text as before.

    python benchmarks/attacks.py            # results to benchmarks/results/attacks.md|json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import resolve
from edgepipe.net import auth
from edgepipe.net.protocol import Message, MessageType, encode

TOKEN, ADMIN = "bench-join-token", "bench-admin-token"
PROMPT = "The three primary colours are"


class PeakRSS:
    """Samples a process's RSS every 10 ms in a thread; ``peak_mb - start_mb`` is what an attack cost."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.start_mb = self.peak_mb = self.proc.memory_info().rss / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self.proc.memory_info().rss / 2**20)
            except psutil.Error:
                return
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.5)
        self._stop.set()
        self._thread.join()


def complete(server: Server) -> str:
    r = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def send_big(url: str, nbytes: int, headers: dict | None = None) -> dict:
    """Send one binary frame of ``nbytes`` zeros, streamed from a 4 MiB buffer straight to the
    socket (mask key 0, so the client spends nothing masking); report how much went out before
    the server cut the connection, and the close code it sent."""
    t0 = time.monotonic()
    chunk = memoryview(bytes(4 << 20))
    code, sent = None, 0
    try:
        with connect(url, max_size=None, open_timeout=10, additional_headers=headers or {}, close_timeout=5) as ws:
            sock = ws.socket
            sock.sendall(bytes([0x82, 0x80 | 127]) + nbytes.to_bytes(8, "big") + b"\x00\x00\x00\x00")
            try:
                while sent < nbytes:
                    sock.sendall(chunk[:min(len(chunk), nbytes - sent)])
                    sent += min(len(chunk), nbytes - sent)
            except OSError:
                pass  # the server closed the connection under us
            try:
                ws.recv(timeout=30)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else "no close frame"
            except TimeoutError:
                code = "no answer in 30 s"
    except InvalidStatus as exc:
        code = f"HTTP {exc.response.status_code}"
    return {"close": code, "mb_sent_before_cut": round(sent / 2**20, 1), "seconds": round(time.monotonic() - t0, 2)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    home = bench_home()
    resolve("smollm2", "int4", home)
    run = Conditions.start()
    out: dict = run.as_dict()
    with Server(home, workers=2, args=("--precision", "int4", "--join-token", TOKEN, "--admin-token", ADMIN, "--placement", "memory",
                                        "--data-secrets", "derived")) as server:  # derived: this script may act as a predecessor
        reference = complete(server)
        ws_url = server.url.replace("http://", "ws://") + "/v1/worker"
        status = server.status()
        stage = status["plan"]["stages"][1]
        victim = next(w for w in status["workers"] if w["id"] == stage["worker"])
        plan, data_url = status["plan"]["id"], victim["data_url"]

        # 1. one unauthenticated 1,000 MB frame to the coordinator's worker socket
        with PeakRSS(server.proc.pid) as rss:
            r = send_big(ws_url, 1000 << 20)
        time.sleep(3)
        s = server.status()
        out["1_big_frame_to_coordinator"] = {**r, "coordinator_rss_mb": round(rss.start_mb), "coordinator_peak_delta_mb": round(rss.peak_mb - rss.start_mb),
                                             "workers_after": len(s["workers"]), "state_after": s["state"]}

        # 2. the data port: no credentials, 30 prefills of 1,500 tokens, then 1,500 MB with the stage's secret
        refused = []
        x = np.random.default_rng(0).standard_normal((1, 1500, 576)).astype(np.float32)
        for i in range(30):
            batch = [{"seq": f"forged-{i}", "step": 0, "rid": "x", "sampling": {"do_sample": False, "temperature": 1.0, "top_k": 1,
                                                                                "top_p": 1.0, "uniform": 0.0}}]
            try:
                with connect(data_url, max_size=None, open_timeout=10, additional_headers={auth.PLAN_HEADER: str(plan)}) as ws:
                    ws.send(encode(Message(MessageType.FORWARD, {"plan": plan, "batch": batch, "timings": []}, {"x": x})))
                refused.append("accepted")
            except InvalidStatus as exc:
                refused.append(exc.response.status_code)
        time.sleep(2)
        kv = next(w for w in server.status()["workers"] if w["id"] == victim["id"])["stats"].get("kv_bytes")
        with PeakRSS(victim["pid"]) as wrss:
            unauth = send_big(data_url, 1500 << 20)
            authed = send_big(data_url, 1500 << 20, auth.data_headers(auth.derived_secret(TOKEN, data_url, plan), plan))
        out["2_data_port"] = {"forged_prefills": {k: sum(str(v) == k for v in refused) for k in sorted(set(map(str, refused)))},
                              "kv_bytes_after_prefills": kv, "1500MB_without_secret": unauth, "1500MB_with_stage_secret": authed,
                              "worker_rss_mb": round(wrss.start_mb), "worker_peak_delta_mb": round(wrss.peak_mb - wrss.start_mb)}

        # 5. cluster control
        wid = status["workers"][0]["id"]
        route = f"/v1/cluster/workers/{wid}/emulation"
        c = server.client
        out["5_cluster_control"] = {
            "slowdown_50_without_admin": c.post(route, json={"slowdown": 50}).status_code,
            "rebalance_without_admin": c.post("/v1/cluster/rebalance", json={"stages": []}).status_code,
            "slowdown_Infinity_with_admin": c.post(route, content='{"slowdown": Infinity}',
                                                   headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}).status_code,
            "events_after": c.get("/v1/cluster/events").status_code,
        }

        # 7. 600 wrong-token joins; the join token in ps
        async def flood(n: int) -> dict:
            counts = {"refused": 0, "throttled": 0}
            for _ in range(n):
                try:
                    async with websockets.connect(ws_url, open_timeout=10) as ws:
                        await ws.send(encode(Message(MessageType.HELLO, {"name": "x", "token": "wrong"})))
                        await ws.recv()
                        counts["refused"] += 1
                except InvalidStatus:
                    counts["throttled"] += 1
                except ConnectionClosed:
                    counts["refused"] += 1
            return counts

        t0 = time.monotonic()
        counts = asyncio.run(flood(600))
        events = c.get("/v1/cluster/events").json()
        kinds = sorted({e["kind"] for e in events["events"]})
        argv_leaks = 0
        for w in server.status()["workers"]:
            argv_leaks += TOKEN.encode() in Path(f"/proc/{w['pid']}/cmdline").read_bytes()
        out["7_join_flood"] = {**counts, "seconds": round(time.monotonic() - t0, 2), "event_kinds_kept": kinds,
                               "refused_events_kept": sum(e["kind"] == "refused" for e in events["events"]),
                               "dropped": events.get("dropped"), "token_in_argv_of_workers": argv_leaks}

        after = complete(server)
        s = server.status()
        kinds_all = [e["kind"] for e in c.get("/v1/cluster/events").json()["events"]]
        out["after"] = {"same_text_as_before": after == reference, "state": s["state"], "workers": len(s["workers"]),
                        "workers_lost_during_attacks": kinds_all.count("leave"), "workers_restarted": kinds_all.count("worker_restarted")}
    out["6_misbehaving_workers"] = misbehaving_workers(home, reference)
    out.update(run.finish().as_dict())
    write_results("attacks", out, markdown(out))
    print(json.dumps(out, indent=1))


def misbehaving_workers(home: Path, reference: str) -> dict:
    """A worker that answers pings but drops every activation frame (default 60 s step timeout),
    and one that reports its compute times 20x too short; plus a 1,000 MB request body."""
    out: dict = {}
    with Server(home, workers=2, args=("--precision", "int4", "--placement", "memory", "--min-workers", "3", "--join-token", TOKEN), wait_up=False) as server:
        dropper = server.worker("--drop-work", "--name", "dropper", "--join-token", TOKEN)
        liar = None
        try:
            server.wait_for(lambda s: s["state"] == "up" and len(s["plan"]["stages"]) == 3, timeout=300)
            t0 = time.monotonic()
            text = complete(server)
            took = time.monotonic() - t0
            events = server.client.get("/v1/cluster/events").json()["events"]
            caught = [e for e in events if e["kind"] == "quarantine"]
            s = server.status()
            planned = {st["worker"] for st in s["plan"]["stages"]}
            out["drops_work"] = {"answer_s": round(took, 1), "same_text": text == reference, "quarantined": [e["worker"] for e in caught],
                                 "quarantine_s": caught[0]["seconds"] if caught else None,
                                 "dropper_in_plan_after": any(w["name"] == "dropper" and w["id"] in planned for w in s["workers"])}
            liar = server.worker("--misreport", "20", "--name", "liar", "--join-token", TOKEN)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                events = server.client.get("/v1/cluster/events").json()["events"]
                ids = {w["id"] for w in server.status()["workers"] if w["name"] == "liar"}
                if any(e["kind"] == "calibrated" and e.get("worker") in ids for e in events):
                    break
                time.sleep(1)
            over = [e for e in events if e["kind"] == "probe_overruled"]
            speeds = {e["worker"]: e["speed"] for e in events if e["kind"] == "calibrated"}
            out["misreports_20x"] = {"overruled": [(e["worker"], e["reported_ms"], e["measured_ms"]) for e in over], "speeds": speeds}
            host, port = server.url.removeprefix("http://").split(":")
            import socket

            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1048576000\r\n\r\n" + b" " * 4096)
                out["body_1000MB"] = sock.recv(200).decode("latin-1").splitlines()[0]
            out["after"] = {"same_text": complete(server) == reference, "state": server.status()["state"]}
        finally:
            for p in (dropper, liar):
                if p is not None:
                    p.kill()
                    p.wait()
    return out


def markdown(o: dict) -> str:
    a1, a2, a5, a7 = o["1_big_frame_to_coordinator"], o["2_data_port"], o["5_cluster_control"], o["7_join_flood"]
    a6 = o["6_misbehaving_workers"]
    rows = [
        ("1. unauthenticated 1,000 MB frame to /v1/worker",
         "coordinator RSS 127 → 2,082 MB, both workers dropped, cluster down for good",
         f"closed with {a1['close']} after {a1['mb_sent_before_cut']} MB had left the attacker; coordinator peak +{a1['coordinator_peak_delta_mb']} MB "
         f"(of {a1['coordinator_rss_mb']}); {a1['workers_after']} workers, {a1['state_after']}"),
        ("2. data port: 30 forged prefills of 1,500 tokens",
         "accepted from anyone; 2.26 GB KV never freed, real requests stalled > 1 min",
         f"handshakes answered {a2['forged_prefills']}; worker KV afterwards {a2['kv_bytes_after_prefills']} bytes"),
        ("2. data port: 1,500 MB frame", "worker RSS 3.2 GB, worker gone",
         f"without secret: {a2['1500MB_without_secret']['close']}; with the stage secret: closed {a2['1500MB_with_stage_secret']['close']} "
         f"after {a2['1500MB_with_stage_secret']['mb_sent_before_cut']} MB; "
         f"worker peak +{a2['worker_peak_delta_mb']} MB (of {a2['worker_rss_mb']})"),
        ("3. 8 MiB overwritten in a cached blob", "garbage text, status 200, no log",
         "hash checked on load (marker by inode/size/mtime/ctime), corrupt file deleted + fetched again + warning (tests/test_security_units.py)"),
        ("4. worker named <img onerror>; echoed bad frame", "script ran in the operator's browser",
         "text nodes only; no element, no script (tests/test_security_dashboard.py, chromium)"),
        ("5. emulation/rebalance without credentials; slowdown Infinity", "26x slower request; 500, worker killed, /events 500 forever",
         f"without admin token: {a5['slowdown_50_without_admin']} / {a5['rebalance_without_admin']}; Infinity: {a5['slowdown_Infinity_with_admin']}; "
         f"/events afterwards: {a5['events_after']}"),
        ("6. worker output (NaN activations at a stage); token frame from a middle stage; token id -5 / 10^9; malformed timings",
         "served as answers with 200; accepted; unhandled exception, plain-text 500, cut stream",
         "stage refuses non-finite input (CORRUPT_INPUT, retried on a new plan, never served); token frames only from the planned last "
         "stage, ids checked against the vocabulary, timings checked finite (tests/test_security_units.py)"),
        ("6. worker answers pings but drops every activation frame", "got every unit; request hung 300 s",
         f"answered in {a6['drops_work']['answer_s']} s (one 60 s step timeout), same text {a6['drops_work']['same_text']}; "
         f"quarantined {a6['drops_work']['quarantined']} for {a6['drops_work']['quarantine_s']} s; in the plan afterwards: "
         f"{a6['drops_work']['dropper_in_plan_after']}"),
        ("6. worker reports probe times 20x too short", "taken on faith (more layers for the liar)",
         f"overruled by the coordinator's clock: {len(a6['misreports_20x']['overruled'])} probe(s) "
         f"(reported/measured ms {[(r, m) for _, r, m in a6['misreports_20x']['overruled']][:2]}); calibrated speeds {a6['misreports_20x']['speeds']}"),
        ("request body announcing 1,000 MB (not in the issue)", "no limit: buffered", f"{a6['body_1000MB']} at its header; afterwards same text {a6['after']['same_text']}"),
        ("7. 600 wrong-token joins", "1.9 s; 500-entry event log flushed",
         f"{a7['refused']} refused, {a7['throttled']} throttled at the handshake in {a7['seconds']} s; {a7['refused_events_kept']} refusals kept, "
         f"kinds kept: {', '.join(a7['event_kinds_kept'])}"),
        ("7. join token of local workers in ps", "visible in argv", f"in argv of {a7['token_in_argv_of_workers']} workers"),
    ]
    text = [f"{Conditions.from_dict(o).line()} · SmolLM2-135M int4 · 2 local workers, join token + admin token", "",
            "| attack | before (issue 12) | after (measured here) |", "|---|---|---|"]
    text += [f"| {a} | {b} | {c} |".replace("<img", "&lt;img") for a, b, c in rows]
    text += ["", f"A greedy request after all attacks: same text as before: {o['after']['same_text_as_before']}; "
             f"state {o['after']['state']} with {o['after']['workers']} workers; workers lost during the attacks: "
             f"{o['after']['workers_lost_during_attacks']} (restarted: {o['after']['workers_restarted']})."]
    return "\n".join(text) + "\n"


if __name__ == "__main__":
    main()
