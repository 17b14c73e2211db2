"""Workers stay light: the worker and CLI import no torch, onnx, tokenizers or web server."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("onnx", "torch", "tokenizers", "starlette", "uvicorn", "transformers", "scipy", "highspy", "gguf", "jinja2",
         "prometheus_client", "httpx", "yaml")


def test_worker_imports_only_light_modules():
    code = ("import sys, edgepipe.worker, edgepipe.cli; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"the worker imported heavy modules: {out}"
