"""Where a worker joins, and whether a failed attempt to reach the coordinator is worth another.

A worker keeps retrying where the coordinator may come back (connection refused, reset or timed
out; a dropped connection; a 5xx or 429 from the coordinator or a proxy in front of it) and stops
with one line where retrying cannot help: a URL without a scheme, a path that is not a
coordinator's, a 401 / 403, a server that is not an edgepipe coordinator, TLS asked of a server
that answers plain HTTP. Pure: the shell (``worker.shell``) does the I/O and asks ``verdict``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

WORKER_PATH = "/v1/worker"  # the coordinator's worker socket (``api.cluster_routes``)
SCHEMES = {"http": "http", "https": "https", "ws": "http", "wss": "https"}  # as given -> the HTTP base's


class CannotJoin(Exception):
    """Retrying cannot help: the worker stops with this one line (and a non-zero exit)."""


@dataclass(frozen=True)
class Retry:
    why: str


@dataclass(frozen=True)
class Stop:
    why: str


def coordinator_base(url: str) -> str:
    """The coordinator's HTTP base URL (``http(s)://host:port[/prefix]``) from what the user
    gave: ``http``, ``https``, ``ws`` or ``wss``, with or without the socket's ``/v1/worker``.
    Raises :class:`CannotJoin` for a URL no coordinator can have."""
    text = url.strip()
    parts = urlsplit(text if "://" in text else "")
    if "://" not in text:
        raise CannotJoin(f"--coordinator {url!r} has no scheme: give http://{text.rstrip('/')} "
                         f"(or https:// for a coordinator started with --tls)")
    if parts.scheme.lower() not in SCHEMES:
        raise CannotJoin(f"--coordinator {url!r}: the scheme must be http://, https://, ws:// or wss://, not {parts.scheme}://")
    if not parts.hostname:
        raise CannotJoin(f"--coordinator {url!r} names no host")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise CannotJoin(f"--coordinator {url!r}: the port is not a number") from None
    if parts.query or parts.fragment:
        raise CannotJoin(f"--coordinator {url!r}: a coordinator URL has no query or fragment")
    path = parts.path.rstrip("/")
    if path.endswith(WORKER_PATH):
        path = path[: -len(WORKER_PATH)]
    return f"{SCHEMES[parts.scheme.lower()]}://{parts.netloc}{path}"


def control_url(base: str) -> str:
    """The worker socket's URL for a coordinator's HTTP base."""
    base = coordinator_base(base)
    return ("wss://" + base[len("https://"):] if base.startswith("https://") else "ws://" + base[len("http://"):]) + WORKER_PATH


def plain_http_instead(base: str) -> str:
    """The line for an https:// coordinator that answers plain HTTP."""
    where = urlsplit(base)
    return (f"{where.netloc} serves plain HTTP, not TLS: join with --coordinator http://{where.netloc}{where.path} "
            f"(or start serve with --tls)")


def verdict(exc: BaseException, url: str) -> Retry | Stop:
    """Retry or stop after ``exc`` failed the connection to the worker socket at ``url``."""
    from websockets import exceptions as wse

    name = str(exc) or type(exc).__name__
    if isinstance(exc, wse.InvalidURI):
        return Stop(f"{url} is not a WebSocket URL: {name}")
    if isinstance(exc, (wse.InvalidStatus, wse.InvalidProxyStatus)):
        code = exc.response.status_code
        if code >= 500 or code in (408, 429):  # the coordinator (or a proxy before it) may answer later
            return Retry(f"{url} answered HTTP {code}")
        if code in (401, 403):
            return Stop(f"{url} answered HTTP {code} ({'unauthorized' if code == 401 else 'forbidden'}): not a coordinator's worker "
                        f"socket at this path, or refused before the join token is read (a proxy?); retrying cannot help")
        if code == 404:
            return Stop(f"{url} answered HTTP 404: nothing at this path (is --coordinator the coordinator's address, with no path?)")
        return Stop(f"{url} answered HTTP {code} instead of a WebSocket: not an edgepipe coordinator")
    if isinstance(exc, wse.InvalidMessage):
        cause = exc.__cause__
        if cause is None or isinstance(cause, (EOFError, ConnectionError, TimeoutError)):
            return Retry(f"{url}: the connection closed during the handshake")  # a server stopping, or restarting
        return Stop(f"{url} did not answer with a WebSocket handshake ({cause}): not an edgepipe coordinator")
    if isinstance(exc, wse.InvalidHandshake):
        return Stop(f"{url} is not an edgepipe coordinator's worker socket: {name}")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Stop(f"{url}: the coordinator's certificate is not the pinned one any more ({exc.verify_message}); "
                    f"restart the worker with the --tls-fingerprint serve prints now")
    if isinstance(exc, ssl.SSLError):
        return Stop(f"{url}: no TLS handshake ({name}): is the coordinator serving TLS (serve --tls)?")
    if isinstance(exc, ValueError):  # e.g. a pinned certificate that does not match
        return Stop(name)
    return Retry(f"cannot reach {url}: {name}")  # refused, reset, unreachable, timed out, name not (yet) resolved
