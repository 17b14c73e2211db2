"""How long a sequence ``serve`` lets grow (``serve --context``): a pure decision.

By default the model's own maximum (what its package holds: ``import`` builds the rotary tables
for the model's whole context), unless this machine's free memory cannot hold one sequence's KV
at that length beside the weights: then the longest that fits, in whole 256-token steps and at
least ``FLOOR`` tokens (what every stage reserves anyway), said in one line. A context asked
for is taken as asked (a budget the user chose), within what the package holds.
"""

from __future__ import annotations

FLOOR = 2048  # = net.limits.KV_RESERVE_TOKENS: the KV room every stage keeps for one sequence
STEP = 256


def served_context(asked: int | None, stored: int, weight_bytes: int, kv_bytes_per_token: int,
                   free_bytes: int | None, overhead_bytes: int = 0) -> tuple[int, str | None]:
    """``(context, note)``: the context to serve and one line when it is not the default
    (``note`` None otherwise). ``stored``: the positions the package holds; ``free_bytes``: the
    memory available to the local workers (None: unknown, e.g. no local worker: not checked).
    ``ValueError`` for a context the package cannot hold."""
    if asked is not None:
        if asked > stored:
            raise ValueError(f"--context {asked} is more than the {stored} tokens the package holds "
                             f"(the model's own maximum, or what it was imported with: edgepipe import --max-context)")
        return asked, None
    if free_bytes is None or kv_bytes_per_token <= 0:
        return stored, None
    fits = (free_bytes - weight_bytes - overhead_bytes) // kv_bytes_per_token
    if fits >= stored:
        return stored, None
    context = min(stored, max(FLOOR, fits // STEP * STEP))
    need = stored * kv_bytes_per_token
    return context, (f"context {context} tokens, not the model's {stored}: a sequence that long needs {need / 1e6:.0f} MB of KV "
                     f"and {max(0, free_bytes - weight_bytes - overhead_bytes) / 1e6:.0f} MB are free beside the weights "
                     f"(serve --context sets it)")
