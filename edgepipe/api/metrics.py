"""Prometheus metrics and the live speed figures the dashboard shows.

Fed by the coordinator's per-token ``StepRecord``s; exposed at ``GET /metrics``.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self, hidden_size: int):
        r = self.registry = CollectorRegistry()
        self.hidden_size = hidden_size
        self.tokens = Counter("edgepipe_tokens_generated", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("edgepipe_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.requests = Counter("edgepipe_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("edgepipe_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("edgepipe_time_per_output_token_seconds", "Time per output token (decode steps)", buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("edgepipe_tokens_per_second", "Tokens per second over the last 5 s", registry=r)
        self.stage_compute = Histogram("edgepipe_stage_compute_seconds", "Compute time per stage call", ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("edgepipe_stage_batch_size", "Sequences computed together per stage call", ["worker"],
                                    buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.hop_bytes = Counter("edgepipe_hop_bytes", "Activation bytes sent per hop", ["hop"], registry=r)
        self.coordinator_s = Counter("edgepipe_coordinator_seconds", "Coordinator time spent per step (before sending)", registry=r)
        self.wall_s = Counter("edgepipe_step_wall_seconds", "Wall time of steps", registry=r)
        self.direct_steps = Counter("edgepipe_direct_steps", "Decode steps a plan's last stage fed itself (the direct token path: "
                                    "no frame from the coordinator)", registry=r)
        self.workers = Gauge("edgepipe_workers", "Connected workers", registry=r)
        self.in_flight = Gauge("edgepipe_requests_in_flight", "Requests in flight", registry=r)
        self.drafted = Counter("edgepipe_speculative_drafted_tokens", "Tokens drafted into verify passes (speculative decoding)", registry=r)
        self.kept = Counter("edgepipe_speculative_kept_tokens", "Drafted tokens the target kept", registry=r)
        self.verify_passes = Counter("edgepipe_speculative_verify_passes", "Verify passes through the pipeline", registry=r)
        self.prefix_hits = Counter("edgepipe_prefix_hits", "Prompt prefills that started from cached prefix blocks", registry=r)
        self.prefix_reused = Counter("edgepipe_prefix_reused_positions", "Prompt positions taken from the prefix cache (computed by no stage)",
                                     registry=r)
        self.prefix_positions = Gauge("edgepipe_prefix_cached_positions", "Positions each stage holds in cached prefix blocks", registry=r)
        self.checkpoints = Gauge("edgepipe_kv_checkpoints", "KV checkpoints every spare holder acknowledged (since start)", registry=r)
        self.checkpoint_bytes = Gauge("edgepipe_kv_checkpoint_bytes", "KV bytes copied to the spare plan by checkpoints (since start)", registry=r)
        self.checkpoint_failed = Gauge("edgepipe_kv_checkpoints_failed", "KV checkpoints voided: a copy failed or timed out (since start)",
                                       registry=r)
        self.checkpoint_resumed = Gauge("edgepipe_kv_checkpoint_resumes", "Sequences resumed from a KV checkpoint after a recovery", registry=r)
        self.checkpoint_saved = Gauge("edgepipe_kv_checkpoint_positions_saved", "Positions those resumes did not replay", registry=r)
        self._recent: deque[float] = deque(maxlen=4096)
        self._recent_ttft: deque[tuple[float, float]] = deque(maxlen=256)  # (when, prefill step seconds)

    def on_step(self, record) -> None:
        now = time.monotonic()
        out = getattr(record, "tokens_out", 1)
        self._recent.extend([now] * out)
        self.tokens.inc(out)
        if getattr(record, "verified", None) is not None:  # a verify pass: a decode step that yielded ``out`` tokens
            self.verify_passes.inc()
            self.drafted.inc(record.tokens_in - 1)  # the last token and the drafts went in (by the rule, verified ends at the first replaced draft)
            self.kept.inc(out - 1)
            self.tpot.observe(record.wall_s / out)
        elif record.tokens_in > 1:
            self.prompt_tokens.inc(record.tokens_in)
            if record.prefix_reused:
                self.prefix_hits.inc()
                self.prefix_reused.inc(record.prefix_reused)
            self.ttft.observe(record.wall_s)
            self._recent_ttft.append((now, record.wall_s))
        else:
            self.tpot.observe(record.wall_s)
            if getattr(record, "direct", False):
                self.direct_steps.inc()
        self.coordinator_s.inc(record.coordinator_s)
        self.wall_s.inc(record.wall_s)
        for i, entry in enumerate(record.timings):
            worker, compute, positions = entry[0], entry[1], entry[2]
            if record.first_in_batch:  # a batch's sequences share one stage call
                self.stage_compute.labels(worker).observe(compute)
                self.batch_size.labels(worker).observe(entry[4] if len(entry) > 4 else 1)
            if i < len(record.timings) - 1:  # activations leave every stage but the last
                self.hop_bytes.labels(f"{worker}->{record.timings[i + 1][0]}").inc(positions * self.hidden_size * (entry[3] if len(entry) > 3 else 4))

    def live_tokens_per_s(self, window: float = 5.0) -> float:
        now = time.monotonic()
        n = sum(1 for t in self._recent if now - t <= window)
        return n / window

    def recent_ttft_s(self, window: float = 60.0) -> float | None:
        """Mean time to first token (the prefill step) over the last ``window`` seconds, or None."""
        now = time.monotonic()
        recent = [s for t, s in self._recent_ttft if now - t <= window]
        return sum(recent) / len(recent) if recent else None

    def render(self, coordinator) -> bytes:
        self.tokens_per_s.set(self.live_tokens_per_s())
        self.workers.set(len(coordinator.workers))
        self.in_flight.set(coordinator.requests_in_flight)
        self.prefix_positions.set(coordinator.prefix.view()["positions"])
        counts = coordinator.checkpoints.counts
        for gauge, value in ((self.checkpoints, counts.sent), (self.checkpoint_bytes, counts.bytes), (self.checkpoint_failed, counts.failed),
                             (self.checkpoint_resumed, counts.resumed), (self.checkpoint_saved, counts.positions_saved)):
            gauge.set(value)
        return generate_latest(self.registry)
