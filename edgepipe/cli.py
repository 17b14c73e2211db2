"""The ``edgepipe`` command line, in the style of ollama / llama-server.

    edgepipe generate "prompt"          one process, streams text, prints stats
    edgepipe import model.gguf          write a model package
    edgepipe models                     list imported packages (name, size, modified)
    edgepipe rm NAME                    delete an imported package
    edgepipe serve                      coordinator + local workers + HTTP API
    edgepipe worker --coordinator URL   join a coordinator from this device
    edgepipe plan --devices devices.yaml

Every failure a user can cause ends in one line on stderr and a non-zero exit status. On a
worker-only install (``pip install edgepipe``, no extras) the commands that need the coordinator's
extras say which and how to install them, and exit with status 2. Long steps show their progress
on stderr (``edgepipe.progress``: bars on a terminal, plain lines otherwise).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Serve one LLM from a pool of unlike devices.")
err = Console(stderr=True)
GPU_EXTRA = "pip install 'edgepipe[gpu]'"  # ONNX Runtime's WebGPU provider (runtime.devices.INSTALL_HINT)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    from . import __version__

    try:
        return installed("edgepipe")
    except PackageNotFoundError:  # a source tree without metadata
        return __version__


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"edgepipe {version()}")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                           help="Print the version and exit.")) -> None:
    """Serve one LLM from a pool of unlike devices."""

USER_ERRORS = (ValueError, FileNotFoundError, KeyError, MemoryError, OSError)

HomeOption = typer.Option(None, "--home", help="Where packages and caches live (default: $EDGEPIPE_HOME or the user data dir).")
PrecisionOption = typer.Option("native", "--precision", "-p",
                               help="native: the file's own model, exactly (default; run by the GGUF kernel library where it builds and "
                                    "loads, else as MatMulNBits graphs, said in one line) | int4 | int8 | fp32: a re-quantization of every "
                                    "linear, only when asked for")
ImportPrecisionOption = typer.Option("native", "--precision", "-p", help="native: the GGUF's own blocks, exactly (default) | int4 | int8 | fp32: re-quantize every linear | gguf: the file's bytes for the native kernel library")


def fail(message: str, code: int = 1) -> None:
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # brackets in a message are text
    raise typer.Exit(code)


SERVER_EXTRA = "server"


def missing_extra(extra: str = SERVER_EXTRA) -> list[str]:
    """The distributions of edgepipe's ``extra`` that are not installed (none when edgepipe runs
    from a source tree without metadata: nothing to compare with)."""
    import re
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        requirements = requires("edgepipe") or []
    except PackageNotFoundError:
        return []
    missing = []
    for req in requirements:
        spec, _, marker = req.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker):
            name = re.split(r"[\s<>=!~\[(]", spec.strip(), maxsplit=1)[0]
            try:
                version(name)
            except PackageNotFoundError:
                missing.append(name)
    return missing


def require_server(command: str) -> None:
    """One line and exit status 2 when ``command`` cannot run on this install (a worker-only one)."""
    missing = missing_extra()
    if missing:
        fail(f"`edgepipe {command}` runs on a coordinator and needs the '{SERVER_EXTRA}' extra ({', '.join(missing[:4])}"
             f"{', ...' if len(missing) > 4 else ''} missing): pip install 'edgepipe[{SERVER_EXTRA}]'", code=2)


def _progress():
    """A progress callback for the importer, to ``close`` once the step is over (``edgepipe.progress``)."""
    from .progress import Reporter

    return Reporter(err)


def open_model(model: Optional[str], precision: str, home: Optional[Path]):
    from .model.store import resolve

    progress = _progress()
    try:
        return resolve(model, precision, home, progress=progress)
    finally:
        progress.close()


def open_runnable_model(model: Optional[str], precision: str, home: Optional[Path], add_missing: bool = True):
    """The package of ``model`` and the variant this process (and a CPU worker beside it) runs:
    the file's own model in the GGUF kernel library's form where it loads, else as MatMulNBits
    graphs (``store.prepare_local_form``; ``add_missing``: that form is added to the package when
    it lacks it), each said in one line on stderr when it is not the default."""
    from .model.store import REQUANTIZED, prepare_local_form

    pkg = open_model(model, precision, home)
    if pkg.manifest.precision in REQUANTIZED and pkg.manifest.source.get("kind") == "gguf":
        err.print(f"running a re-quantization to {pkg.manifest.precision} (the default, native, is the file's own blocks exactly)",
                  highlight=False, soft_wrap=True)
    progress = _progress()
    try:
        form, note = prepare_local_form(pkg, progress=progress, add_missing=add_missing)
    finally:
        progress.close()
    if note:
        err.print(note, highlight=False, soft_wrap=True)
    return pkg, form


@app.command("import")
def import_cmd(
    source: Path = typer.Argument(..., help="A .gguf file or a local Hugging Face model folder."),
    precision: str = ImportPrecisionOption,
    name: Optional[str] = typer.Option(None, help="Package name (default: from the file name)."),
    max_context: Optional[int] = typer.Option(None, min=1, help="Longest context the package supports (default: the model's own)."),
    home: Optional[Path] = HomeOption,
):
    """Import a model into a package of per-unit ONNX graphs and hashed weight files."""
    require_server("import")
    from .model.importer import import_model
    from .model.package import Package
    from .model.store import home_dir

    if precision not in ("native", "gguf") and source.suffix.lower() == ".gguf":
        err.print(f"re-quantizing every linear to {precision} (the default, native, keeps the file's own blocks exactly)")
    progress = _progress()
    try:
        path = import_model(source, home_dir(home) / "models", precision, name=name, max_context=max_context, progress=progress)
    except USER_ERRORS as exc:
        fail(str(exc))
    finally:
        progress.close()
    m = Package(path).manifest
    size = sum(v.weight_bytes for u in m.units for v in u.variants.values())
    experts = f" ({m.config['n_experts']} experts, {m.config['n_experts_used']} per token)" if m.config.get("n_experts") else ""
    typer.echo(f"{m.name}: {m.config['architecture']}{experts}, {m.n_layers} layers, {len(m.units)} units, {m.precision}, {size / 1e6:.0f} MB -> {path}")


@app.command("models")
def models_cmd(home: Optional[Path] = HomeOption):
    """List imported model packages: name, size on disk, precision, layers, when modified."""
    require_server("models")
    import time

    from .model.store import list_packages

    rows = [("NAME", "SIZE", "PRECISION", "ARCH", "LAYERS", "MODIFIED")]
    for pkg in list_packages(home):
        m = pkg.manifest
        modified = (pkg.root / "manifest.json").stat().st_mtime
        rows.append((m.name, _size(_disk_bytes(pkg.root)), m.precision, str(m.config.get("architecture", "?")), str(m.n_layers),
                     _ago(time.time() - modified)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _ago(seconds: float) -> str:
    """``ollama list``'s words for a time ago."""
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            n = int(seconds // length)
            return f"{n} {unit}{'s' * (n != 1)} ago"
    return "just now"


@app.command("rm")
def rm_cmd(names: list[str] = typer.Argument(..., metavar="NAME...", help="Imported packages to delete: a name as `edgepipe models` lists it, "
                                                        "or the file stem it was imported from (`qwen15` after `import qwen15.gguf`)."),
           home: Optional[Path] = HomeOption):
    """Delete imported model packages (the source files they were imported from stay)."""
    require_server("rm")
    from .model.store import remove_package

    for spec in names:
        try:
            typer.echo(f"deleted {remove_package(spec, home)}")
        except USER_ERRORS as exc:
            fail(str(exc))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Alias (qwen05: Qwen2.5-Coder-0.5B-Instruct, the default; smollm2: "
                                                                    "the bundled SmolLM2-135M), package name, package dir, .gguf or HF folder."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", min=0.0, help="0 = greedy (llama-server's default: 0.8)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Sample from the smallest set of tokens whose probabilities reach this (1 = off)."),
    top_k: int = typer.Option(40, "--top-k", min=0, help="Sample from the k most likely tokens only (0 = no limit)."),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="Drop tokens less likely than this fraction of the likeliest (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampler (the same seed gives the same text; default: a random one, printed)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the model's chat template."),
    cuts: str = typer.Option("", "--cuts", help="Run as chained stages cut before these unit indices, e.g. 8,20."),
    precision: str = PrecisionOption,
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: ONNX Runtime's, one per core)."),
    home: Optional[Path] = HomeOption,
):
    """Generate text in this process, streaming it to the terminal."""
    require_server("generate")
    from .runtime.local import generate as run_generation
    from .runtime.sequence import GenerationParams
    from .runtime.stage_runner import ContextOverflow

    import secrets

    if seed is None:
        seed = secrets.randbits(63) if temperature > 0 else 0
    try:
        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                  stop=tuple(stop))
        pkg, form = open_runnable_model(model, precision, home)
        tok = pkg.tokenizer
        text = tok.format_chat([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text)
        limit = pkg.manifest.max_context
        if len(ids) + max_tokens > limit:
            raise ContextOverflow(f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the context of {limit} tokens")
        cut_points = [int(c) for c in cuts.split(",") if c.strip()]
        pipeline = pkg.pipeline(cut_points, precision=form, threads=threads)
        written = []

        def on_text(piece: str) -> None:
            written.append(piece[-1:] or (written[-1] if written else ""))
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = run_generation(pipeline, ids, params, tok.decode, pkg.manifest.eos_ids, on_text=on_text)
    except USER_ERRORS as exc:
        fail(str(exc))
    if not written or written[-1] != "\n":  # the text ends its line, on a terminal and in a pipe or file alike
        sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(f"[dim]{len(ids)} prompt tokens, {len(result.tokens)} generated ({result.finish_reason}); "
              f"time to first token {result.ttft_s * 1e3:.0f} ms; {result.tokens_per_s:.1f} tokens/s"
              f"{f'; seed {seed}' if temperature > 0 else '; greedy'}[/]", highlight=False, soft_wrap=True)


def _served_context(pkg, form: str, asked: Optional[int], workers: int) -> int:
    """``serve``'s context (``model.context.served_context``), with its one line when it is cut."""
    import psutil

    from .cluster.rules.profiling import RUNTIME_OVERHEAD_BYTES
    from .model.context import served_context

    m = pkg.manifest
    weights = sum(m.variant(u.index, form).weight_bytes for u in m.units if form in u.variants)
    kv = sum(m.kv_bytes_per_token(u.index, form) for u in m.units)
    free = psutil.virtual_memory().available if workers > 0 else None  # remote workers: their memory is not known here
    context, note = served_context(asked, pkg.stored_context, weights, kv, free, workers * RUNTIME_OVERHEAD_BYTES)
    if note:
        err.print(note, highlight=False, soft_wrap=True)
    return context


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model to serve (default: qwen05, Qwen2.5-Coder-0.5B-Instruct, "
                                                                    "fetched by scripts/fetch_qwen05.sh; smollm2: the bundled SmolLM2-135M)."),
    context: Optional[int] = typer.Option(None, "--context", "-c", min=16,
                                          help="Longest sequence (prompt + answer) in tokens (default: the model's own maximum where "
                                               "this machine's memory holds its KV beside the weights, else the most that fits, "
                                               "said in one line). A request's max_tokens beyond it is clamped to what is left, as "
                                               "llama-server does."),
    workers: int = typer.Option(2, "--workers", "-w", help="Local worker processes to start (0: wait for remote ones)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; then set --api-key and --join-token)."),
    port: int = typer.Option(8420, "--port", help="Port of the API, the dashboard and the worker endpoint."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="EDGEPIPE_API_KEY", help="Require this Bearer token on the API."),
    join_token: Optional[str] = typer.Option(None, "--join-token", envvar="EDGEPIPE_JOIN_TOKEN", help="Workers must present this token."),
    admin_token: Optional[str] = typer.Option(None, "--admin-token", envvar="EDGEPIPE_ADMIN_TOKEN",
                                              help="Bearer token for routes that change the cluster (default: the API key, else loopback only)."),
    data_secrets: str = typer.Option("issued", "--data-secrets",
                                     help="issued: a random secret per stage and plan, given only to its predecessor | derived: "
                                          "derived from the join token (any token holder may feed any stage)."),
    tls: bool = typer.Option(False, "--tls", help="Serve https/wss with a self-signed certificate made once under the home directory."),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="Serve https/wss with this certificate (PEM)."),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="The private key of --tls-cert (PEM)."),
    worker_threads: Optional[int] = typer.Option(None, "--worker-threads", help="Compute threads of each local worker (default: the cores "
                                                                                  "shared among them)."),
    local_device: str = typer.Option("auto", "--local-device", help="Where the first local worker computes: auto (a GPU when one "
                                                                   "is found), cpu, gpu or gpu:N; the other local workers use the CPU. "
                                                                   f"GPUs run through ONNX Runtime's WebGPU provider ({GPU_EXTRA})."),
    min_workers: Optional[int] = typer.Option(None, "--min-workers", help="Workers to wait for before the first plan (default: --workers)."),
    max_active: int = typer.Option(16, "--max-active", help="Sequences decoded at once."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait; beyond this the API answers 429."),
    step_timeout: float = typer.Option(60.0, "--step-timeout", min=1.0,
                                       help="Seconds a pipeline step may take; a stage that computed nothing meanwhile is quarantined."),
    capacity_wait: float = typer.Option(30.0, "--capacity-wait", min=0.0,
                                        help="Seconds a request waits for workers that can hold the model before a 503 says what is missing."),
    objective: str = typer.Option("latency", "--objective", help="latency | throughput | energy"),
    tpot_target_ms: Optional[float] = typer.Option(None, "--tpot-target-ms", help="Time-per-token target for the energy objective."),
    placement: str = typer.Option("planner", "--placement", help="planner | memory (split layers in proportion to memory)."),
    worker_args: str = typer.Option("", "--worker-args", help="Extra flags for the local workers, e.g. '--slowdown 2' (emulation)."),
    cluster: str = typer.Option("edgepipe", "--cluster", help="Name announced by mDNS; workers started with the same --cluster join it."),
    advertise: bool = typer.Option(True, "--advertise/--no-advertise", help="Announce this coordinator on the local network (mDNS)."),
    batch_invariant: bool = typer.Option(False, "--batch-invariant",
                                         help="Give a sequence the same tokens whatever it is batched with (a lone stream runs "
                                              "its 4-bit products on two rows: ~20% slower on 4-bit models)."),
    speculative: Optional[str] = typer.Option(None, "--speculative",
                                              help="Speculative decoding: 'ngram' (prompt lookup), a draft model with the same "
                                                   "tokenizer (package name or GGUF path), run in this process, or "
                                                   "'ngram+MODEL' (prompt lookup where it matches, the model elsewhere)."),
    verify_form: bool = typer.Option(False, "--verify-form",
                                     help="Stages run the verify form and a lost worker's sequences are rebuilt by one prefill each, "
                                          "not one step per generated token (experimental: 1 of 18 measured recoveries streamed other "
                                          "text). CPU workers only; ~20% slower decode on 4-bit MatMulNBits stages."),
    draft_k: int = typer.Option(8, "--draft-k", min=1, max=32, help="Most drafted tokens per verify pass."),
    draft_threads: Optional[int] = typer.Option(None, "--draft-threads", min=1, help="Threads of the draft model in this process."),
    draft_on: str = typer.Option("auto", "--draft-on",
                                 help="Where the draft model runs: auto (where a draft step costs least, measured: this process or a "
                                      "worker started with --role drafter) | coordinator | workers (a drafter worker whenever one is ready)."),
    draft_length: str = typer.Option("timed", "--draft-length",
                                     help="timed: drafts per pass from the measured costs of drafting and verifying (none where plain "
                                          "decoding is faster) | acceptance: from the acceptance rate alone (a sampled request's seed "
                                          "then repeats its tokens exactly)."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache",
                                      help="Keep the KV of prompt prefixes on every stage and reuse it for prompts that start the same."),
    prefix_cache_positions: int = typer.Option(4096, "--prefix-cache-positions", min=0,
                                               help="KV positions of cached prefixes each stage may keep (within its KV budget)."),
    kv_checkpoint_tokens: int = typer.Option(32, "--kv-checkpoint-tokens", min=0,
                                             help="Copy each live sequence's KV to the spare plan's workers every this many generated "
                                                  "tokens, so a recovery replays only the tokens since (0: off; not with speculative "
                                                  "decoding)."),
    direct_steps: int = typer.Option(8, "--direct-steps", min=0,
                                     help="The plan's last stage feeds each sampled token (greedy or drawn) straight into the next step (on several stages: "
                                          "to the first stage, worker to worker), up to "
                                          "this many steps between two frames from the coordinator, which still takes every token in "
                                          "order and stops, cancels and recovers as before (0: every token through the coordinator)."),
    variant_disk: str = typer.Option("4GiB", "--variant-disk",
                                     help="Disk the browser variants may add to the model package (a WebAssembly tab's fp32 "
                                          "units, built unit by unit as its stages need them); a build beyond it is refused."),
    precision: str = PrecisionOption,
    home: Optional[Path] = HomeOption,
):
    """Start the coordinator (API, dashboard, metrics) and local workers."""
    require_server("serve")
    import asyncio
    import signal

    from .cluster.shells import operator_log
    from .serve import ServeSettings, run_server
    from .model.store import home_dir

    operator_log.install()  # joins, leaves, plans, failures, recoveries: the dashboard's lines on this terminal

    if draft_length not in ("timed", "acceptance"):
        fail(f"--draft-length must be timed or acceptance, got {draft_length!r}")
    from .emulate.slowdown import parse_bytes

    try:
        variant_disk_bytes = parse_bytes(variant_disk)
    except ValueError as exc:
        fail(f"--variant-disk: {exc}")
    if draft_on not in ("auto", "coordinator", "workers"):
        fail(f"--draft-on must be auto, coordinator or workers, got {draft_on!r}")
    try:
        # local workers find their form in the package when they join; remote ones get theirs added as they join
        # imported for the model's whole context (an existing shorter package is rebuilt); --context limits what is served
        pkg, form = open_runnable_model(model, precision, home, add_missing=workers > 0)
        pkg.limit_context(_served_context(pkg, form, context, workers))
    except USER_ERRORS as exc:
        fail(str(exc))
    settings = ServeSettings(host=host, port=port, workers=workers, worker_threads=worker_threads, api_key=api_key,
                             join_token=join_token, admin_token=admin_token, data_secrets=data_secrets, tls=tls, tls_cert=tls_cert, tls_key=tls_key,
                             tls_dir=str(home_dir(home) / "tls"),
                             calibration_file=str(home_dir(home) / "calibrations" / f"{pkg.manifest.name}.json"),
                             max_active=max_active, max_queue=max_queue, step_timeout_s=step_timeout, capacity_wait_s=capacity_wait, objective=objective,
                             tpot_target_ms=tpot_target_ms, planner=placement == "planner", worker_args=worker_args.split(),
                             cluster=cluster, advertise=advertise, batch_invariant=batch_invariant, local_device=local_device,
                             speculative=speculative, draft_k=draft_k, draft_threads=draft_threads, draft_length=draft_length, draft_on=draft_on, verify_form=verify_form,
                             prefix_cache_positions=prefix_cache_positions if prefix_cache else 0, kv_checkpoint_tokens=kv_checkpoint_tokens,
                             variant_disk_bytes=variant_disk_bytes, direct_steps=direct_steps)

    def ready(bound: int, coordinator) -> None:
        if min_workers is not None:
            coordinator.settings.min_workers = min_workers
        scheme = "https" if settings.tls or settings.tls_cert else "http"
        err.print(f"edgepipe serving {pkg.manifest.name} on {scheme}://{host}:{bound}  (dashboard /, API /v1, metrics /metrics; "
                  f"{workers} local workers; context {pkg.manifest.max_context} tokens)", highlight=False, soft_wrap=True)
        if scheme == "https":
            err.print(f"TLS certificate sha256 {settings.tls_fingerprint}: workers join with --tls-fingerprint {settings.tls_fingerprint}",
                      highlight=False, soft_wrap=True)  # one unbroken line, whatever the terminal's width: it is copied

    try:
        stopped_by = asyncio.run(run_server(pkg, settings, on_ready=ready))
    except (ValueError, FileNotFoundError) as exc:  # e.g. a draft model that cannot draft for this one
        fail(str(exc).splitlines()[0])
    except OSError as exc:
        fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}")
    except KeyboardInterrupt:  # before the server took the signal over
        stopped_by = signal.SIGINT
    if stopped_by is not None:
        raise typer.Exit(128 + int(stopped_by))  # what a shell reports for a process the signal stopped


