"""The arithmetic and command lines of ``benchmarks/serve.py`` (edgepipe's server against
llama.cpp's): pure, so the figures a table shows can be tested without a server.

- ``COMPARISONS``: the kinds of comparison, each what edgepipe and llama.cpp start for it;
- ``llama_server_argv`` / ``rpc_server_argv``: llama.cpp's ``llama-server`` alone or on top of
  ``rpc-server`` processes (one layer range per RPC device, ``--tensor-split`` even);
- ``Stream`` and ``summarize``: one client stream's timestamps, a concurrency level's aggregate
  tok/s, per-stream decode tok/s and TTFT median;
- ``parse_metrics`` / ``decode_breakdown``: edgepipe's ``/metrics`` counters and the processes'
  CPU times before and after a long and a short request, turned into one decode step's parts
  (the difference of the two cancels the prefill and the request's set-up); ``level_counters``:
  the same counters over a whole concurrency level (batching, CPU per token);
- ``ratio`` and the markdown tables.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass


# -- the comparisons -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """One kind of comparison: the ``edgepipe serve`` and the llama.cpp servers it starts."""

    label: str  # its rows in the table
    workers: int  # edgepipe serve --workers (more than 1: a pipeline, --placement memory)
    worker_threads: int  # each worker's --threads
    llama_threads: int  # llama-server -t (each rpc-server's is 1)
    rpc_servers: int = 0  # rpc-servers under llama-server, one layer range each (0: llama-server alone)


COMPARISONS = {
    "server": Comparison("one machine: 1 worker x 2 threads vs llama-server -t 2 -np 16", 1, 2, 2),
    "pipeline": Comparison("3 processes x 1 thread: 3 stages vs 3 rpc-servers", 3, 1, 1, rpc_servers=3),
    # issue 38: a 3-stage pipeline against the one server llama.cpp would run on the machine
    "pipeline-server": Comparison("3 stages x 1 thread vs llama-server -t 2 -np 16", 3, 1, 2),
}


# -- llama.cpp command lines ---------------------------------------------------------------------
def llama_server_argv(binary: str, model: str, port: int, threads: int, parallel: int, context: int,
                      rpc: list[str] | None = None) -> list[str]:
    """``llama-server`` on ``model``: ``parallel`` slots sharing ``context`` positions; with ``rpc``
    (``host:port`` of each ``rpc-server``) every layer is offloaded (``-ngl 999``) and split evenly
    over the RPC devices in the order given (``--tensor-split 1,1,...``, the layer split mode), so
    the servers hold consecutive layer ranges: a pipeline like edgepipe's stages."""
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-np", str(parallel), "-c", str(context), "--no-webui", "--metrics"]
    if rpc:
        argv += ["--rpc", ",".join(rpc), "-ngl", "999", "-sm", "layer", "-ts", ",".join("1" for _ in rpc)]
    return argv


