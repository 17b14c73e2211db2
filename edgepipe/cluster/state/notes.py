"""The dashboard lines that change no state: ``Noted`` events of a ``NoteKind`` (re-exported by ``events``).

Logged like every event, so the dashboard's lines all come from the event log (``narrate.entry``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping


class NoteKind(str, Enum):
    """Every kind of dashboard line that changes no state (``Noted``): a new one is added here.
    A line about a change of state is not a note but read from its event (``narrate.entry``):
    ``up`` (``Committed``), ``checkpoint`` (``CheckpointStored``), ``spare_unbuilt``
    (``SpareLoaded``), ``probe_overruled`` (the ``Distrusted`` measurement), ``pause``
    (``RequestPaused``), ``recovered`` (the ``RequestFed`` that ends a pause)."""

    THROTTLED = "throttled"  # a peer opening worker channels too fast (api)
    REFUSED = "refused"  # a worker channel refused (bad hello, wrong token, bad frame)
    IGNORED = "ignored"  # a frame ignored (a relay or token from a stage that may not send it)
    INVALID_FRAME = "invalid_frame"
    VARIANT = "variant"  # a precision variant built, ready or skipped
    MDNS_UNAVAILABLE = "mdns_unavailable"
    WORKER_RESTARTED = "worker_restarted"  # serve's supervisor started a local worker process again
    # a sequence resumes from a KV checkpoint on the spare: the token loop's resume-or-replay choice
    # (``progress.next_step``), not a change of state: the state it changes is its step's ``RequestFed``
    RESUME = "resume"
    STAGES_TIMED = "stages_timed"
    STAGE_TIMING_FAILED = "stage_timing_failed"
    CALIBRATION_FAILED = "calibration_failed"
    CALIBRATION_NOT_SAVED = "calibration_not_saved"
    LINK_PROBE_FAILED = "link_probe_failed"
    BLOB_REPAIRED = "blob_repaired"
    SPARE_FAILED = "spare_failed"
    PLAN_KEPT = "plan_kept"  # the running plan stays: no other loads beside it, or the one that would failed to (``deploy``)
    DRAFTER = "drafter"  # a drafter worker loading, ready or failed (``cluster.drafting``)
    DRAFT_SITE = "draft_site"  # the draft moved to another site (this process or a drafter worker)


@dataclass(frozen=True)
class Noted:
    """A line for the dashboard that changes nothing in the state (a refused join, a failed
    probe): logged like every event, so the dashboard's lines all come from the log
    (``narrate.entry``). ``NoteKind(kind)`` rejects a kind not listed there."""

    kind: NoteKind
    fields: Mapping
    now: float
