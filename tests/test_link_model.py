"""The cost model's network side, as plain functions: the link matrix the coordinator builds
from measured worker-to-worker links, shared-link contention (seed 002) priced alike by
`evaluate` and the independent brute force, and the worker's probe arithmetic."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.worker.links import peer_link
from edgepipe.plan import COORDINATOR, DeviceProfile, LinkProfile, NetworkProfile, PlanRequest, Stage, evaluate
from edgepipe.plan.brute import layouts, price
from edgepipe.plan.profiles import link_matrix
from test_plan_search import random_instance

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

MB = 1 << 20


def test_link_matrix_prefers_measured_pairs_and_falls_back_to_the_star():
    uplinks = {"a": (0.010, 1e6), "b": (0.002, 5e6), "c": (0.004, 2e6)}
    measured = {("a", "b"): (0.001, 9e6), ("b", "c"): (0.003, 4e5), ("c", "b"): (0.005, 3e5)}
    net = NetworkProfile(link_matrix(uplinks, measured))
    # measured one way: that figure both ways
    assert (net.link("a", "b").rtt_s, net.link("a", "b").bandwidth_bytes_per_s) == (0.001, 9e6)
    assert (net.link("b", "a").rtt_s, net.link("b", "a").bandwidth_bytes_per_s) == (0.001, 9e6)
    # measured both ways: each its own
    assert net.link("b", "c").bandwidth_bytes_per_s == 4e5 and net.link("c", "b").bandwidth_bytes_per_s == 3e5
    # nobody measured a-c: the path through both access links
    assert (net.link("a", "c").rtt_s, net.link("a", "c").bandwidth_bytes_per_s) == (0.010, 1e6)
    assert (net.link("c", COORDINATOR).rtt_s, net.link(COORDINATOR, "c").bandwidth_bytes_per_s) == (0.004, 2e6)
    # deterministic: the same inputs in another order give the same profile
    again = link_matrix(dict(reversed(list(uplinks.items()))), dict(reversed(list(measured.items()))))
    assert again == net.links


def test_cluster_profile_prices_a_measured_neighbour_link():
    prof = ClusterProfile(SimpleNamespace(max_context=2048, units=[], name="m"))
    workers = [SimpleNamespace(id=w) for w in ("w1", "w2", "w3")]
    for wid, bw in (("w1", 1e7), ("w2", 1e7), ("w3", 2e5)):
        prof.heartbeat(wid, 0.002)
        prof.uploaded(wid, 1 << 18, (1 << 18) / bw)
    blind = prof.network_profile(workers)
    assert blind.link("w1", "w2").bandwidth_bytes_per_s == pytest.approx(1e7)
    prof.peer_measured("w1", "w2", 0.030, 5e5)  # shaped between the two, not towards the coordinator
    net = prof.network_profile(workers)
    assert (net.link("w1", "w2").rtt_s, net.link("w2", "w1").bandwidth_bytes_per_s) == (0.030, 5e5)
    assert net.link("w1", "w3").bandwidth_bytes_per_s == pytest.approx(2e5)
    assert net.link("w1", COORDINATOR).bandwidth_bytes_per_s == pytest.approx(1e7)
    prof.forget("w2")  # it left: its measured links go with it
    assert ("w1", "w2") not in prof.peer_links


def test_peer_link_arithmetic():
    # 5 pings (least 4 ms), a 16 KiB transfer in 20 ms and a 256 KiB one in 260 ms: 1 MiB/s
    rtt, bw = peer_link([0.006, 0.004, 0.005, 0.009, 0.0041], 16 << 10, 0.020, 256 << 10, 0.260)
    assert rtt == 0.004 and bw == pytest.approx((240 << 10) / 0.240)
    # timings that give no positive difference (loopback noise): the large transfer alone bounds it
    rtt, bw = peer_link([0.001], 16 << 10, 0.003, 256 << 10, 0.0029)
    assert bw == pytest.approx((256 << 10) / 0.0029)
    with pytest.raises(ValueError):
        peer_link([], 1, 1.0, 2, 2.0)


def two_device_case(shared: frozenset[str]):
    from edgepipe.plan import transformer_profile

    model = transformer_profile("m", 4, layer_cost=0.001, layer_bytes=MB, kv_bytes_per_token=64, hidden_bytes=4000,
                                context_tokens=64)
    devices = {d.id: d for d in (DeviceProfile("a", 100 * MB, 1.0, 0.0), DeviceProfile("b", 100 * MB, 1.0, 0.0))}
    links = (LinkProfile("a", COORDINATOR, 0.0, 1e6), LinkProfile("b", COORDINATOR, 0.0, 1e6), LinkProfile("a", "b", 0.0, 1e5))
    return model, devices, NetworkProfile(links, shared=shared)


def test_a_shared_link_is_priced_with_everything_it_carries():
    """Device a receives the token (4 B from the coordinator, 1e6 B/s) and sends 4,000 B to b
    (1e5 B/s); b sends the token home. Stage times 3 ms and 2 ms, the a->b hop 40 ms."""
    stages = (Stage(("a",), 0, 3), Stage(("b",), 3, 6))
    for shared, busiest in ((frozenset(), 0.040), (frozenset({"a"}), 0.040 + 4e-6), (frozenset({"b"}), 0.040 + 4e-6),
                            (frozenset({COORDINATOR}), 8e-6)):
        model, devices, network = two_device_case(shared)
        one = evaluate(stages, model, devices, network, PlanRequest(sequences=1))
        many = evaluate(stages, model, devices, network, PlanRequest(objective="throughput", sequences=8))
        assert one.tpot_s == one.ring_s  # one sequence: the links are never used at once
        assert many.bottleneck_s == pytest.approx(max(0.040, busiest), rel=1e-12)
        assert many.tpot_s == pytest.approx(max(many.ring_s, 8 * max(0.040, busiest)), rel=1e-12)


def test_a_browser_relay_shares_the_coordinator_link():
    """b is a browser: a->b goes a->coordinator->b, so the coordinator's link carries the
    token out, both legs of the activation, and the token home."""
    model, devices, _ = two_device_case(frozenset())
    devices = {**devices, "b": replace(devices["b"], relay=True)}
    links = (LinkProfile("a", COORDINATOR, 0.0, 1e4), LinkProfile("b", COORDINATOR, 0.0, 2e4))
    stages = (Stage(("a",), 0, 3), Stage(("b",), 3, 6))
    free = evaluate(stages, model, devices, NetworkProfile(links), PlanRequest(objective="throughput", sequences=8))
    shared = evaluate(stages, model, devices, NetworkProfile(links, shared={COORDINATOR}),
                      PlanRequest(objective="throughput", sequences=8))
    legs = 4 / 1e4 + 4000 / 1e4 + 4000 / 2e4 + 4 / 2e4
    assert free.bottleneck_s == pytest.approx(4000 / 1e4 + 4000 / 2e4)  # the relayed hop, both legs
    assert shared.bottleneck_s == pytest.approx(legs, rel=1e-12)
    assert shared.throughput_tok_s < free.throughput_tok_s


@pytest.mark.parametrize("seed", range(12))
def test_contention_equals_the_brute_force_arithmetic(seed):
    """Random pools with shared nodes, relays, replicas and several sequences: `evaluate` and
    `brute.price` (written separately) agree on every fitting layout."""
    rng = random.Random(9100 + seed)
    model, devices, network = random_instance(rng, 3, rng.choice([4, 5]))
    nodes = [d.id for d in devices] + [COORDINATOR]
    shared = frozenset(rng.sample(nodes, rng.randint(1, len(nodes))))
    devices = [replace(d, relay=rng.random() < 0.3, activation_dtype=rng.choice(["float32", "float16"]), memory_bytes=1 << 40)
               for d in devices]
    slow = tuple(replace(x, bandwidth_bytes_per_s=x.bandwidth_bytes_per_s / 100) for x in network.links)  # hops matter
    network = NetworkProfile(slow, network.default, shared)
    by_id = {d.id: d for d in devices}
    sequences = rng.choice([1, 2, 4, 4])
    checked = bound = 0
    every = list(layouts(model, list(by_id), sequences, max_group=2))
    for layout in rng.sample(every, min(300, len(every))):
        priced = price(layout, model, by_id, network, sequences)
        if priced is None:
            continue
        stages = tuple(Stage(ids, s, e) for ids, s, e in layout)
        pred = evaluate(stages, model, by_id, network, PlanRequest(sequences=sequences))
        assert pred.tpot_s == pytest.approx(priced.tpot_s, rel=1e-12), layout
        assert pred.energy_j_per_token == pytest.approx(priced.energy_j, rel=1e-12), layout
        free = price(layout, model, by_id, NetworkProfile(slow, network.default), sequences)
        bound += pred.tpot_s > free.tpot_s * (1 + 1e-9)
        checked += 1
    assert checked > 0
    CONTENDED.append(bound)


CONTENDED: list[int] = []


def test_contention_was_exercised():
    """The random cases above are not vacuous: in some plans a shared link is the bottleneck."""
    if not CONTENDED:
        pytest.skip("run with the random cases")
    assert sum(CONTENDED) > 0


def test_hops_learn_what_decode_steps_took_beyond_the_link_model():
    """Steps that took 3 ms more than compute + links, over 2 stages (3 hops): every hop is
    priced 1 ms slower from then on (RTT + 2 ms), measured pairs included."""
    units = [SimpleNamespace(out_bytes_per_token=2304, cost_s=0.001) for _ in range(4)]
    prof = ClusterProfile(SimpleNamespace(max_context=2048, units=units, name="m"))
    for wid in ("w1", "w2"):
        prof.heartbeat(wid, 0.002)
        prof.uploaded(wid, 1 << 20, (1 << 20) / 1e7)
    prof.peer_measured("w1", "w2", 0.004, 1e7)
    workers = [SimpleNamespace(id="w1"), SimpleNamespace(id="w2")]
    plain = prof.network_profile(workers)
    stages = [("w1", 0, 2), ("w2", 2, 4)]
    links = 0.001 + 4 / 1e7 + 0.002 + 2304 / 1e7 + 0.001 + 4 / 1e7
    prof.step_observed(stages, 0.010 + 0.005 + links + 0.003, [["w1", 0.010, 1, 4, 1], ["w2", 0.005, 1, 4, 1]])
    prof.step_observed(stages, 0.5, [["w1", 0.010, 8, 4, 1], ["w2", 0.005, 8, 4, 1]])  # a prefill: not a decode step
    learnt = prof.network_profile(workers)
    assert prof.hop_excess.median == pytest.approx(0.001)
    assert learnt.link("w1", "w2").rtt_s == pytest.approx(plain.link("w1", "w2").rtt_s + 0.002)
    assert learnt.hop_s(COORDINATOR, "w1", 4) == pytest.approx(plain.hop_s(COORDINATOR, "w1", 4) + 0.001)
    assert NetworkProfile().with_hop_excess(-1.0) == NetworkProfile()
