"""edgepipe's server against llama.cpp's on the same GGUF, in one run (issue 39).

    python benchmarks/serve.py                 # the 1.5B Q4_K_M and the 0.5B, 2 reps, + --profile
    python benchmarks/serve.py --quick         # smoke: the 0.5B, 1 rep, 16 tokens, levels 1,4 / 1,2
    python benchmarks/serve.py --model x.gguf --reps 3 --levels 1,4,16 --pipeline-levels 1,8 [--no-pipeline]
    python benchmarks/serve.py --profile-only  # only the decode-step breakdown
    python benchmarks/serve.py --model moe.gguf --kinds pipeline-server --pipeline-server-levels 16  # 3 stages vs llama-server -np 16

Needs `scripts/build_llama_cpp.sh` (llama-server, rpc-server) and `scripts/fetch_qwen15.sh`
/ `scripts/fetch_qwen05.sh` (the GGUFs). Writes `benchmarks/results/serve.json` and `serve.md`
(`serve-quick.*` for `--quick`, `<stem>.*` for `--stem`).

Configurations, each server alone on the machine (started, warmed up with one short request,
measured at every level, stopped: the next starts only then), repetitions interleaved (rep 1 of
every configuration, then rep 2, ...), medians reported:

- one machine: `edgepipe serve --workers 1 --worker-threads 2` against
  `llama-server -t 2 -np 16 -c 16x512`, at 1, 4 and 16 concurrent clients;
- a pipeline of 3 processes of 1 thread: `edgepipe serve --workers 3 --worker-threads 1
  --placement memory` (3 stages) against 3 `rpc-server -t 1` under `llama-server -t 1 --rpc
  a,b,c -ngl 999 -ts 1,1,1` (an even split of the layers in order: the 0.5B's 24 layers go 9/8/7
  with the output layer on the third, llama-server itself keeping only the token embeddings),
  at 1 and 8 clients. edgepipe's 3 workers each hold a third of the layers (`--placement memory`).
- a pipeline against one server (`--kinds pipeline-server`, issue 38's MoE check): the same 3-stage
  `edgepipe serve` against `llama-server -t 2 -np 16 -c 16x512` alone (the machine's 2 cores), at
  16 clients (`--pipeline-server-levels`). An upcycled MoE file for it:
  `python -m edgepipe.bench.moe_files SOURCE.gguf TARGET.gguf` (`edgepipe/bench/moe_files.py`).

Each client streams `/v1/completions` (a distinct raw prompt, greedy `temperature: 0`,
`max_tokens` N, `ignore_eos`); aggregate tok/s = all tokens / first send to last token,
per-stream = the median stream's tokens after the first over first-to-last, TTFT median.

`--profile`: one decode step through `edgepipe serve` on 1 and 3 stages, from what the wire and
`/metrics` already report (StepRecord: a step's send-to-token wall, the coordinator's time before
sending, each stage's compute) and the processes' CPU times (/proc), over a long and a short
single-stream request (their difference per token cancels the prefill): see
`edgepipe.bench.serving.decode_breakdown`. Per-hop time is the transit's mean over its hops
(no per-hop timestamps are on the wire).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from edgepipe.bench.cluster import Server, bench_home, free_port
from edgepipe.bench.machine import Conditions, load_average, package_version
from edgepipe.bench.results import write_results
from edgepipe.bench.serving import (BREAKDOWN_HEAD, COMPARISON_HEAD, COMPARISONS, LOAD_HEAD, Snapshot, Stream, breakdown_row, comparison_rows,
                                    decode_breakdown, level_counters, llama_server_argv, load_row, median_breakdown, median_of, parse_metrics,
                                    rpc_server_argv, summarize)

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("EDGEPIPE_MODELS") or Path.home() / ".cache" / "edgepipe" / "models")
QWEN15 = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"  # scripts/fetch_qwen15.sh
QWEN05 = MODELS / "qwen2.5-coder-0.5b-instruct.gguf"  # scripts/fetch_qwen05.sh
LLAMA_VERSION = "0.3.36"  # llama-cpp-python's sdist scripts/build_llama_cpp.sh builds from
LLAMA_BIN = Path(os.environ.get("EDGEPIPE_LLAMA_CPP") or Path.home() / ".cache" / "edgepipe" / "llama.cpp") / LLAMA_VERSION / "bin"
PROMPTS = ["Write a Python function that checks whether a number is prime.", "Explain how a hash table works.",
           "Write a short story about a lighthouse keeper.", "Describe the water cycle in detail.",
           "Write a bash script that counts the lines of every file in a folder.", "What is the difference between TCP and UDP?",
           "Explain recursion to a beginner, with an example.", "Write a SQL query that finds the top five customers by spend."]
SLOT_CONTEXT = 512  # llama-server's positions per slot (-c = slots x this): prompt + answer fit


# -- processes -----------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), whatever its process group."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_all(pids: list[int]) -> None:
    """SIGKILL whatever of ``pids`` outlived its parent's shutdown (a worker in a group of its own)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Llama:
    """``llama-server`` (and, for the pipeline, ``rpc-server``s) in sessions of their own."""

    def __init__(self, model: Path, threads: int, parallel: int, rpc_servers: int = 0, logdir: Path | None = None, timeout: float = 300):
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir or Path(tempfile.mkdtemp(prefix="serve-llama-"))
        try:
            rpc = []
            for i in range(rpc_servers):
                port = free_port()
                self._spawn(rpc_server_argv(str(LLAMA_BIN / "rpc-server"), port, 1), f"rpc{i}")
                rpc.append(f"127.0.0.1:{port}")
            for addr in rpc:
                self._wait_port(int(addr.rsplit(":", 1)[1]), timeout)
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.argv = llama_server_argv(str(LLAMA_BIN / "llama-server"), str(model), self.port, threads, parallel,
                                          parallel * SLOT_CONTEXT, rpc or None)
            self._spawn(self.argv, "server")
            deadline = time.monotonic() + timeout
            while True:
                self._check()
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not healthy in {timeout:.0f} s (logs {self.logdir})")
                time.sleep(0.3)
        except BaseException:
            self.close()
            raise

    _count = 0

    def _spawn(self, argv: list[str], name: str) -> None:
        Llama._count += 1
        with open(self.logdir / f"llama-{Llama._count:02d}-{name}.log", "ab") as out:
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def _check(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode} (logs {self.logdir})")

    def _wait_port(self, port: int, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"rpc-server on {port} not listening in {timeout:.0f} s")

    def close(self) -> None:
        for p in reversed(self.procs):  # the server first (it asks its rpc-servers for memory figures as it exits), then them
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class Edgepipe:
    """``edgepipe serve`` with its local workers; ``close`` also kills any worker left behind."""

    _count = 0
    serve_args: tuple[str, ...] = ()  # --serve-args: more flags for every edgepipe serve

    def __init__(self, model: Path, workers: int, threads: int, home: Path, logdir: Path):
        extra = (("--placement", "memory") if workers > 1 else ()) + Edgepipe.serve_args
        Edgepipe._count += 1
        self.server = Server(home, workers=workers, timeout=1800, log=logdir / f"edgepipe-{Edgepipe._count:02d}-{workers}w.log", client_timeout=600,
                             args=("--model", str(model), "--worker-threads", str(threads), "--max-active", "16", "--max-queue", "64", *extra))
        self.url = self.server.url
        self.pid = self.server.proc.pid
        self.stages = len((self.server.status().get("plan") or {}).get("stages") or [])
        self.argv = list(self.server.proc.args)

    def cpu(self) -> tuple[float, float]:
        return cpu_s(self.pid), sum(cpu_s(p) for p in descendants(self.pid))

    def close(self) -> None:
        left = descendants(self.pid)
        self.server.close()
        time.sleep(0.5)
        kill_all([p for p in left if Path(f"/proc/{p}").exists()])


