"""Progress of the command line's long steps (an import, the implicit import of ``generate -m
x.gguf``, a form added to a package), fed by the importer's ``(phase, done, total)`` callbacks.

On a terminal: rich bars (the weights phase counts bytes, so it shows sizes and MB/s). Otherwise
(a pipe, a log file, CI): plain lines for a phase that lasts ``QUIET_S`` or more, the first then,
the next at most one per ``PLAIN_EVERY_S`` seconds, and one when it ends, each with the rate for
byte phases; a phase over sooner says nothing (a failed command's one line stays one line). Both go to
stderr; stdout stays the command's answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

LABELS = {"hash": "reading the source", "weights": "converting weights", "build": "importing units", "measure": "measuring unit costs"}
BYTE_PHASES = frozenset({"hash", "weights"})
PLAIN_EVERY_S = 5.0
QUIET_S = 1.0


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


@dataclass
class PlainLines:
    """Which plain progress lines to write (pure: the time is passed in)."""

    every_s: float = PLAIN_EVERY_S
    quiet_s: float = QUIET_S
    started: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # phase -> its last (done, total)

    def line(self, phase: str, done: int, total: int, now: float) -> str | None:
        """The line for this callback, or None (too soon after the last one, or the phase ended)."""
        if phase in self.ended or (phase in BYTE_PHASES and total <= 0):  # no bytes to count (a form kept as the file's own blocks)
            return None
        self.started.setdefault(phase, now)
        self.seen[phase] = (done, total)
        end = total > 0 and done >= total
        if phase not in self.last:  # nothing said yet: only once the phase has lasted quiet_s
            if now - self.started[phase] < self.quiet_s:
                if end:
                    self.ended.add(phase)
                return None
        elif not (end or now - self.last[phase] >= self.every_s):
            return None
        return self._say(phase, done, total, now, end)

    def finish(self, now: float) -> list[str]:
        """The closing line of every phase that did not reach its total (a meter that counts only
        part of what it names): where it got to, and how long it took."""
        return [self._say(phase, *self.seen[phase], now, True) for phase in self.started if phase in self.last and phase not in self.ended]

    def _say(self, phase: str, done: int, total: int, now: float, end: bool) -> str:
        self.last[phase] = now
        if end:
            self.ended.add(phase)
        label = LABELS.get(phase, phase)
        if phase in BYTE_PHASES:
            elapsed = now - self.started[phase]
            rate = f" ({done / elapsed / 1e6:.1f} MB/s)" if elapsed > 0 and done else ""
            text = f"{label}: {_mb(done)} of {_mb(total)}{rate}"
        else:
            text = f"{label}: {done}/{total}"
        return text + (f", done in {now - self.started[phase]:.1f} s" if end else "")


class Reporter:
    """A progress callback for the importer, and ``close`` once the step is over."""

    def __init__(self, console, terminal: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.console, self.clock = console, clock
        self.terminal = console.is_terminal if terminal is None else terminal
        self.plain = PlainLines()
        self._bars = None
        self._tasks: dict[str, int] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.terminal:
            text = self.plain.line(phase, done, total, self.clock())
            if text is not None:
                self.console.print(text, highlight=False, soft_wrap=True)
            return
        bars = self._bars_for(phase)
        if phase not in self._tasks:
            self._tasks[phase] = bars.add_task(LABELS.get(phase, phase), total=total)
        bars.update(self._tasks[phase], completed=done, total=total)

    def _bars_for(self, phase: str):
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TransferSpeedColumn)

        if self._bars is None:
            self._bars = {
                "bytes": Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                  TimeElapsedColumn(), console=self.console, transient=True),
                "count": Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self.console, transient=True)}
        kind = "bytes" if phase in BYTE_PHASES else "count"
        for other, bars in self._bars.items():  # one live display at a time
            if other != kind and bars.live.is_started:
                bars.stop()
        bars = self._bars[kind]
        if not bars.live.is_started:
            bars.start()
        return bars

    def close(self) -> None:
        if not self.terminal:
            for text in self.plain.finish(self.clock()):
                self.console.print(text, highlight=False, soft_wrap=True)
        for bars in (self._bars or {}).values():
            if bars.live.is_started:
                bars.stop()
