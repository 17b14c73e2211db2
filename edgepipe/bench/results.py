"""Where benchmark results go and how they are written: ``benchmarks/results/<stem>.json`` (the
figures, for tools and later runs) beside ``<stem>.md`` (the table the README cites)."""

from __future__ import annotations

import json
from pathlib import Path

# The checkout this package lives in: results belong to the code that produced them.
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def results_dir(out: str | Path | None = None) -> Path:
    return Path(out) if out is not None else RESULTS


def write_results(stem: str, data: dict | None, markdown: str | None, out: str | Path | None = None) -> list[Path]:
    """Write ``<stem>.json`` (``data``, if any) and ``<stem>.md`` (``markdown``, if any) under ``out``
    (default ``benchmarks/results``); return the paths written."""
    folder = results_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if data is not None:
        path = folder / f"{stem}.json"
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
        written.append(path)
    if markdown is not None:
        path = folder / f"{stem}.md"
        path.write_text(markdown.rstrip("\n") + "\n")
        written.append(path)
    return written


def read_results(stem: str, out: str | Path | None = None) -> dict | None:
    """``<stem>.json`` as an earlier run wrote it, None if there is none."""
    path = results_dir(out) / f"{stem}.json"
    return json.loads(path.read_text()) if path.is_file() else None
