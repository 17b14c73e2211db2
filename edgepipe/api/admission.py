"""Admission as the HTTP routes use it: ``cluster.shells.admission.Admission`` with its refusal as a 429.

The decision is ``edgepipe.cluster.rules.core.handle`` (``AdmitAsked``, ``AdmitLeft``) (its book ``ClusterState.admission``), its
shell ``edgepipe.cluster.shells.admission.Admission``; this wrapper only turns ``QueueFull`` into
an OpenAI-shaped ``APIError(429)`` with ``Retry-After``, so the routes keep their one call.
"""

from __future__ import annotations

from ..cluster.shells.admission import Admission as _Admission, AdmissionError, QueueFull
from .errors import APIError


class Admission(_Admission):
    async def admit(self, positions: int = 0) -> int:
        try:
            return await super().admit(positions)
        except AdmissionError as exc:  # QueueFull: 429; any other refusal: 503 with its code
            full = isinstance(exc, QueueFull)
            raise APIError(429 if full else 503, str(exc), type_="rate_limit_error" if full else "server_error",
                           code=exc.code, headers={"Retry-After": str(exc.retry_after_s)}) from None


__all__ = ["Admission", "QueueFull"]