# -- clients -------------------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, prompt: str, tokens: int, clock0: float) -> Stream:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens") or usage
            if any(c.get("text") for c in chunk.get("choices") or []):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    if first is None:
        raise RuntimeError("a stream returned no text")
    return Stream(sent - clock0, first - clock0, last - clock0, usage or chunks)


async def _level(url: str, clients: int, tokens: int, tag: str) -> list[Stream]:
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as c:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(c, f"[{tag}.{i}] {PROMPTS[i % len(PROMPTS)]}", tokens, t0) for i in range(clients))))


def level(url: str, clients: int, tokens: int, tag: str) -> dict:
    streams = asyncio.run(_level(url, clients, tokens, tag))
    out = summarize(streams)
    out["short_streams"] = sum(1 for s in streams if s.tokens != tokens)  # ignore_eos honoured: 0
    return out


# -- the comparison ------------------------------------------------------------------------------
def start(kind: str, engine: str, model: Path, home: Path, logdir: Path):
    c = COMPARISONS[kind]
    if engine == "edgepipe":
        return Edgepipe(model, c.workers, c.worker_threads, home, logdir)
    return Llama(model, c.llama_threads, 16, c.rpc_servers, logdir)


def compare(models: list[Path], args, home: Path, logdir: Path) -> dict:
    levels = {"server": args.levels, "pipeline": args.pipeline_levels, "pipeline-server": args.pipeline_server_levels}
    kinds = {k: levels[k] for k in args.kinds if k != "pipeline" or args.pipeline}
    runs = {m.name: {k: {e: {n: [] for n in lv} for e in ("edgepipe", "llama.cpp")} for k, lv in kinds.items()} for m in models}
    info = {m.name: {} for m in models}
    for rep in range(args.reps):
        for model in models:
            for kind, levels in kinds.items():
                for engine in ("edgepipe", "llama.cpp") if rep % 2 == 0 else ("llama.cpp", "edgepipe"):
                    t0 = time.monotonic()
                    srv = start(kind, engine, model, home, logdir)
                    up_s = time.monotonic() - t0
                    try:
                        level(srv.url, 1, 8, f"w{rep}")  # warm-up
                        for n in levels:
                            before = load_average()
                            a = snapshot(srv) if engine == "edgepipe" else None
                            r = level(srv.url, n, args.tokens, f"r{rep}{kind[0]}{n}")
                            if a is not None:  # what the wire and the processes say of this level
                                r["counters"] = level_counters(a, snapshot(srv))
                            r["load_before"], r["load_after"] = before, load_average()
                            runs[model.name][kind][engine][n].append(r)
                            print(f"rep {rep + 1} {model.name} {kind} {engine} {n} clients: {r['aggregate_tok_s']} tok/s aggregate, "
                                  f"{r['per_stream_tok_s']} per stream, TTFT median {r['ttft_median_s']} s "
                                  f"(load {' '.join(map(str, r['load_after']))})", flush=True)
                        info[model.name].setdefault(f"{kind}/{engine}", {"argv": [str(a) for a in srv.argv],
                                                                         **({"stages": srv.stages} if engine == "edgepipe" else {})})
                        info[model.name][f"{kind}/{engine}"].setdefault("startup_s", []).append(round(up_s, 1))
                    finally:
                        srv.close()
    return {"runs": runs, "servers": info,
            "medians": {m: {k: {e: {n: median_of(r) for n, r in lv.items()} for e, lv in ks.items()} for k, ks in km.items()}
                        for m, km in runs.items()}}