@app.command()
def worker(
    coordinator: Optional[str] = typer.Option(None, "--coordinator", "-c", help="Coordinator URL, e.g. http://10.0.0.2:8420 (https:// for serve --tls; ws:// and "
                                                                            "wss:// too; serve prints the line). Default: find one by mDNS."),
    name: Optional[str] = typer.Option(None, "--name", help="This device's name on the dashboard (default: the host name)."),
    memory: Optional[str] = typer.Option(None, "--memory", help="Memory this worker may use, e.g. 1.5GB (a hard budget)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: one per core)."),
    device: str = typer.Option("auto", "--device", help="Where stages compute: auto (a GPU when one is found), cpu, gpu or gpu:N. "
                                                       f"GPUs run through ONNX Runtime's WebGPU provider ({GPU_EXTRA})."),
    spin: Optional[bool] = typer.Option(None, "--spin/--no-spin", help="Let compute threads spin between ops (default: with 2+ threads on a machine "
                                                                        "that is not busy; off when other compute shares the cores)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address for the data port (activations from the previous stage)."),
    port: int = typer.Option(0, "--port", help="Data port (0 = any free port)."),
    advertise: Optional[str] = typer.Option(None, "--advertise", help="Address other workers should use to reach this one."),
    join_token: Optional[str] = typer.Option(None, "--join-token", envvar="EDGEPIPE_JOIN_TOKEN",
                                             help="The coordinator's join token (serve --join-token), if it has one."),
    tls_fingerprint: Optional[str] = typer.Option(None, "--tls-fingerprint", envvar="EDGEPIPE_TLS_FINGERPRINT",
                                                  help="sha256 of the coordinator's TLS certificate (printed by serve --tls): pin it."),
    slowdown: float = typer.Option(1.0, "--slowdown", help="EMULATION: wait (F-1) x compute time after each call."),
    roofline: Optional[str] = typer.Option(None, "--roofline", help="EMULATION: 'FLOPS,BANDWIDTH[,OVERHEAD_MS]', e.g. '20e9,8GB,2': each "
                                           "call lasts overhead + max(weight bytes / bandwidth, rows x 2 x parameters / FLOPS) (instead of --slowdown)."),
    link_delay_ms: float = typer.Option(0.0, "--link-delay-ms", help="EMULATION: one-way delay added to every frame sent."),
    link_rate: Optional[str] = typer.Option(None, "--link-rate", help="EMULATION: cap on send rate, e.g. 128KB/s or 10Mbit."),
    activation_dtype: str = typer.Option("float32", "--activation-dtype", help="float32 | float16 on the wire."),
    drop_work: bool = typer.Option(False, "--drop-work", help="EMULATION: a faulty device that answers heartbeats but drops every activation frame."),
    misreport: float = typer.Option(1.0, "--misreport", min=1.0, help="EMULATION: report compute times divided by this (a device that lies about its speed)."),
    power_busy_w: Optional[float] = typer.Option(None, "--power-busy-w", help="Declared power when computing (energy objective)."),
    power_idle_w: Optional[float] = typer.Option(None, "--power-idle-w", help="Declared power when idle (energy objective)."),
    discover_timeout: float = typer.Option(10.0, "--discover-timeout", help="Seconds to look for a coordinator by mDNS."),
    cluster: str = typer.Option("edgepipe", "--cluster", help="With no --coordinator: join the coordinator announcing this name."),
    role: str = typer.Option("stage", "--role", help="stage: hold the stages the coordinator plans | drafter: hold no stage, run the "
                                                     "draft model of a speculative coordinator (a weak device beside the pipeline)."),
):
    """Join a coordinator and serve the stage it assigns (needs only onnxruntime, numpy, websockets)."""
    import asyncio
    import logging

    from .worker import Worker, WorkerSettings
    from .worker.connect import CannotJoin, coordinator_base
    from .emulate.slowdown import parse_bytes

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("edgepipe.worker").setLevel(logging.INFO)  # joins, reconnects, downloads: a few lines
    if role not in ("stage", "drafter"):
        fail(f"--role must be stage or drafter, got {role!r}")
    try:
        if coordinator is None:
            from .net.discovery import find_coordinator

            coordinator = find_coordinator(timeout=discover_timeout, cluster=cluster)
            err.print(f"found coordinator {coordinator} by mDNS", highlight=False)
        settings = WorkerSettings(coordinator=coordinator_base(coordinator), memory_bytes=parse_bytes(memory) if memory else None, threads=threads,
                                  spin=spin, slowdown=slowdown, roofline=roofline, drop_work=drop_work, misreport=misreport, link_delay_ms=link_delay_ms, link_rate=link_rate, data_host=host, data_port=port,
                                  advertise_host=advertise, join_token=join_token, tls_fingerprint=tls_fingerprint,
                                  activation_dtype=activation_dtype,
                                  power_busy_w=power_busy_w, power_idle_w=power_idle_w, device=device, role=role,
                                  **({"name": name} if name else {}))
        asyncio.run(Worker(settings).serve_until_terminated())
    except (PermissionError, CannotJoin) as exc:  # retrying cannot help (worker.connect)
        fail(str(exc))
    except (ConnectionError, OSError, ValueError, TimeoutError) as exc:
        fail(f"worker stopped: {exc}")
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Stopped (its final bye is sent): leave now. A compute still running in the thread pool,
        # or mDNS browsing threads, would otherwise hold the interpreter's exit for seconds.
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


