"""The coordinator's own edgepipe wheel (``edgepipe.dist``), for the machines that join it:
``pip install http://<coordinator>:8420/dist/edgepipe-<version>-py3-none-any.whl``.

PUBLIC, by design: the wheel is the open-source code anyone can fetch, it holds no secret (no
token, no model, no configuration) and a machine must install it before it holds any
credential, so this route is declared open (``Guard.OPEN``). Every other route here would need the key.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse

from .. import dist
from .errors import APIError
from .routing import Guard, get

async def built_wheel(state) -> Path:
    """The wheel, built on first use in a thread (the event loop keeps serving meanwhile): a
    daemon thread, not the loop's executor, which a stopping server would wait for."""
    cache = getattr(state, "dist_cache", None) or dist.default_cache()
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result=None, error=None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def build() -> None:
        try:
            result, error = dist.build_wheel(cache), None
        except Exception as exc:  # noqa: BLE001 - carried to the awaiting request
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=build, name="edgepipe-wheel", daemon=True).start()
    return await done


async def wheel(request: Request) -> FileResponse:
    name = request.path_params["name"]
    served = dist.find_source().wheel_name
    if name != served:
        raise APIError(404, f"this coordinator serves {served}, not {name[:100]}", code="wheel_not_found")
    try:
        path = await built_wheel(request.app.state)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise APIError(503, f"cannot build the edgepipe wheel here: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                       type_="server_error", code="wheel_unavailable") from None
    return FileResponse(path, media_type="application/octet-stream", filename=served)


async def print_join_commands(state, base_url: str, join_token: str | None, fingerprint: str | None, out=None) -> None:
    """Build the wheel now and print the commands another machine runs to join (once it is built)."""
    out = out or sys.stderr
    try:
        path = await built_wheel(state)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        print(f"edgepipe: cannot build the edgepipe wheel for other machines: {exc}", file=out, flush=True)
        return
    sha = await asyncio.get_running_loop().run_in_executor(None, dist.wheel_sha256, path)
    lines = dist.join_commands(base_url, path.name, sha, join_token, fingerprint)
    print("edgepipe: on another machine (Python 3.11+; its dependencies come from the package registry):\n  "
          + "\n  ".join(lines), file=out, flush=True)


routes = [get("/dist/{name}", wheel, guard=Guard.OPEN)]  # public on purpose: see the module docstring
