"""Sequence ids, the one definition: what the coordinator names a request's KV on the workers.

A request ``rid`` runs as sequence ``<rid>.<epoch>``: epoch 0 at its start, one more each time
its KV is rebuilt on a new plan by replay, so a stale frame of an earlier life never touches the
new one. A KV checkpoint copied to the spare plan is ``<rid>.c<n>`` (``n`` counts the
coordinator's checkpoints); a sequence resumed from it keeps that name. Workers treat ids as
opaque strings; only the coordinator makes and reads them.
"""

from __future__ import annotations

CHECKPOINT_MARK = "c"


def live(rid: str, epoch: int) -> str:
    """The sequence of request ``rid`` in its ``epoch``-th life."""
    return f"{rid}.{epoch}"


def checkpoint(rid: str, n: int) -> str:
    """The ``n``-th checkpoint copy's sequence of request ``rid``."""
    return f"{rid}.{CHECKPOINT_MARK}{n}"


def is_checkpoint(seq: str) -> bool:
    """Whether ``seq`` names a checkpoint copy (not a live epoch)."""
    return seq.rpartition(".")[2].startswith(CHECKPOINT_MARK)


def request_of(seq: str) -> str:
    """The request a sequence belongs to."""
    return seq.rpartition(".")[0]
