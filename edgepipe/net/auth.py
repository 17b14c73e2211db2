"""Credentials: constant-time comparisons and the per-plan secrets of worker data ports.

A stage accepts activation and KV frames only from a peer that presents the secret of
that stage for that plan, in the WebSocket handshake (before any frame is read):

    Authorization: Bearer <secret>        X-Edgepipe-Plan: <plan id>

The coordinator issues the secrets (``plan_secrets``): stage ``i`` gets its own in LOAD
(``data_secret``), its predecessor gets it in the ``next`` hop (``next.secret``), and a KV
mover gets the destination's in KV_EXPORT (``secret``). Where the coordinator sends none,
both ends derive one from the join token, the plan and the receiving port's URL
(``derived_secret``), so only holders of the join token can feed a stage.
Standard library only: workers stay light.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PLAN_HEADER = "X-Edgepipe-Plan"


def same_secret(given: str | bytes | None, expected: str | bytes | None) -> bool:
    """Constant-time equality; ``None`` or empty on either side never matches."""
    if not given or not expected:
        return False
    a = given.encode("utf-8", "surrogateescape") if isinstance(given, str) else bytes(given)
    b = expected.encode("utf-8", "surrogateescape") if isinstance(expected, str) else bytes(expected)
    return hmac.compare_digest(a, b)


def bearer_matches(header: bytes | str | None, secret: str | None) -> bool:
    """``Authorization: Bearer <secret>``, compared in constant time on raw bytes (a header
    that is not UTF-8 is simply wrong, never an error)."""
    if header is None or not secret:
        return False
    raw = header if isinstance(header, bytes) else header.encode("latin-1", "replace")
    return same_secret(raw, b"Bearer " + secret.encode("utf-8"))


def derived_secret(join_token: str, data_url: str, plan: int) -> str:
    """The data-port secret of the stage listening at ``data_url`` for ``plan``, for clusters
    whose coordinator does not issue one: HMAC-SHA256 keyed by the join token."""
    message = f"edgepipe-data|{data_url.rstrip('/')}|{int(plan)}".encode()
    return hmac.new(join_token.encode(), message, hashlib.sha256).hexdigest()


def derived_feed_secret(join_token: str, data_url: str, plan: int) -> str:
    """What a plan's last stage presents at the first stage's data port (``data_url``) when it feeds
    it the next step of a direct run, for clusters whose coordinator does not issue one: distinct
    from the stage's own secret, which the plan's KV movers hold as well."""
    message = f"edgepipe-feed|{data_url.rstrip('/')}|{int(plan)}".encode()
    return hmac.new(join_token.encode(), message, hashlib.sha256).hexdigest()


def plan_secrets(n_stages: int) -> list[str]:
    """Fresh random secrets, one per stage of a new plan (I/O shell: uses the OS's RNG)."""
    return [secrets.token_urlsafe(24) for _ in range(n_stages)]


def data_headers(secret: str | None, plan: int) -> dict[str, str]:
    """The handshake headers a predecessor (or KV mover) presents to a stage's data port."""
    headers = {PLAN_HEADER: str(int(plan))}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    return headers
