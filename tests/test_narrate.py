"""Event lines in words (cluster.narrate): what changed, why, rounded numbers, never JSON."""

from __future__ import annotations

import re

import pytest

from edgepipe.cluster.shells.narrate import describe

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

RAW_JSON = re.compile(r'[{}]|":|\d\.\d{5,}')


def test_known_events_read_as_sentences():
    assert describe({"t": 1.0, "kind": "join", "worker": "w1-laptop", "memory_bytes": 8_000_000_000}) == "w1-laptop joined (8 GB)"
    assert describe({"t": 1.0, "kind": "leave", "worker": "w2", "reason": "connection closed"}) == "w2 left (connection closed)"
    up = describe({"t": 1.0, "kind": "up", "plan": 3, "predicted": {"objective": "latency", "tpot_s": 0.020825126607350038, "ring_s": 0.1}})
    assert up == "plan 3 serving: 20.8 ms/token predicted, objective latency"
    assert describe({"kind": "prepare", "plan": 4, "stages": [["w1", 0, 10], ["w2", 10, 32]], "reason": "w3 joined"}) == \
        "preparing plan 4: w1 [0, 10), w2 [10, 32) (w3 joined)"
    cal = describe({"kind": "calibrated", "worker": "w1", "speed": 1.23456789, "overhead_s": 0.00123456, "reused": True})
    assert cal == "w1 calibrated (recalled): speed 1.23; overhead 1.23 ms"
    dropped = describe({"kind": "prefix_dropped", "blocks": 12, "why": "the prefill of r3 failed part-way"})
    assert dropped == "prefix cache dropped (12 blocks) (the prefill of r3 failed part-way)"


def test_any_event_is_flattened_without_json():
    odd = {"t": 2.0, "kind": "brand_new_thing", "nested": {"a": 0.1234567, "b": [1, 2.5, None], "c": {"deep": True}},
           "ratio": 0.333333333, "when_s": 12.3456789, "size_bytes": 123456789, "none": None}
    line = describe(odd)
    assert line.startswith("brand new thing: ")
    assert not RAW_JSON.search(line), line
    assert "12.3 s" in line and "123 MB" in line and "0.333" in line
    # a known kind that lacks its fields falls back to the generic line
    assert describe({"kind": "join"}) == "join"


def test_units_follow_the_key():
    line = describe({"kind": "probe_x", "rtt_ms": 0.1984, "uplink_mb_s": 133.2, "bandwidth_bytes_per_s": 12_500_000, "wait_s": 0.25})
    assert line == "probe x: rtt 0.198 ms; uplink 133 MB/s; bandwidth 12.5 MB/s; wait 250 ms"
    assert describe({"kind": "link_measured", "src": "a", "dst": "b", "rtt_ms": 0.198, "mb_s": 1220.4}) == \
        "link a to b measured: rtt 0.198 ms, 1220 MB/s"