DEVICES_HELP = """The devices file is YAML:

devices (required, a list), each: id (unique), memory (e.g. 8GiB, 512MB), speed (cost units per second, 1.0 = the
reference device); optional: overhead_ms, power_busy_w, power_idle_w, prefill_speed, held_units (unit indices it caches),
relay (true: cannot accept connections, e.g. a browser), emulated, precision (native | int4 | int8 | fp32),
activation_dtype (float32 | float16), kind (cpu | gpu), adapter.

defaults (optional): any device key but id, memory and held_units, for every device that omits it.

network (optional): default {rtt_ms, bandwidth} for pairs not listed, and links [{src, dst, rtt_ms, bandwidth}] (one
direction; the reverse is assumed equal; the coordinator is "coordinator"). Bandwidths as 100Mbit/s or 12.5MB/s.

Example: devices: [{id: laptop, memory: 8GiB, speed: 1.0}, {id: pi5, memory: 3GiB, speed: 0.25, overhead_ms: 4}]

Unknown keys are errors. Exit status 2: no complete plan (the partial one is printed, without throughput or energy)."""


@app.command(epilog=DEVICES_HELP)
def plan(
    devices: Path = typer.Option(..., "--devices", "-d", help="A devices.yaml file: the devices, their memory and speed, and the "
                                                              "links between them (its keys below)."),
    objective: str = typer.Option("latency", "--objective", help="latency | throughput | energy"),
    sequences: int = typer.Option(1, "--sequences", help="Sequences in flight (throughput and energy objectives)."),
    tpot_target_ms: Optional[float] = typer.Option(None, "--tpot-target-ms", help="Time-per-token target (energy objective only)."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Prompt length the plan's time to first token is predicted for."),
    context: int = typer.Option(2048, "--context", help="KV tokens reserved per sequence."),
    top_k: int = typer.Option(3, "--top-k", help="Plans to show (best + runners-up)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model to place (default: the bundled smollm2)."),
    precision: Optional[str] = typer.Option(None, "--precision", "-p", help="Weight variant to plan (default: the package's own; the import default when importing)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON document."),
    home: Optional[Path] = HomeOption,
):
    """Place the model on the devices of a devices.yaml and print the plan with its runners-up."""
    require_server("plan")
    import json

    from .plan import Objective, PlanRequest, load_devices, render, to_json
    from .plan import plan as make_plan

    try:
        chosen = Objective(objective)
    except ValueError:
        fail(f"--objective {objective!r} is not one of latency, throughput, energy")
    if tpot_target_ms is not None and chosen is not Objective.ENERGY:
        fail(f"--tpot-target-ms applies to the energy objective only (got --objective {chosen.value})")
    if sequences > 1 and chosen is Objective.LATENCY:
        fail("--sequences applies to the throughput and energy objectives (latency plans one sequence)")
    try:
        text = devices.read_text()
        from .model.store import DEFAULT_PRECISION

        pkg = open_model(model, precision or DEFAULT_PRECISION, home)
        model_profile = _plan_model_profile(pkg, precision, context)
        spec = load_devices(text, str(devices), units=model_profile.n_units)
        request = PlanRequest(objective=chosen, sequences=sequences, prompt_tokens=prompt_tokens, top_k=top_k,
                              tpot_target_s=tpot_target_ms / 1e3 if tpot_target_ms is not None else None)
        result = make_plan(model_profile, spec.devices, spec.network, request)
    except USER_ERRORS as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if as_json:
        typer.echo(json.dumps({"model": pkg.manifest.name, "units": model_profile.n_units, **to_json(result)}, indent=1))
    else:
        typer.echo(f"{pkg.manifest.name}: {model_profile.n_units} units, objective {request.objective.value}")
        typer.echo(render(result, spec.devices))
    if not result.best.complete:
        raise typer.Exit(2)


def _plan_model_profile(pkg, precision: Optional[str], context: int):
    """The planner's model profile for `edgepipe plan`: the requested variant (refused if the
    package lacks it), every variant's weight sizes (for devices that run another one, e.g. a
    browser's fp32), and the embedding/head files both units count (tied weights)."""
    from dataclasses import replace

    from .cluster.rules.profiling import ClusterProfile

    manifest = pkg.manifest
    have = sorted(set.intersection(*(set(u.variants) for u in manifest.units)))
    if precision is not None and precision not in have:
        raise ValueError(f"--precision {precision} does not apply: package {manifest.name} has "
                         f"{', '.join(have)} weights (import the model again with --precision {precision})")
    profile = ClusterProfile(manifest, context_tokens=context).model_profile(precision)
    variants = tuple((p, tuple(manifest.variant(u.index, p).weight_bytes for u in manifest.units)) for p in have)
    chosen = precision or manifest.precision
    shared = set(manifest.variant(0, chosen).files) & set(manifest.variant(len(manifest.units) - 1, chosen).files)
    tied = sum(pkg.blob(sha).stat().st_size for sha in sorted(shared) if pkg.blob(sha).is_file())
    tied = min(tied, profile.units[0].weight_bytes, profile.units[-1].weight_bytes)
    return replace(profile, variant_weight_bytes=variants, tied_bytes=tied)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
