"""The serve terminal's operator log (``cluster.operator_log``): narrated lines in words, the
routine ones counted per window."""

from __future__ import annotations

import io
import logging

import pytest

from edgepipe.cluster.shells.operator_log import OperatorLog, Summary

pytestmark = pytest.mark.pure


def test_other_lines_are_said_and_routine_ones_counted_per_window():
    s = Summary(window_s=60)
    assert s.feed("join", "w1 joined", 0.0) == ["w1 joined"]
    assert s.feed("checkpoint", "ignored", 1.0) == []
    assert s.feed("checkpoint", "ignored", 2.0) == []
    assert s.feed("link_measured", "ignored", 3.0) == []
    assert s.feed("up", "plan 2 serving", 30.0) == ["plan 2 serving"]  # inside the window: the count waits
    assert s.feed("checkpoint", "ignored", 61.5) == ["in the last 60 s: 2 KV checkpoints, 1 link measurements"]
    # the line that closed the window opened the next one
    assert s.feed("leave", "w1 left", 200.0) == ["in the last 138 s: 1 KV checkpoints", "w1 left"]
    assert s.feed("leave", "w2 left", 201.0) == ["w2 left"]


def test_the_handler_writes_a_narrated_record_in_words():
    out = io.StringIO()
    logger = logging.Logger("edgepipe.coordinator.test")
    logger.addHandler(OperatorLog(out))
    logger.info("%s %s", "join", {"worker": "w3-phone"}, extra={"narrated": {"t": 0, "kind": "join", "worker": "w3-phone",
                                                                            "memory": 2_000_000_000}})
    logger.info("%s %s", "checkpoint", {}, extra={"narrated": {"t": 0, "kind": "checkpoint", "request": "r1"}})
    logger.warning("a plain warning")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("edgepipe.coordinator.test INFO w3-phone joined (2 GB)")
    assert lines[1].endswith("WARNING a plain warning")