def rpc_server_argv(binary: str, port: int, threads: int) -> list[str]:
    return [binary, "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]


# -- one level of concurrent streams -------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """One streamed request, timestamps from one clock (seconds)."""

    sent: float
    first: float  # the first chunk with text
    last: float
    tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time from the first to the last (0 for a single token)."""
        return (self.tokens - 1) / (self.last - self.first) if self.tokens > 1 and self.last > self.first else 0.0


def summarize(streams: list[Stream]) -> dict:
    """A level's figures: aggregate tok/s (all tokens over first send to last token), the median
    stream's decode tok/s, the TTFT median and worst."""
    start, end = min(s.sent for s in streams), max(s.last for s in streams)
    total = sum(s.tokens for s in streams)
    return {"clients": len(streams), "tokens": total, "wall_s": round(end - start, 3),
            "aggregate_tok_s": round(total / (end - start), 2) if end > start else 0.0,
            "per_stream_tok_s": round(statistics.median(s.decode_tok_s for s in streams), 2),
            "ttft_median_s": round(statistics.median(s.ttft_s for s in streams), 3),
            "ttft_max_s": round(max(s.ttft_s for s in streams), 3)}


def median_of(reps: list[dict]) -> dict:
    """The median of each figure over repetitions of one level (``reps``: ``summarize`` results)."""
    keys = ("aggregate_tok_s", "per_stream_tok_s", "ttft_median_s", "ttft_max_s")
    return {"clients": reps[0]["clients"], "reps": len(reps), **{k: round(statistics.median(r[k] for r in reps), 3) for k in keys},
            "aggregate_tok_s_reps": [r["aggregate_tok_s"] for r in reps]}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs`` (None where either is missing or theirs is 0)."""
    return round(ours / theirs, 2) if ours is not None and theirs else None


# -- edgepipe's /metrics and one decode step -----------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{"name{labels}": value}`` (the samples, comments dropped)."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


@dataclass(frozen=True)
class Snapshot:
    """What is read around one request: ``/metrics`` samples and CPU seconds per process."""

    metrics: dict[str, float]
    coordinator_cpu_s: float
    workers_cpu_s: float


def _delta(a: Snapshot, b: Snapshot) -> dict[str, float]:
    keys = set(a.metrics) | set(b.metrics)
    d = {k: b.metrics.get(k, 0.0) - a.metrics.get(k, 0.0) for k in keys}
    return {"tokens": d.get("edgepipe_tokens_generated_total", 0.0),
            "wall_s": d.get("edgepipe_step_wall_seconds_total", 0.0),
            "before_send_s": d.get("edgepipe_coordinator_seconds_total", 0.0),
            "tpot_s": d.get("edgepipe_time_per_output_token_seconds_sum", 0.0),
            "tpot_n": d.get("edgepipe_time_per_output_token_seconds_count", 0.0),
            "batch_sum": sum(v for k, v in d.items() if k.startswith("edgepipe_stage_batch_size_sum")),
            "compute_s": sum(v for k, v in d.items() if k.startswith("edgepipe_stage_compute_seconds_sum")),
            "calls": sum(v for k, v in d.items() if k.startswith("edgepipe_stage_compute_seconds_count")),
            "coordinator_cpu_s": b.coordinator_cpu_s - a.coordinator_cpu_s,
            "workers_cpu_s": b.workers_cpu_s - a.workers_cpu_s}


def level_counters(before: Snapshot, after: Snapshot) -> dict:
    """What ``/metrics`` and the CPU times say of a whole concurrency level (prefills included):
    per generated token the coordinator's and the workers' CPU ms and the stage calls; per stage
    call its compute ms and sequences batched; the mean decode step (send to token, StepRecord)."""
    d = _delta(before, after)
    n, calls = d["tokens"], d["calls"]
    if n <= 0:
        return {}
    return {"tokens": n, "coordinator_cpu_ms_per_token": round(d["coordinator_cpu_s"] / n * 1e3, 2),
            "workers_cpu_ms_per_token": round(d["workers_cpu_s"] / n * 1e3, 2), "stage_calls_per_token": round(calls / n, 2),
            "compute_ms_per_call": round(d["compute_s"] / calls * 1e3, 2) if calls else None,
            "batch_mean": round(d["batch_sum"] / calls, 2) if calls else None,
            "decode_step_ms": round(d["tpot_s"] / d["tpot_n"] * 1e3, 2) if d["tpot_n"] else None}


def decode_breakdown(long: tuple[Snapshot, Snapshot, float], short: tuple[Snapshot, Snapshot, float], stages: int,
                     threads: int = 1) -> dict:
    """One decode step's parts, in ms per token, from a long and a short single-stream request
    (``(before, after, client seconds from first to last token)`` each): every counter's
    difference between the two over the difference in tokens, so the prefill and the request's
    own set-up cancel.

    ``step`` is the coordinator's send-to-token wall of a step (StepRecord.wall_s), of which
    ``before_send`` is its own work before the frame leaves; ``compute`` the stages' reported
    compute (summed over stages); ``transit`` the rest of the step: ``stages + 1`` hops
    (coordinator -> first stage ... last stage -> coordinator) with the workers' framing and any
    queueing on the way, ``per_hop`` its mean. ``between_steps`` is what the client sees per token
    beyond a step (the coordinator between a token's arrival and the next step's start: streaming
    it out, scheduling). CPU: the coordinator's process and the workers'; with one thread per
    worker, their CPU beyond compute is their framing and messaging (None with more threads: a
    compute second may then hold up to ``threads`` CPU seconds)."""
    (la, lb, lclient), (sa, sb, sclient) = long, short
    dl, ds = _delta(la, lb), _delta(sa, sb)
    n = dl["tokens"] - ds["tokens"]
    if n <= 0:
        raise ValueError(f"the long request made {dl['tokens']:g} tokens, the short {ds['tokens']:g}: no decode steps to compare")

    def per(key: str) -> float:
        return (dl[key] - ds[key]) / n * 1e3

    client = (lclient - sclient) / n * 1e3
    step, before, compute = per("wall_s"), per("before_send_s"), per("compute_s")
    transit = step - before - compute
    return {"stages": stages, "tokens": n, "client_ms": round(client, 2), "step_ms": round(step, 2),
            "between_steps_ms": round(client - step, 2), "before_send_ms": round(before, 2), "compute_ms": round(compute, 2),
            "transit_ms": round(transit, 2), "hops": stages + 1, "per_hop_ms": round(transit / (stages + 1), 2),
            "coordinator_cpu_ms": round(per("coordinator_cpu_s"), 2), "workers_cpu_ms": round(per("workers_cpu_s"), 2),
            "workers_cpu_beyond_compute_ms": round(per("workers_cpu_s") - compute, 2) if threads == 1 else None,
            "stage_calls_per_token": round((dl["calls"] - ds["calls"]) / n, 2)}


def median_breakdown(parts: list[dict]) -> dict:
    """Each figure's median over repetitions of ``decode_breakdown`` (a figure None in any: None)."""
    out = {}
    for k in parts[0]:
        values = [p[k] for p in parts]
        out[k] = None if any(v is None for v in values) else round(statistics.median(values), 2)
    return out


# -- tables --------------------------------------------------------------------------------------
def _f(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def comparison_rows(ours: dict[int, dict], theirs: dict[int, dict], label: str) -> list[str]:
    """Markdown rows ``label, N clients | edgepipe | llama.cpp | ratio`` for aggregate tok/s,
    per-stream tok/s and TTFT median (``ours``/``theirs``: clients -> ``median_of``)."""
    rows = []
    for n in sorted(set(ours) | set(theirs)):
        a, b = ours.get(n) or {}, theirs.get(n) or {}
        ag, bg = a.get("aggregate_tok_s"), b.get("aggregate_tok_s")
        ap, bp = a.get("per_stream_tok_s"), b.get("per_stream_tok_s")
        at, bt = a.get("ttft_median_s"), b.get("ttft_median_s")
        rows.append(f"| {label}, {n} client{'s' if n > 1 else ''} | {_f(ag)} | {_f(bg)} | **{_f(ratio(ag, bg), 2)}x** "
                    f"| {_f(ap)} | {_f(bp)} | {_f(at, 2)} | {_f(bt, 2)} |")
    return rows


COMPARISON_HEAD = ["| | edgepipe tok/s | llama.cpp tok/s | ratio | edgepipe per-stream | llama.cpp per-stream "
                   "| edgepipe TTFT median s | llama.cpp TTFT median s |", "|---|---|---|---|---|---|---|---|"]

BREAKDOWN_HEAD = ["| stages | client ms/token | step (send → token) | before send | stage compute | transit (hops + framing + queue) "
                  "| hops | per hop | between steps | coordinator CPU | workers' CPU | workers' CPU beyond compute |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def breakdown_row(b: dict) -> str:
    return (f"| {b['stages']} | {b['client_ms']:.2f} | {b['step_ms']:.2f} | {b['before_send_ms']:.2f} | {b['compute_ms']:.2f} "
            f"| {b['transit_ms']:.2f} | {b['hops']} | {b['per_hop_ms']:.2f} | {b['between_steps_ms']:.2f} "
            f"| {b['coordinator_cpu_ms']:.2f} | {b['workers_cpu_ms']:.2f} | {_f(b['workers_cpu_beyond_compute_ms'], 2)} |")


LOAD_HEAD = ["| config | clients | tok/s | decode step ms | sequences per stage call | compute ms per call | stage calls per token "
             "| coordinator CPU ms/token | workers' CPU ms/token |", "|---|---|---|---|---|---|---|---|---|"]


def load_row(config: str, clients: int, tok_s: float, c: dict) -> str:
    return (f"| {config} | {clients} | {tok_s:.1f} | {_f(c.get('decode_step_ms'), 2)} | {_f(c.get('batch_mean'), 2)} "
            f"| {_f(c.get('compute_ms_per_call'), 2)} | {_f(c.get('stage_calls_per_token'), 2)} "
            f"| {_f(c.get('coordinator_cpu_ms_per_token'), 2)} | {_f(c.get('workers_cpu_ms_per_token'), 2)} |")
