"""What the coordinator has measured about its cluster, as planner profiles.

Measuring is I/O and lives in the coordinator; this module keeps the numbers and turns them
into ``edgepipe.plan`` profiles:

- unit costs: measured once per unit at import (seconds per decode token on the importer);
- device speed and per-call overhead: calibration at join times two unit ranges of different
  length (fit ``t = overhead + cost / speed``), then every real decode step a worker reports
  refines its speed (median over a window);
- links: RTT from heartbeats, upload bandwidth from a timed probe frame; worker-to-worker
  links as the workers measured them on their data ports (``peer_measured``: round trip and a
  timed transfer, see ``LinkProber.probe_pair``), kept as a matrix by ordered pair. A pair
  nobody measured is priced as a path through both access links (star topology): the larger
  RTT and the smaller bandwidth (``plan.profiles.link_matrix``). When a browser relays
  through the coordinator, the coordinator's link is marked shared (contention, seed 002);
- lives, by device name (a device that reconnects gets a new worker id): how long it stayed
  and how often it left, for reliability-aware placement; and its last calibration, so a
  device that comes back with the same hardware need not be timed again — kept on disk
  (``known_devices``) so that holds across a coordinator restart too.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ...plan import COORDINATOR, failure_rate, DeviceProfile, ModelProfile, NetworkProfile, RollingMedian, UnitProfile, fit_speed_overhead
from ...plan.profiles import DEFAULT_LINK, DEFAULT_POWER_BUSY_W, DEFAULT_POWER_IDLE_W, link_matrix
from ..state import known_devices, measurements
from ..state.known_devices import DeviceLives, DeviceMeasurements
from .deploy import worker_variant

LOOPBACK_BANDWIDTH = 1e9  # bytes/s assumed until a probe says otherwise
RUNTIME_OVERHEAD_BYTES = 64 << 20  # a session's own buffers and the shared rotary tables (2 MiB)
ROW_FLOOR = 0.01  # the least a further row of a batched step is priced at, as a share of a one-row step


class ClusterProfile:
    def __init__(self, manifest, context_tokens: int = 2048, window: int = 32, variant_disk_bytes: int | None = None):
        self.manifest = manifest
        self.variant_disk_bytes = variant_disk_bytes  # what built variants may add on disk (``variants.budget_problem``; None: unbounded)
        self.window = window
        self.context_tokens = min(context_tokens, manifest.max_context)
        self.devices: dict[str, DeviceMeasurements] = {}
        self.lives: dict[str, DeviceLives] = {}
        self.known: dict[tuple, DeviceMeasurements] = {}  # last calibration by (name, declared hardware)
        self.peer_links: dict[tuple[str, str], tuple[float, float]] = {}  # (src, dst) -> (RTT, bandwidth) on the data port
        self.hop_excess = RollingMedian(window)  # seconds per hop decode steps took beyond the link model
        self._profiles: dict[tuple, ModelProfile] = {}  # model_profile's answers for ``_profiles_of`` (a pure function of it)
        self._profiles_of = None

    def of(self, worker_id: str) -> DeviceMeasurements:
        return self.devices.setdefault(worker_id, DeviceMeasurements())

    def forget(self, worker_id: str, identity: tuple | None = None) -> None:
        for pair in [p for p in self.peer_links if worker_id in p]:
            del self.peer_links[pair]
        m = self.devices.pop(worker_id, None)
        if identity is not None and m is not None and m.calibrated:
            self.known[identity] = m

    def recall(self, worker_id: str, identity: tuple) -> bool:
        """A device seen before with the same declared hardware: reuse what was measured."""
        m = self.known.get(identity)
        if m is None:
            return False
        self.devices[worker_id] = DeviceMeasurements(m.speed, m.overhead_s, True, m.rtt, m.bandwidth_bytes_per_s, trusted=m.trusted,
                                                     row_speed=m.row_speed)
        return True

    def remember(self, worker_id: str, identity: tuple) -> None:
        """Keep a finished calibration under the device's identity (``recall`` finds it)."""
        m = self.devices.get(worker_id)
        if m is not None and m.calibrated:
            self.known[identity] = m

    def save_known(self, path: Path) -> None:
        """The remembered calibrations as JSON (``known_devices.save``)."""
        known_devices.save(self.known, self.manifest.name, path)

    def load_known(self, path: Path) -> int:
        """Calibrations saved by an earlier coordinator for this model; returns how many (``known_devices.load``)."""
        loaded = known_devices.load(path, self.manifest.name)
        self.known.update(loaded)
        return len(self.known) if loaded else 0

    # -- the one way measurements come in ------------------------------------------------------
    def apply(self, m: "measurements.Measurement") -> None:
        """Take one measurement (``cluster.measurements``) into the profile."""
        M = measurements
        match m:
            case M.DeviceJoined(name, now):
                self.joined(name, now)
            case M.DeviceLeft(wid, name, identity, now, failure):
                self.forget(wid, identity)
                self.left(name, now, failure)
            case M.Recalled(wid, identity):
                self.recall(wid, identity)
            case M.Calibrated(wid, samples, identity, _):
                try:
                    self.calibrated(wid, list(samples))
                except ValueError:  # noisy timings that no line fits: speed from the ratio, no overhead
                    self.calibrated_by_ratio(wid, list(samples))
                if identity is not None:
                    self.remember(wid, identity)
            case M.Distrusted(wid):
                self.of(wid).trusted = False
            case M.RangeTimed(wid, start, end, seconds):
                self.range_timed(wid, start, end, seconds)
            case M.Uploaded(wid, nbytes, seconds, round_trip):
                self.uploaded(wid, nbytes, seconds, round_trip)
            case M.HeartbeatRtt(wid, rtt):
                self.heartbeat(wid, rtt)
            case M.PeerLink(src, dst, rtt, bandwidth):
                self.peer_measured(src, dst, rtt, bandwidth)
            case M.StageStep(wid, start, end, compute_s, batch):
                self.step(wid, start, end, compute_s, batch)
            case M.StepObserved(stages, wall_s, timings):
                self.step_observed(list(stages), wall_s, list(timings))
            case M.RowsTimed(wid, start, end, rows, single_s, batched_s):
                self.rows_timed(wid, start, end, rows, single_s, batched_s)

    def snapshot(self) -> dict:
        """Everything measured, as plain values (equal snapshots: equal profiles)."""
        def device(m: DeviceMeasurements) -> tuple:
            medians = lambda d: {k: tuple(v.values) for k, v in d.items()}  # noqa: E731
            return (m.speed, m.overhead_s, m.calibrated, tuple(m.rtt.values), m.bandwidth_bytes_per_s, medians(m.stage_times),
                    medians(m.batched_times), dict(m.anchors), m.trusted, m.row_speed)
        return {"devices": {w: device(m) for w, m in self.devices.items()}, "known": {k: device(m) for k, m in self.known.items()},
                "lives": {n: (l.alive_s, l.failures, l.joined_at) for n, l in self.lives.items()}, "peer_links": dict(self.peer_links),
                "hop_excess": tuple(self.hop_excess.values)}

    # -- lives ----------------------------------------------------------------------------------
    def joined(self, name: str, now: float) -> None:
        self.lives.setdefault(name, DeviceLives()).joined_at = now

    def left(self, name: str, now: float, failure: bool = True) -> None:
        """It left: a failure, unless it said it was shutting down for good (a final bye)."""
        life = self.lives.setdefault(name, DeviceLives())
        if life.joined_at is not None:
            life.alive_s += max(0.0, now - life.joined_at)
        life.joined_at = None
        life.failures += int(failure)

    def failure_rate(self, name: str, now: float) -> float:
        life = self.lives.get(name)
        if life is None:
            return 0.0
        current = now - life.joined_at if life.joined_at is not None else 0.0
        return failure_rate(life.failures, life.alive_s + current)

    def unit_cost(self, start: int, end: int) -> float:
        return sum(u.cost_s for u in self.manifest.units[start:end])

    # -- measurements in ------------------------------------------------------------------------
    def calibrated(self, worker_id: str, samples: list[tuple[float, float]]) -> None:
        fit = fit_speed_overhead(samples, warmup=0)
        m = self.of(worker_id)
        m.speed, m.overhead_s, m.calibrated = max(fit.speed, 1e-6), max(fit.overhead_s, 0.0), True

    def calibrated_by_ratio(self, worker_id: str, samples: list[tuple[float, float]]) -> None:
        m = self.of(worker_id)
        total_cost, total_s = sum(c for c, _ in samples), sum(t for _, t in samples)
        m.speed, m.overhead_s, m.calibrated = (total_cost / total_s if total_s > 0 else 1.0), 0.0, True

    def rows_timed(self, worker_id: str, start: int, end: int, rows: int, single_s: float, batched_s: float) -> None:
        """Steps of ``[start, end)`` took ``single_s`` at 1 row and ``batched_s`` at ``rows``: each
        further row costs ``(batched_s - single_s) / (rows - 1)``, its ``row_speed`` the range's cost
        over that. A batched step no slower than a single one (memory-bound, or noise) is priced
        at ``ROW_FLOOR`` of a single step per row, so rows are never free. On MoE layers the
        further experts the batch reads (``plan.moe``, priced by the planner on their own) are
        taken off first, so they are not counted twice."""
        cost = self.unit_cost(start, end)
        if rows < 2 or cost <= 0 or single_s <= 0 or batched_s <= 0:
            return
        experts_s = 0.0
        if any(u.experts for u in self.manifest.units[start:end]):
            from ...plan.moe import range_extra_cost

            experts_s = range_extra_cost(self.model_profile(), start, end, rows) / self.of(worker_id).speed
        per_row = max((batched_s - single_s - experts_s) / (rows - 1), ROW_FLOOR * single_s)
        self.of(worker_id).row_speed = cost / per_row

    def heartbeat(self, worker_id: str, rtt_s: float) -> None:
        m = self.of(worker_id)
        m.rtt = m.rtt.push(rtt_s)

    def uploaded(self, worker_id: str, nbytes: int, seconds: float, round_trip: float | None = None) -> None:
        """``nbytes`` more took ``seconds`` more to arrive (difference of two probe sizes)."""
        m = self.of(worker_id)
        m.bandwidth_bytes_per_s = nbytes / seconds
        if round_trip is not None:
            m.rtt = m.rtt.push(round_trip)

    def range_timed(self, worker_id: str, start: int, end: int, seconds: float) -> None:
        """A decode step of the range ``[start, end)`` it will run took ``seconds``: its speed from that."""
        m = self.of(worker_id)
        cost = self.unit_cost(start, end)
        if cost > 0 and seconds > m.overhead_s:
            m.speed = cost / (seconds - m.overhead_s)

    def step_observed(self, stages: list[tuple[str, int, int]], wall_s: float, timings: list) -> None:
        """A single-sequence decode step took ``wall_s`` at the coordinator, ``timings`` (one
        ``[worker, compute_s, positions, ...]`` per stage) of it computing: the rest, beyond
        what the links predict (``RTT/2 + bytes/bandwidth`` per hop), is learnt as a per-hop
        excess (frame handling, event loops, the coordinator's own step) that every hop is then
        priced with (``network_profile``)."""
        if len(timings) != len(stages) or any(e[2] != 1 or (len(e) > 4 and e[4] != 1) for e in timings):
            return
        ids = [w for w, _, _ in stages]
        network = self.network_profile([SimpleNamespace(id=w) for w in ids], learnt=False)
        token = 4
        hops = [network.hop_s(COORDINATOR, ids[0], token), network.hop_s(ids[-1], COORDINATOR, token)]
        hops += [network.hop_s(a, b, self.manifest.units[end - 1].out_bytes_per_token) for (a, _, end), (b, _, _) in zip(stages, stages[1:])]
        self.hop_excess = self.hop_excess.push((wall_s - sum(e[1] for e in timings) - sum(hops)) / len(hops))

    def peer_measured(self, src: str, dst: str, rtt_s: float, bandwidth_bytes_per_s: float) -> None:
        """``src`` measured its data-port path to ``dst``: priced from now on instead of the star guess."""
        self.peer_links[(src, dst)] = (rtt_s, bandwidth_bytes_per_s)

    def step(self, worker_id: str, start: int, end: int, compute_s: float, batch: int = 1) -> None:
        """A decode step's compute time on a stage: refines the device's speed.

        A single-sequence step gives the speed directly. A batched step (the norm under load)
        is compared with the first median seen for the same range and batch size: the speed
        moves by the same ratio, so drift is still seen when every step is batched."""
        m = self.of(worker_id)
        if not m.trusted:
            return
        single = batch == 1
        key = (start, end) if single else (start, end, batch)
        times = m.stage_times if single else m.batched_times
        times[key] = times.get(key, RollingMedian(self.window)).push(compute_s)
        median = times[key].median
        # Stages of a millisecond or less are mostly per-call overhead: they would make the
        # device look several times slower than it is, so they do not update its speed.
        if len(times[key].values) < 4 or median <= max(3 * m.overhead_s, 1e-3):
            return
        if single:
            m.speed = self.unit_cost(start, end) / (median - m.overhead_s)
            m.anchors.clear()  # batched medians are judged against this speed from now on
            return
        anchor = m.anchors.setdefault(key, (median, m.speed))
        m.speed = anchor[1] * anchor[0] / median

    # -- profiles out ---------------------------------------------------------------------------
    def model_profile(self, precision: str | None = None, context_tokens: int | None = None, kv_form: str | None = None,
                      forms=()) -> ModelProfile:
        """``context_tokens``: KV positions to plan per sequence (default: the full context);
        ``kv_form``: the form whose KV is counted (default: ``precision``'s); ``forms``: the
        forms the devices run (``device_profiles``' ``forms``), each priced with its own weight
        and KV bytes (a form the package does not hold yet is priced as the profile's own)."""
        m = self.manifest
        devices_forms = sorted({f for f in forms if f})
        # Cached: the answer depends on the manifest and the arguments only, and costs ~1-7 ms
        # (a UnitProfile per unit, fp32 sizes estimated from the config), asked for by every plan,
        # status view and (MoE) step timing. A built variant comes as a new manifest (``Variants``
        # reloads the package), and which variants each unit holds is in the key besides, so a
        # unit built in place is reflected too.
        if self._profiles_of is not m:
            self._profiles, self._profiles_of = {}, m
        key = (precision, context_tokens or self.context_tokens, kv_form, tuple(devices_forms),
               tuple(tuple(getattr(u, "variants", ())) for u in m.units))
        if key not in self._profiles:
            if len(self._profiles) >= 64:  # bounded: a long run asking for many context sizes
                self._profiles.clear()
            self._profiles[key] = self._model_profile(precision, context_tokens, kv_form, devices_forms)
        return self._profiles[key]

    def _model_profile(self, precision, context_tokens, kv_form, devices_forms) -> ModelProfile:
        m = self.manifest
        kv_form = kv_form or precision
        units = tuple(UnitProfile(u.index, u.name, u.cost_s, m.variant(u.index, precision).weight_bytes, m.kv_bytes_per_token(u.index, kv_form),
                                  u.out_bytes_per_token, u.kv_window, experts=u.experts, experts_used=u.experts_used,
                                  expert_bytes=m.variant(u.index, precision).expert_bytes) for u in m.units)
        from .variant_rules import unit_sizes

        # Per form: each device is priced in the form it runs (``forms``), and a tab in the variant
        # it asks for (fp32), as built or else as estimated (``variants.unit_sizes``), units not
        # built yet included, so what it may be given is bounded by its memory.
        names = sorted({p for u in m.units for p in getattr(u, "variants", ())} | {"fp32"} | set(devices_forms))
        weights = {name: unit_sizes(m, name) for name in names}
        kv = {form: tuple(m.kv_bytes_per_token(u.index, form) for u in m.units) for form in devices_forms}
        return ModelProfile(m.name, units, context_tokens or self.context_tokens, runtime_overhead_bytes=RUNTIME_OVERHEAD_BYTES,
                            variant_weight_bytes=weights, variant_kv_bytes=kv)

    def device_profiles(self, workers, forms=None) -> list[DeviceProfile]:
        """The planner's devices; ``forms`` (worker id -> the form it is sent) sizes each with its own."""
        out = []
        for w in sorted(workers, key=lambda w: w.id):
            m = self.of(w.id)
            out.append(DeviceProfile(
                id=w.id, memory_bytes=self._plannable_memory(w), speed=m.speed, overhead_s=m.overhead_s,
                power_busy_w=_declared(w.hello.power_busy_w, DEFAULT_POWER_BUSY_W),
                power_idle_w=_declared(w.hello.power_idle_w, DEFAULT_POWER_IDLE_W),
                held_units=frozenset(self._held_units(w)), relay=w.relay, emulated=w.hello.emulated,
                kind=w.hello.device or "cpu", adapter=w.hello.adapter, row_speed=m.row_speed,
                precision=(forms or {}).get(w.id) or w.hello.precision,  # the form it is sent (a tab: the variant it asks for)
            ))
        return out

    def _plannable_memory(self, w) -> int:
        """Its declared memory; for a worker of a variant built as its stages need it (a tab's fp32),
        no more than the weights that variant may hold within the disk budget (those built, plus
        what the budget has left) with the KV and overhead of a stage beside them, so that no
        plan is made whose build would be refused (``variants.budget_problem``)."""
        from .variant_rules import added_bytes, own_forms

        precision = w.hello.precision
        if self.variant_disk_bytes is None or not precision or precision in own_forms(self.manifest):
            return w.memory_bytes
        m = self.manifest
        built = sum(m.variant(u.index, precision).weight_bytes for u in m.units if precision in u.variants)
        room = built + max(0, self.variant_disk_bytes - added_bytes(m))
        kv = self.context_tokens * sum(m.kv_bytes_per_token(u.index, precision) for u in m.units)
        return min(w.memory_bytes, room + kv + RUNTIME_OVERHEAD_BYTES)

    def _held_units(self, w) -> set[int]:
        held = set(w.hello.held)
        if not held:
            return set()
        precision = worker_variant(w.hello, self.manifest, None) or self.manifest.precision  # the variant this worker runs
        return {u.index for u in self.manifest.units
                if precision in u.variants and all(f in held for f in self.manifest.variant(u.index, precision).files)}

    def link_of(self, worker_id: str) -> tuple[float, float]:
        """(idle RTT, uplink bandwidth). The RTT is the window's minimum: heartbeats answered
        while the worker builds a session or sends a probe are late for reasons a hop is not."""
        m = self.of(worker_id)
        return (min(m.rtt.values) if m.rtt.values else DEFAULT_LINK.rtt_s, m.bandwidth_bytes_per_s or LOOPBACK_BANDWIDTH)

    def network_profile(self, workers, learnt: bool = True) -> NetworkProfile:
        """Coordinator links from heartbeats and uplink probes, worker-to-worker links as
        measured (else the star guess); the coordinator's link shared when it relays; every
        hop slower by the excess decode steps showed (``step_observed``) unless ``learnt`` is False."""
        workers = list(workers)
        uplinks = {w.id: self.link_of(w.id) for w in workers}
        ids = set(uplinks)
        measured = {p: v for p, v in self.peer_links.items() if p[0] in ids and p[1] in ids}
        relays = any(getattr(w, "relay", False) for w in workers)
        network = NetworkProfile(link_matrix(uplinks, measured), shared=frozenset({COORDINATOR}) if relays else frozenset())
        excess = self.hop_excess.median
        return network.with_hop_excess(excess) if learnt and excess is not None else network


def _declared(value, default: float) -> float:
    """A declared figure, 0 included; the default only when nothing was declared."""
    return default if value is None else float(value)
