"""The serve terminal's operator log: the dashboard's lines (``narrate``) as log lines.

Each narrated event is one INFO line in words (``narrate.describe``): joins, leaves, plans
prepared and serving, failures, quarantines, recoveries. The routine ones, which come with every
request or every few seconds (``ROUTINE``: KV checkpoints, link measurements, stage timings), are
counted instead and said as one line per window (``WINDOW_S``), e.g. ``in the last 60 s: 41 KV
checkpoints``, said with the first line of any kind that comes once the window has passed (no
timer: a quiet server writes nothing).

``Summary`` is the pure part (lines in, lines out, time passed in); ``OperatorLog`` is the thin
``logging.Handler`` that feeds it the coordinator's records (each narrated record carries its
dashboard entry as ``record.narrated``) and writes what it returns.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from .narrate import describe

WINDOW_S = 60.0
# kind -> its words in a count ("41 KV checkpoints"); every other kind gets a line of its own
ROUTINE: Mapping[str, str] = {"checkpoint": "KV checkpoints", "link_measured": "link measurements", "stages_timed": "stage timings"}


@dataclass
class Summary:
    """Counts the routine lines of the current window; says them with the first line after it."""

    window_s: float = WINDOW_S
    since: float | None = None  # when the first routine line of this window came
    counts: dict[str, int] = field(default_factory=dict)

    def feed(self, kind: str, text: str, now: float) -> list[str]:
        """The lines to write for one narrated line of ``kind`` at ``now`` (seconds)."""
        out = []
        routine = kind in ROUTINE
        if self.counts and now - self.since >= self.window_s:
            out.append(self.flush(now))
        if routine:
            if not self.counts:
                self.since = now
            self.counts[kind] = self.counts.get(kind, 0) + 1
        else:
            out.append(text)
        return out

    def flush(self, now: float) -> str:
        """The count line for the window so far (the window then starts again)."""
        parts = ", ".join(f"{n} {ROUTINE[k]}" for k, n in sorted(self.counts.items()))
        line = f"in the last {now - self.since:.0f} s: {parts}"
        self.counts, self.since = {}, None
        return line


class OperatorLog(logging.Handler):
    """Writes the coordinator's narrated records through a ``Summary``; any other record as is."""

    def __init__(self, stream=None, window_s: float = WINDOW_S):
        super().__init__(logging.INFO)
        self.stream = stream or sys.stderr
        self.summary = Summary(window_s)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = getattr(record, "narrated", None)
            if not isinstance(line, Mapping):
                self.stream.write(self.format(record) + "\n")
            else:
                for text in self.summary.feed(str(line.get("kind")), describe(line), record.created):
                    self.stream.write(self.format(_with_message(record, text)) + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - logging never takes the server down
            self.handleError(record)


def _with_message(record: logging.LogRecord, text: str) -> logging.LogRecord:
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg, copy.args = text, None
    return copy


def install(names: tuple[str, ...] = ("edgepipe.coordinator", "edgepipe.serve"), stream=None) -> OperatorLog:
    """The operator log on these loggers at INFO (the serve command's terminal)."""
    handler = OperatorLog(stream)
    for name in names:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return handler
