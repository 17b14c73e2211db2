"""What TLS costs: decode tokens/s through 3 local workers, plain vs ``serve --tls``
(control, blobs and activations over https/wss), same greedy request, alternating runs.

    python benchmarks/tls_cost.py [--tokens 128] [--runs 5]     # results to benchmarks/results/tls.md|json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import free_port  # noqa: E402

from edgepipe.bench.client import stream_once  # noqa: E402
from edgepipe.model.store import resolve  # noqa: E402
from edgepipe.net import tls  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class Cluster:
    def __init__(self, home: Path, use_tls: bool, workers: int = 3):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "EDGEPIPE_TLS_FINGERPRINT"}
        env["EDGEPIPE_HOME"] = str(home)
        args = ["--tls"] if use_tls else []
        self.proc = subprocess.Popen([sys.executable, "-m", "edgepipe", "serve", "--workers", str(workers), "--port", str(self.port),
                                      "--placement", "memory", "--no-advertise", *args], env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True, stderr=subprocess.DEVNULL)
        cert = home / "tls" / "cert.pem"
        deadline = time.monotonic() + 300
        while True:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("cluster did not come up")
            if not use_tls or cert.is_file():
                verify = tls.trusting(cert.read_text()) if use_tls else True
                self.client = httpx.Client(base_url=f"{'https' if use_tls else 'http'}://127.0.0.1:{self.port}", verify=verify, timeout=300)
                try:
                    s = self.client.get("/v1/cluster/status").json()
                    if s["state"] == "up" and len(s["workers"]) == workers:
                        self.urls = [w["data_url"] for w in s["workers"]]
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                self.client.close()
            time.sleep(0.3)

    def close(self):
        self.client.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    home = Path(os.environ.get("EDGEPIPE_HOME", Path.home() / ".cache" / "edgepipe-bench"))
    resolve("smollm2", "int4", home)
    out = {"date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
           "loadavg_before": Path("/proc/loadavg").read_text().strip(), "tokens": args.tokens, "runs": {"plain": [], "tls": []}}
    clusters = {"plain": Cluster(home, False), "tls": Cluster(home, True)}
    try:
        out["data_urls"] = {k: c.urls for k, c in clusters.items()}
        for c in clusters.values():
            stream_once(c.client, 16)  # warm-up
        for _ in range(args.runs):
            for name, c in clusters.items():  # alternate, so load drifts hit both alike
                _, decode_s, n = stream_once(c.client, args.tokens)
                out["runs"][name].append(round((n - 1) / decode_s, 2))
    finally:
        for c in clusters.values():
            c.close()
    out["loadavg_after"] = Path("/proc/loadavg").read_text().strip()
    med = {k: statistics.median(v) for k, v in out["runs"].items()}
    out["median_tokens_per_s"] = med
    out["tls_cost_percent"] = round(100 * (med["plain"] - med["tls"]) / med["plain"], 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tls.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "tls.md").write_text(
        f"{out['date']} · {out['machine']} · SmolLM2-135M int4 · 3 local workers (both clusters running at once, runs alternating) · "
        f"{args.tokens} greedy tokens, {args.runs} runs · load before {out['loadavg_before']}, after {out['loadavg_after']}\n\n"
        "| transport | decode tokens/s (median) | runs |\n|---|---|---|\n"
        f"| plain ws/http | {med['plain']:.1f} | {out['runs']['plain']} |\n"
        f"| TLS (https, wss control, wss activations) | {med['tls']:.1f} | {out['runs']['tls']} |\n\n"
        f"TLS costs {out['tls_cost_percent']}% of decode tokens/s here (noisy: shared 2-core machine, see load).\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