# -- the profile ---------------------------------------------------------------------------------
def snapshot(ep: Edgepipe) -> Snapshot:
    text = httpx.get(f"{ep.url}/metrics", timeout=30).text
    coordinator, workers = ep.cpu()
    return Snapshot(parse_metrics(text), coordinator, workers)


def timed_request(ep: Edgepipe, tokens: int, tag: str) -> tuple[Snapshot, Snapshot, float]:
    a = snapshot(ep)
    s = asyncio.run(_level(ep.url, 1, tokens, tag))[0]
    b = snapshot(ep)
    return a, b, s.last - s.first


def profile(model: Path, args, home: Path, logdir: Path) -> list[dict]:
    out = []
    for workers, threads in ((1, 2), (3, 1)):
        ep = Edgepipe(model, workers, threads, home, logdir)
        try:
            level(ep.url, 1, 8, "pw")
            parts = []
            for rep in range(args.profile_reps):  # long and short alternate; the same prompt, so prefill and prefix hits match
                long = timed_request(ep, args.profile_tokens, "p")
                short = timed_request(ep, 8, "p")
                parts.append(decode_breakdown(long, short, ep.stages, threads))
            med = {**median_breakdown(parts), "stages": ep.stages, "hops": ep.stages + 1, "workers": workers, "threads": threads,
                   "model": model.name, "reps": parts, "load": load_average()}
            print(f"profile {model.name} {ep.stages} stage(s) x {threads} thread(s): "
                  f"{json.dumps({k: v for k, v in med.items() if k not in ('reps', 'model')})}", flush=True)
            out.append(med)
        finally:
            ep.close()
    return out


# -- report --------------------------------------------------------------------------------------
def versions() -> dict:
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    llama = subprocess.run([str(LLAMA_BIN / "llama-server"), "--version"], capture_output=True, text=True)
    return {"edgepipe": package_version("edgepipe"), "edgepipe_git": git, "llama_cpp_python_sdist": LLAMA_VERSION,
            "llama_server": " ".join((llama.stdout + llama.stderr).split("\n")[0:2]).strip(),
            "onnxruntime": package_version("onnxruntime"), "lscpu": lscpu()}


def lscpu() -> dict:
    done = subprocess.run(["lscpu"], capture_output=True, text=True)
    keep = ("Model name", "Vendor ID", "CPU(s)", "Thread(s) per core", "L3 cache", "Flags")
    rows = dict(line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    out = {k: rows[k].strip() for k in keep if k in rows}
    if "Flags" in out:  # the SIMD ones matter here
        out["Flags"] = " ".join(f for f in out["Flags"].split() if f.startswith(("avx", "amx", "fma", "f16c")))
    return out


def report(data: dict, run: Conditions, args) -> str:
    lines = [f"# edgepipe serve against llama.cpp's servers{' (quick smoke run: not a measurement)' if args.quick else ''}", "",
             f"{run.line()} · CPU flags {data['versions']['lscpu'].get('Flags', '?')} · {args.tokens} tokens per request, greedy, "
             f"ignore EOS, streamed /v1/completions · each server alone, {args.reps} interleaved rep(s), medians · llama.cpp "
             f"{data['versions']['llama_server']} (llama-cpp-python {LLAMA_VERSION} sdist) · edgepipe {data['versions']['edgepipe_git']}", ""]
    for name, kinds in (data.get("compare") or {}).get("medians", {}).items():
        lines += [f"## {name}", "", *COMPARISON_HEAD]
        for kind, c in COMPARISONS.items():
            if kind in kinds:
                lines += comparison_rows(kinds[kind]["edgepipe"], kinds[kind]["llama.cpp"], c.label)
        lines.append("")
        servers = data["compare"]["servers"][name]
        rows = [load_row(f"{kind}, {servers.get(f'{kind}/edgepipe', {}).get('stages', '?')} stage(s)", n, r["aggregate_tok_s"], r["counters"])
                for kind in kinds for n, reps in data["compare"]["runs"][name][kind]["edgepipe"].items() for r in reps[-1:]
                if r.get("counters")]
        if rows:
            lines += ["edgepipe under each level, from /metrics and /proc (the last rep; prefills included):", "", *LOAD_HEAD, *rows, ""]
    if data.get("profile"):
        lines += ["## One decode step through `edgepipe serve` (ms per token, 1 client)", "",
                  "From /metrics (StepRecord: send-to-token wall, time before sending, stage compute) and /proc CPU times, "
                  f"a {args.profile_tokens}-token minus an 8-token request per token (the prefill cancels), median of "
                  f"{args.profile_reps}; CPU times in /proc ticks of {1e3 / os.sysconf('SC_CLK_TCK'):g} ms (over "
                  f"{args.profile_tokens - 8} tokens a rep). Transit = step - before send - compute: the hops (coordinator -> first stage ... last stage -> "
                  "coordinator), the workers' framing and any queueing; per hop is its mean (no per-hop stamps on the wire). "
                  "Between steps = client's time per token - step (the coordinator from a token's arrival to the next step's start; "
                  "a difference of two measured figures, slightly negative where noise exceeds it). Stage compute is the workers' "
                  "wall time of a call: on a loaded machine it holds time without a core, and their CPU falls below it.", ""]
        for model in dict.fromkeys(p["model"] for p in data["profile"]):
            lines += [f"### {model}", "", *BREAKDOWN_HEAD, *[breakdown_row(p) for p in data["profile"] if p["model"] == model], ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", type=Path, help="GGUF (repeatable; default: the 1.5B Q4_K_M and the 0.5B)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--pipeline-levels", default="1,8")
    ap.add_argument("--no-pipeline", dest="pipeline", action="store_false")
    ap.add_argument("--kinds", default="server,pipeline", help=f"the comparisons, of {','.join(COMPARISONS)}")
    ap.add_argument("--pipeline-server-levels", default="16", help="clients of the pipeline-server kind")
    ap.add_argument("--profile", action="store_true", help="also the decode-step breakdown (on the first model)")
    ap.add_argument("--profile-only", action="store_true")
    ap.add_argument("--profile-tokens", type=int, default=128, help="the long request (the short: 8 tokens)")
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke: the 0.5B, 1 rep, 16 tokens, levels 1,4 and 1,2, a short profile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stem", default=None, help="results file names (default serve, serve-quick with --quick)")
    ap.add_argument("--serve-args", default="", help="more flags for every `edgepipe serve`, e.g. \"--worker-args '--spin'\"")
    args = ap.parse_args()
    Edgepipe.serve_args = tuple(shlex.split(args.serve_args))
    if args.quick:
        args.reps, args.tokens, args.levels, args.pipeline_levels = 1, 16, "1,4", "1,2"
        args.profile_tokens, args.profile_reps = 24, 1
        args.model = args.model or [QWEN05]
    args.levels = [int(x) for x in args.levels.split(",")]
    args.pipeline_levels = [int(x) for x in args.pipeline_levels.split(",")]
    args.pipeline_server_levels = [int(x) for x in args.pipeline_server_levels.split(",")]
    args.kinds = args.kinds.split(",")
    if unknown := [k for k in args.kinds if k not in COMPARISONS]:
        sys.exit(f"serve.py: unknown --kinds {', '.join(unknown)} (of {', '.join(COMPARISONS)})")
    models = args.model or [QWEN15, QWEN05]
    missing = [str(m) for m in models if not m.is_file()] + [str(LLAMA_BIN / b) for b in ("llama-server", "rpc-server")
                                                             if not (LLAMA_BIN / b).is_file()]
    if missing:
        sys.exit(f"serve.py: missing {', '.join(missing)}: run scripts/fetch_qwen15.sh, scripts/fetch_qwen05.sh, scripts/build_llama_cpp.sh")
    home, logdir = bench_home(), Path(tempfile.mkdtemp(prefix="serve-bench-"))
    print(f"logs in {logdir}", flush=True)
    run = Conditions.start()
    data = {"versions": versions(), "config": {"tokens": args.tokens, "reps": args.reps, "levels": args.levels,
                                               "pipeline_levels": args.pipeline_levels if args.pipeline else [],
                                               "kinds": args.kinds, "pipeline_server_levels": args.pipeline_server_levels,
                                               "models": [str(m) for m in models], "slot_context": SLOT_CONTEXT}}
    stem = args.stem or ("serve-quick" if args.quick else "serve")

    def write() -> None:  # after each part: a later part that fails keeps what was measured
        run.finish()
        for path in write_results(stem, {**run.as_dict(), "elapsed_s": run.elapsed_s, **data}, report(data, run, args), args.out):
            print(f"wrote {path}", flush=True)

    if not args.profile_only:
        data["compare"] = compare(models, args, home, logdir)
        write()
    if args.profile or args.profile_only or args.quick:
        data["profile"] = profile(models[0], args, home, logdir)
        write()


if __name__ == "__main__":
    main()
