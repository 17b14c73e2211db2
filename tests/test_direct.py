"""The direct token path (``cluster.direct``): a plan's last stage feeds its sampled token into the
next step itself (a one-stage plan's stage into its own queue, a plan of several stages' last stage
to the first stage over the data path), the coordinator still takes every token in order and decides the rest.

Pure: the one decision (``direct.grant``), the worker's rule and frames (``worker.core``), who may
feed a first stage (``core.admit_feed``, ``dataport.feed_problem``), the LOAD fields that name the
two ends (``deploy.feed_fields``), the coordinator's book of steps fed (``step_path``). Simulation:
the real worker shell and coordinator on a virtual clock, on one, two and three stages, with the
fed next step lost (its token reached the coordinator only) and the copy of a fed token lost (it
reached the next step only). Real processes (slow): ``serve`` with one, two and three workers gives
``generate``'s greedy tokens exactly, and a seeded sampled request's tokens with the direct path on and off.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgepipe.cluster.rules import core, direct, kv_moves, step_path
from edgepipe.cluster.simulation import sim
from edgepipe.cluster.state import batching, step_book as SB
from edgepipe.cluster.state.batching import LaneItem
from edgepipe.cluster.rules.profiling import RUNTIME_OVERHEAD_BYTES
from edgepipe.cluster.state.settings import CoordinatorSettings
from edgepipe.cluster.simulation.simrun import Fault, Req, Schedule, run
from edgepipe.cluster.state.state import ClusterState, apply
from edgepipe.net.messages import Forward, Token
from edgepipe.worker import core as wcore

ASK = direct.Ask(limit=8, head=frozenset(), stages=1, replicated=False, speculative=False, checkpoints=False, others=0,
                 left=100)


# -- the decision ---------------------------------------------------------------------------------
@pytest.mark.pure
def test_a_greedy_sequence_alone_on_a_one_stage_plan_goes_direct_up_to_its_last_step():
    assert direct.grant(ASK) == 8
    assert direct.grant(dataclasses.replace(ASK, left=3)) == 3  # never past max tokens or the context
    assert direct.grant(dataclasses.replace(ASK, left=0)) == 0
    assert direct.grant(dataclasses.replace(ASK, head=frozenset({"logprobs", "top"}))) == 8  # the same fields at every step


@pytest.mark.pure
@pytest.mark.parametrize("change", [
    dict(limit=0),  # serve --direct-steps 0
    dict(head=frozenset({"mask"})),  # structured output: a mask per step
    dict(head=frozenset({"adjust_ids", "adjust"})),  # penalties change with the tokens
    dict(head=frozenset({"repeat_ids", "repeat_penalty"})),
    dict(replicated=True), dict(speculative=True), dict(checkpoints=True),
    dict(others=1),  # a lane of several sequences is re-formed by the coordinator at each departure
])
def test_what_needs_the_coordinator_each_step_stays_on_todays_path(change):
    assert direct.grant(dataclasses.replace(ASK, **change)) == 0


@pytest.mark.pure
@pytest.mark.parametrize("extra, goes", [
    ({}, True),  # every API's default sampling: its head fields are the request's, the draw rides along
    (dict(logprobs=True, top_logprobs=2), True),
    (dict(presence_penalty=0.5), False), (dict(frequency_penalty=0.5), False), (dict(logit_bias=((3, 1.0),)), False),
    (dict(repeat_penalty=1.1), False),
])
def test_a_sampled_sequence_goes_direct_unless_its_head_fields_change_or_need_the_coordinator(extra, goes):
    from edgepipe.runtime import controls
    from edgepipe.runtime.sequence import GenerationParams, SequenceState

    params = GenerationParams(max_tokens=50, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7, **extra)
    state = SequenceState([1, 5, 9], params, str, (2,), generated=[4, 4])
    head = controls.step_fields(state, 32, False)
    assert (direct.grant(dataclasses.replace(ASK, head=frozenset(head))) == 8) is goes


@pytest.mark.pure
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_a_sequence_alone_on_a_plan_of_several_stages_goes_direct_too(stages):
    """Its last stage feeds the plan's first stage (``Load.first``): no hop through the coordinator."""
    assert direct.grant(dataclasses.replace(ASK, stages=stages)) == 8
    assert direct.grant(dataclasses.replace(ASK, stages=stages, head=frozenset({"mask"}))) == 0


@pytest.mark.pure
def test_stop_ids_are_the_end_of_sequence_unless_ignored():
    assert direct.stop_ids(False, (7, 2)) == [2, 7]
    assert direct.stop_ids(True, (7, 2)) == []


# -- the worker's rule and frames ------------------------------------------------------------------
def _item(**extra) -> dict:
    return {"seq": "r1.0", "step": 4, "rid": "r1", "pos": 10, "sampling": {"do_sample": False}, "ahead": 3, "stop": [2], **extra}


@pytest.mark.pure
def test_a_stage_feeds_the_next_step_only_where_the_coordinator_allowed_it():
    assert wcore.feeds_next(_item(), 5)
    assert not wcore.feeds_next(_item(), 2)  # an end of sequence: the coordinator stops there
    assert not wcore.feeds_next(_item(ahead=0), 5)
    assert not wcore.feeds_next({k: v for k, v in _item().items() if k != "ahead"}, 5)  # today's frames
    assert not wcore.feeds_next(_item(sampling={"do_sample": True}), 5)
    assert not wcore.feeds_next(_item(verify=True), 5)
    assert not wcore.feeds_next(_item(partial=True), 5)
    assert not wcore.feeds_next({k: v for k, v in _item().items() if k != "pos"}, 5)


@pytest.mark.pure
def test_a_fed_sampled_step_samples_with_the_draw_the_coordinator_would_have_sent():
    from edgepipe.runtime import controls
    from edgepipe.runtime.sequence import GenerationParams

    params = GenerationParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
    item = _item(sampling=controls.wire_sampling(params, 4), uniforms=controls.fed_uniforms(params, 4, 3))
    assert not wcore.feeds_next({k: v for k, v in item.items() if k != "uniforms"}, 5)  # no draws: today's path
    assert not wcore.feeds_next({**item, "uniforms": item["uniforms"][:2]}, 5)  # fewer draws than steps
    for step in (5, 6, 7):  # each step the stage feeds itself, as the coordinator would have sent it
        assert wcore.feeds_next(item, 5)
        item = wcore.next_forward(1, [item], [5], [True]).batch[0]
        assert item["step"] == step and item["sampling"] == controls.wire_sampling(params, step)
    assert item["ahead"] == 0 and item["uniforms"] == [] and not wcore.feeds_next(item, 5)


@pytest.mark.pure
def test_the_fed_frame_is_one_step_and_one_position_on_in_the_lanes_order():
    batch = [_item(seq="a", prefix={"epoch": 1}), _item(seq="b"), _item(seq="c", rewind=True)]
    msg = wcore.next_forward(1, batch, [5, 6, 7], [True, False, True])
    assert [i["seq"] for i in msg.batch] == ["a", "c"] and msg.x.tolist() == [[5], [7]]
    assert all(i["step"] == 5 and i["pos"] == 11 and i["ahead"] == 2 and i["direct"] for i in msg.batch)
    assert not any("prefix" in i or "rewind" in i for i in msg.batch)


@pytest.mark.pure
def test_the_stages_own_steps_of_a_dropped_sequence_are_skipped():
    stage = wcore.Stage(1, 0, 4, "g", None, 0)
    session = wcore.Session("g", True, True, 0, (0, 1))
    state = dataclasses.replace(wcore.WorkerState("w", None, None), stages={1: stage}, sessions={"g": session}, held={"g": {"a": 11}})
    mine = Forward(1, [{**_item(seq="a"), "direct": True}, {**_item(seq="b"), "direct": True}], tensors={"x": np.array([[5], [6]])})
    kept = wcore.without_dropped(state, mine)
    assert [i["seq"] for i in kept.batch] == ["a"] and kept.x.tolist() == [[5]]
    assert wcore.without_dropped(state, Forward(1, [mine.batch[1]], tensors={"x": np.array([[6]])})) is None
    theirs = Forward(1, [_item(seq="b")], tensors={"x": np.array([[6]])})  # the coordinator's frame: checked as always
    assert wcore.without_dropped(state, theirs) is theirs
    # a stage without decoder layers (a head alone) holds no KV to tell by: a stage with layers skips them
    headless = dataclasses.replace(state, sessions={"g": dataclasses.replace(session, layers=())}, held={})
    assert wcore.without_dropped(headless, mine) is mine


# -- a plan of several stages: the last stage feeds the first ------------------------------------
def _hello(name: str, relay: bool = False):
    from edgepipe.net.messages import Hello

    return Hello(name=name, token=None, protocol=1, kind="browser" if relay else "native", memory_bytes=1 << 30, threads=2,
                 data_url=None if relay else f"ws://{name}:1", held=())


@pytest.mark.pure
def test_a_plans_last_stage_is_loaded_with_its_first_stage_and_the_first_with_the_one_peer_it_takes_token_ids_from():
    from edgepipe.cluster.rules import deploy
    from edgepipe.cluster.state import state as S
    from edgepipe.cluster.state.placement import StageAssignment as A

    workers = {w: S.WorkerInfo(w, w, _hello(w), 0.0, 0.0) for w in "abc"}
    three = (A("a", 0, 3), A("b", 3, 6), A("c", 6, 8))
    assert [deploy.feed_fields(three, i, workers, "f") for i in range(3)] == [
        {"fed_by": "c", "feed_secret": "f"}, {}, {"first": {"kind": "worker", "id": "a", "url": "ws://a:1", "relay": False, "secret": "f"}}]
    assert deploy.feed_fields(three, 0, workers) == {"fed_by": "c"}  # secrets derived from the join token, or an open cluster
    assert deploy.feed_fields((A("a", 0, 8),), 0, workers, "f") == {}  # one stage: it feeds itself
    assert deploy.feed_fields((A("a", 0, 3), A("b", 3, 8), A("c", 3, 8)), 2, workers, "f") == {}  # replicas: the coordinator routes
    for w in "ab":  # a browser tab's stage, first (no data port to feed) or in the middle (no book of dropped sequences)
        tab = {**workers, w: S.WorkerInfo(w, w, _hello(w, relay=True), 0.0, 0.0)}
        assert tab[w].relay and [deploy.feed_fields(three, i, tab, "f") for i in range(3)] == [{}, {}, {}]


def _fed_state(**stage) -> wcore.WorkerState:
    first = wcore.Stage(1, 0, 3, "g", None, 0, secret="k", **stage)
    return dataclasses.replace(wcore.WorkerState("w", None, None), stages={1: first}, sessions={"g": wcore.Session("g", True, False, 0, (0,))})


@pytest.mark.pure
def test_the_first_stage_takes_a_feed_only_from_the_peer_its_load_named_with_its_feed_secret():
    fed = _fed_state(fed_by="c", feed_secret="f")
    assert wcore.admit_data(fed, 1, lambda s: s == "f") == fed.stages[1].frame_limit  # the feed connection is admitted...
    assert wcore.admit_feed(fed, 1, lambda s: s == "f")  # ...as the last stage's
    assert not wcore.admit_feed(fed, 1, lambda s: s == "k")  # the stage's own secret (a KV mover holds it too) feeds nothing
    assert not wcore.admit_feed(fed, 2, lambda s: True)
    assert not wcore.admit_feed(_fed_state(), 1, lambda s: True)  # closed by default: no peer named, no feed
    assert wcore.admit_feed(_fed_state(fed_by="c"), 1, lambda s: s is None)  # an open cluster: named, nothing to present


@pytest.mark.pure
def test_token_ids_reach_a_data_port_only_on_the_feed_connection_and_it_carries_nothing_else():
    from edgepipe.worker.dataport import feed_problem

    step = Forward(1, [{**_item(), "direct": True}], tensors={"x": np.array([[5]], np.int64)})
    activations = Forward(1, [{**_item(), "direct": True}], tensors={"x": np.zeros((1, 1, 4), np.float32)})
    assert feed_problem(step, feed=True) is None and feed_problem(activations, feed=False) is None
    assert "only from the plan's last stage" in feed_problem(step, feed=False)
    assert feed_problem(activations, feed=True) and feed_problem(Forward(1, [_item()], tensors={"x": np.array([[5]])}), feed=True)
    assert feed_problem(Forward(1, [{**_item(), "direct": True}], tensors={"x": np.array([[5, 6]])}), feed=True)  # a step is one id


@pytest.mark.pure
def test_a_refused_token_id_frame_gets_a_clear_error_and_is_not_computed():
    import asyncio

    from edgepipe.net.channel import ChannelClosed
    from edgepipe.net.protocol import decode, encode
    from edgepipe.worker.dataport import data_loop

    class Channel:
        peer = "x"

        def __init__(self, frames):
            self.frames, self.sent, self.closed = list(frames), [], False

        async def recv(self):
            if not self.frames:
                raise ChannelClosed("end")
            return self.frames.pop(0)

        async def send(self, frame):
            self.sent.append(frame)

        async def close(self, reason=""):
            self.closed = True

    step = encode(Forward(1, [{**_item(), "direct": True}], tensors={"x": np.array([[5]], np.int64)}).to_message())
    for feed, taken in ((False, 0), (True, 1)):
        channel, got = Channel([step]), []

        async def receive(typed):
            got.append(typed)

        asyncio.run(data_loop(channel, 1, receive, feed))
        assert len(got) == taken and channel.closed is not feed
        if not feed:
            assert "only from the plan's last stage" in decode(channel.sent[0])["message"]


@pytest.mark.pure
def test_the_last_stage_of_several_feeds_the_first_stage_and_still_sends_the_coordinator_its_copy():
    from edgepipe.net.messages import NextHop

    first = NextHop("worker", "a", "ws://a:1", secret="f")
    last = wcore.Stage(1, 3, 8, "h", NextHop("coordinator"), 0, first=first, first_secret="f")
    state = dataclasses.replace(wcore.WorkerState("c", None, None), stages={1: last}, sessions={"h": wcore.Session("h", False, True, 8, (3,))})
    msg = Forward(1, [_item()], tensors={"x": np.zeros((1, 1, 8), np.float32)})
    _, commands = wcore.handle(state, wcore.Computed(msg, np.array([5]), 0.01, None, 1, 0, {"r1.0": 11}))
    (feed,) = commands  # the copy rides on the feed: it goes after the send, unfed if the send fails
    assert isinstance(feed, wcore.FeedFirst) and (feed.url, feed.plan, feed.secret) == ("ws://a:1", 1, "f")
    assert feed.forward.x.tolist() == [[5]] and feed.forward.batch[0]["pos"] == 11 and feed.forward.batch[0]["direct"]
    assert feed.copy.to_message()["fed"] == [True] and feed.unfed().to_message()["fed"] == [False]
    assert feed.unfed().tokens == feed.copy.tokens == [5]
    alone = dataclasses.replace(state, stages={1: dataclasses.replace(last, first=None)})  # no first stage to feed (a relay)
    _, commands = wcore.handle(alone, wcore.Computed(msg, np.array([5]), 0.01, None, 1, 0, {"r1.0": 11}))
    assert [type(c) for c in commands] == [wcore.SendControl]


# -- the coordinator's book -----------------------------------------------------------------------
CONFIG = core.Config.of(CoordinatorSettings())


def _fold(state, given):
    handled = core.handle(state, given, CONFIG)
    for e in handled.events:  # the state handle returned is the events applied
        state = apply(state, e)
    assert state == handled.state
    return state, handled


def _token(step: int, token: int, fed: bool, plan: int = 1) -> Token:
    return Token(plan, [{"seq": "r1.0", "step": step, "ahead": 1}], [token], [["w1", 0.01, 1, 4, 1]], fed=[fed])


@pytest.mark.pure
def test_a_fed_token_that_comes_early_settles_its_step_when_it_is_asked_for():
    state = ClusterState()
    state, _ = _fold(state, core.StepAsked("r1.0", 4, 1, "r1", ("w1",), 0.0))
    first = state.steps.next_id - 1
    state, h = _fold(state, core.TokenHeard("w1", _token(4, 50, True), 0.1))
    assert [c.step_id for c in h.commands if isinstance(c, core.SettleStep)] == [first]
    assert SB.fed_by_stage(state.steps, "r1.0", 5, 1) and not SB.fed_by_stage(state.steps, "r1.0", 5, 2)
    state, h = _fold(state, core.TokenHeard("w1", _token(5, 51, False), 0.2))  # before the sequence asked for step 5
    assert not h.commands and 5 in state.steps.ahead["r1.0"].early
    asked = state.steps.next_id
    state, h = _fold(state, core.StepAsked("r1.0", 5, 1, "r1", ("w1",), 0.3))
    settled = [c for c in h.commands if isinstance(c, core.SettleStep)]
    assert [(c.step_id, c.result.token) for c in settled] == [(asked, 51)]
    assert not state.steps.inflight and "r1.0" not in state.steps.ahead  # its run ended: the next step goes out as today


@pytest.mark.pure
def test_a_step_that_goes_another_way_or_a_lost_plan_ends_the_stages_run():
    state = ClusterState()
    state, _ = _fold(state, core.StepAsked("r1.0", 4, 1, "r1", ("w1",), 0.0))
    state, _ = _fold(state, core.TokenHeard("w1", _token(4, 50, True), 0.1))
    replay, _ = _fold(state, core.StepAsked("r1.1", 0, 2, "r1", ("w2",), 0.2))  # a replay under a new epoch
    assert "r1.0" in replay.steps.ahead  # another sequence: the old one's run ends with its DROP
    other, _ = _fold(state, core.StepAsked("r1.0", 4, 1, "r1", ("w1",), 0.2))  # not the step the stage feeds
    assert "r1.0" not in other.steps.ahead
    lost, _ = _fold(state, core.StepsLost(1, "gone", 0.2))
    assert not lost.steps.ahead
    dropped, _ = _fold(state, core.DirectForgotten("r1.0"))
    assert not dropped.steps.ahead
    stray, h = _fold(dropped, core.TokenHeard("w1", _token(5, 51, True), 0.3))  # after the run ended: nobody keeps it
    assert not h.commands and not stray.steps.ahead


@pytest.mark.pure
@pytest.mark.parametrize("how", ["new plan", "lost plan"])
def test_a_step_asked_after_its_stages_run_ended_unseen_goes_out_at_once(how):
    """A fed token keeps its lane out (the stage runs the next step). When the next step is asked
    another way (here on a new plan after a KV move, or after the plan was lost), the lane comes
    back first: the step goes out at once, not after the step timeout (a worker killed and
    restarted mid-stream once waited 60 s here)."""
    state = ClusterState()
    state, _ = _fold(state, core.StepAsked("r1.0", 4, 1, "r1", ("w1",), 0.0))
    state, h = _fold(state, SB.LaneAsked(LaneItem("r1", 1, state.steps.next_id - 1), 1))
    assert [c for c in h.commands if isinstance(c, step_path.SendBatch)]
    state, _ = _fold(state, core.TokenHeard("w1", _token(4, 50, True), 0.1))  # fed: the shell keeps the lane out
    assert batching.out(state.steps.lanes, "r1")
    if how == "lost plan":
        state, _ = _fold(state, core.StepsLost(1, "gone", 0.15))
    state, _ = _fold(state, core.StepAsked("r1.0", 5, 2, "r1", ("w1", "w2"), 0.2))
    assert not batching.out(state.steps.lanes, "r1") and "r1.0" not in state.steps.ahead
    state, h = _fold(state, SB.LaneAsked(LaneItem("r1", 2, state.steps.next_id - 1), 2))
    assert [c.step_ids for c in h.commands if isinstance(c, step_path.SendBatch)] == [(state.steps.next_id - 1,)]


# -- the simulation ---------------------------------------------------------------------------------
MEMORY = 9 * (sim.UNIT_BYTES + sim.UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES  # one worker holds the model: a one-stage plan


def _direct_schedule(fault: Fault | None = None) -> Schedule:
    # two requests side by side (today's path, batched), then one alone (direct); the fault hits its run
    requests = (Req(5.0, (1, 2, 3), 12), Req(5.01, (4, 5), 10), Req(12.0, (4, 6), 12))
    return Schedule(39, (MEMORY,), (0.0,), requests, (fault,) if fault else ())


def test_a_plan_change_that_moves_a_direct_runs_kv_loses_no_time():
    """A lone request on a one-stage plan runs direct; a second worker joins and the memory split
    moves its KV to a two-stage plan mid-run. Its next step must go out at once: it once waited
    behind its own lane (out since the last fed token) for the step timeout, and the newcomer was
    quarantined for computing nothing (the simulation's check of quarantines, after the requests).
    Nor may the moved KV's first frame be refused: the old stage had run the step it fed itself,
    one position past the coordinator's count, and the new plan's first step forgets it (``rewind``)
    instead of being refused as a lost frame and replaying the sequence (``invalid_frame``, ``pause``)."""
    room = 20 * (sim.UNIT_BYTES + sim.UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES  # the new plan loads beside the running one
    schedule = Schedule(43, (room, room), (0.0, 7.0), (Req(5.0, (1, 2, 3), 240),), (Fault("slow", 0.5, 0, 0.0, 3.0),),
                        memory_placement=True)
    report = run(schedule)
    assert report.violations == [] and report.ok == 1 and report.direct > 0
    assert report.dashboard.count("up") == 2  # the KV did move to a second plan mid-run
    assert "invalid_frame" not in report.dashboard and "pause" not in report.dashboard, report.dashboard


@pytest.mark.parametrize("kind", sim.DIRECT_FAULTS)
def test_a_token_lost_on_one_of_its_two_ways_loses_and_repeats_nothing(kind):
    report = run(_direct_schedule(Fault(kind, 12.06, 0, 0.04)))
    assert report.violations == [] and report.ok == 3  # the tokens equal the reference (simrun._client), nothing leaked
    assert report.direct > 0 and report.direct_lost > 0  # the stage fed itself, and the fault lost a feed or a copy


# a plan of several stages: each worker holds part of the model (the planner splits it over all of them)
SPLIT = {2: 5 * (sim.UNIT_BYTES + sim.UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES, 3: 3 * (sim.UNIT_BYTES + sim.UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES}


def _pipeline_schedule(stages: int, kind: str | None = None, at: float = 12.06, seconds: float = 0.04) -> Schedule:
    """As ``_direct_schedule`` on a plan of ``stages`` stages; the fault is given to every worker
    (only the last stage feeds the first and sends the copies, so it is the one it hits)."""
    requests = (Req(5.0, (1, 2, 3), 12), Req(5.01, (4, 5), 10), Req(12.0, (4, 6), 12))
    faults = tuple(Fault(kind, at, w, seconds) for w in range(stages)) if kind else ()
    return Schedule(39, (SPLIT[stages],) * stages, (0.0,) * stages, requests, faults, kv_checkpoints=False)


def test_a_plan_change_that_moves_a_direct_runs_kv_between_plans_of_several_stages_loses_no_time():
    """A lone request runs direct on a two-stage plan (its last stage feeding the first); a third
    worker joins and the memory split moves its KV to a three-stage plan mid-run. Each old stage
    may hold another count past the coordinator's: the new plan's first step forgets what lies
    past its start at every stage (``rewind``), and goes out at once, refused by none."""
    room = 20 * (sim.UNIT_BYTES + sim.UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES  # each new plan loads beside the running one
    schedule = Schedule(43, (room, room, room), (0.0, 0.0, 7.0), (Req(5.0, (1, 2, 3), 240),), (Fault("slow", 0.5, 0, 0.0, 3.0),),
                        memory_placement=True, kv_checkpoints=False)
    report = run(schedule)
    assert report.violations == [] and report.ok == 1 and report.direct_first > 0
    assert report.dashboard.count("up") == 3  # one stage, then two (before the request), then three mid-run
    assert "invalid_frame" not in report.dashboard and "pause" not in report.dashboard, report.dashboard


@pytest.mark.parametrize("stages", [2, 3])
def test_a_plan_of_several_stages_feeds_its_first_stage_from_its_last(stages):
    report = run(_pipeline_schedule(stages))
    assert report.violations == [] and report.ok == 3 and report.kv_left == []  # the tokens equal the reference, nothing leaked
    assert report.direct_first > 0 and report.direct_first == report.direct  # every feed went last stage -> first stage
    assert "invalid_frame" not in report.dashboard and "pause" not in report.dashboard, report.dashboard


@pytest.mark.parametrize("killed", range(4))
def test_a_worker_killed_mid_run_at_any_stage_of_four_voids_the_run_and_the_sequence_replays_exactly(killed):
    """A lone request runs direct on four stages (``--placement memory``: every worker takes one);
    one worker dies mid-run, the first, a middle one or the last (the one feeding the first):
    the run is void, the other three hold the model, and the sequence replays there."""
    requests = (Req(12.0, (4, 6), 60),)
    report = run(Schedule(39, (SPLIT[3],) * 4, (0.0,) * 4, requests, (Fault("kill", 12.3, killed, 0.0),), memory_placement=True,
                          kv_checkpoints=False))
    assert report.violations == [] and report.ok == 1 and report.kv_left == []
    assert report.direct_first > 0 and "leave" in report.dashboard and "recovered" in report.dashboard


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_cancel_mid_run_frees_the_positions_every_stage_computed_past_it(stages):
    """The client goes after 5 tokens while the last stage runs ahead (``ahead`` 8): the DROP
    reaches every stage, and a fed frame that reaches a stage after its DROP is discarded, so no
    stage keeps the sequence's KV (``Report.kv_left``)."""
    requests = (Req(5.0, (4, 6), 40, cancel_after=5), Req(9.0, (1, 2, 3), 40, cancel_after=21))
    memories = (MEMORY,) if stages == 1 else (SPLIT[stages],) * stages
    report = run(Schedule(39, memories, (0.0,) * stages, requests, (), kv_checkpoints=False))
    assert report.violations == [] and report.ok == 2  # the tokens it got equal the reference's first ones
    assert report.direct > 0 and report.kv_left == []


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("kind", sim.DIRECT_FAULTS)
def test_a_token_lost_between_the_last_and_first_stage_or_on_its_way_to_the_coordinator_loses_nothing(kind, stages):
    """``lose_feed``: the last stage's FORWARD to the first stage is lost, the coordinator's copy
    arrives; ``lose_copy``: the copy is lost, the first stage got the token and runs on. Either way
    the coordinator's step times out and the sequence replays: no token lost, repeated or changed."""
    report = run(_pipeline_schedule(stages, kind))
    assert report.violations == [] and report.ok == 3 and report.kv_left == []
    assert report.direct_first > 0 and report.direct_lost > 0


@pytest.mark.parametrize("stages", [2, 3])
def test_a_feed_the_last_stage_cannot_send_goes_on_through_the_coordinator_at_once(stages):
    """``refuse_feed``: the last stage's send of the next step to the first stage fails (the stage
    knows it, unlike a lost frame): its copy of the token goes to the coordinator unfed, and the
    coordinator sends the next step itself, with no step timeout and no replay."""
    report = run(_pipeline_schedule(stages, sim.REFUSE_FEED, seconds=0.5))
    assert report.violations == [] and report.ok == 3 and report.kv_left == []
    assert report.direct_first > 0 and report.direct_lost == 0
    assert report.worst_ok_s < sim.SETTINGS["step_timeout_s"], report.worst_ok_s


@pytest.mark.parametrize("stages", [1, 2])
def test_the_simulation_sees_a_last_stage_that_feeds_a_wrong_token(monkeypatch, stages):
    real = wcore.next_forward
    monkeypatch.setattr(wcore, "next_forward", lambda plan, batch, tokens, fed: real(plan, batch, [(t + 1) % sim.VOCAB for t in tokens], fed))
    report = run(_direct_schedule() if stages == 1 else _pipeline_schedule(stages))
    assert report.direct > 0 and any("!= reference" in v for v in report.violations)


# -- real processes ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_with_one_worker_gives_generates_greedy_tokens_on_the_direct_path(native_pkg, home):
    import concurrent.futures
    import re

    from harness import Server
    from test_distributed import reference_tokens

    prompts = ["Write a short poem about a cat.", "Explain recursion in one sentence."]
    with Server(home, workers=1) as server:
        def ask(prompt):
            return server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "return_token_ids": True})

        for prompt in prompts:  # alone: direct
            r = ask(prompt)
            assert r.status_code == 200, r.text
            expected = [t for t in reference_tokens(native_pkg, prompt, 40) if t not in native_pkg.manifest.eos_ids]
            assert r.json()["choices"][0]["token_ids"] == expected
        fed = float(re.search(r"^edgepipe_direct_steps_total (\S+)$", server.client.get("/metrics").text, re.M).group(1))
        assert fed > 0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side: a lane, through the coordinator
            replies = list(pool.map(ask, prompts))
        for prompt, r in zip(prompts, replies):
            expected = [t for t in reference_tokens(native_pkg, prompt, 40) if t not in native_pkg.manifest.eos_ids]
            assert r.json()["choices"][0]["token_ids"] == expected


@pytest.mark.slow
def test_seeded_sampled_tokens_are_the_same_direct_through_the_coordinator_and_in_generate(native_pkg, home):
    """Every API's default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) with a seed:
    ``serve`` with the direct path (its default), with ``--direct-steps 0`` and ``generate`` agree."""
    import re

    from harness import Server

    from edgepipe.model.store import local_form
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    tok, cases = native_pkg.tokenizer, [("Write a short poem about a cat.", 11), ("Explain recursion in one sentence.", 2026)]
    pipeline = native_pkg.pipeline(precision=local_form(native_pkg))
    expected = []
    for prompt, seed in cases:  # what ``edgepipe generate --seed`` runs (cli.generate: runtime.local.generate)
        params = GenerationParams(max_tokens=40, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
        tokens = generate(pipeline, ids, params, tok.decode, native_pkg.manifest.eos_ids).tokens
        expected.append([t for t in tokens if t not in native_pkg.manifest.eos_ids])
    assert expected[0] != expected[1]
    for args, direct_on in (((), True), (("--direct-steps", "0"), False)):
        with Server(home, workers=1, args=args) as server:
            for (prompt, seed), want in zip(cases, expected):
                r = server.client.post("/v1/chat/completions", json={  # the sampling fields left out: the API's defaults
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "seed": seed, "return_token_ids": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want
            fed = float(re.search(r"^edgepipe_direct_steps_total (\S+)$", server.client.get("/metrics").text, re.M).group(1))
            assert (fed > 0) is direct_on


@pytest.mark.slow
@pytest.mark.parametrize("workers, args", [
    (3, ()),  # issued secrets: the coordinator gives the last stage the first stage's feed secret
    (2, ("--join-token", "s3cret", "--data-secrets", "derived")),  # both ends derive it from the join token
])
def test_serve_across_stages_gives_generates_tokens_with_the_direct_path_on_and_off(native_pkg, home, workers, args):
    """The last stage feeds the plan's first stage (no hop through the coordinator) and the tokens
    are ``generate``'s, as with ``--direct-steps 0`` (every token through the coordinator)."""
    import re

    from harness import Server
    from test_distributed import reference_tokens

    from edgepipe.model.store import local_form
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    prompts = ["Write a short poem about a cat.", "Explain recursion in one sentence."]
    expected = [[t for t in reference_tokens(native_pkg, p, 40) if t not in native_pkg.manifest.eos_ids] for p in prompts]
    tok, seed = native_pkg.tokenizer, 11  # and a seeded sampled request (every API's default sampling), as generate --seed
    params = GenerationParams(max_tokens=40, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompts[0]}]))
    sampled = [t for t in generate(native_pkg.pipeline(precision=local_form(native_pkg)), ids, params, tok.decode,
                                   native_pkg.manifest.eos_ids).tokens if t not in native_pkg.manifest.eos_ids]
    # no KV checkpoints to a spare plan: a sequence whose KV is copied stays on the full path (direct.grant)
    base = ("--placement", "memory", "--kv-checkpoint-tokens", "0", *args)
    for extra, direct_on in (((), True), (("--direct-steps", "0"), False)):
        with Server(home, workers=workers, args=base + extra, timeout=240) as server:
            assert len(server.status()["plan"]["stages"]) == workers
            for prompt, want in zip(prompts, expected):
                r = server.client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == want
            r = server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 40, "seed": seed, "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == sampled, r.text
            fed = float(re.search(r"^edgepipe_direct_steps_total (\S+)$", server.client.get("/metrics").text, re.M).group(1))
            assert (fed > 0) is direct_on


# -- the coordinator's CPU per token --------------------------------------------------------------
@pytest.mark.pure
def test_the_events_narration_skips_have_no_dashboard_line():
    """``narrate.SILENT`` (a token's and a heartbeat's events) skips the dashboard's match, and
    ``Coordinator.adopt`` logs them without applying them again: none may be one the match knows."""
    import inspect
    import re

    from edgepipe.cluster.shells import narrate

    named = set(re.findall(r"\b([A-Z][A-Za-z]+)\(", inspect.getsource(narrate._fields)))
    assert named and not named & {t.__name__ for t in narrate.SILENT}


@pytest.mark.pure
def test_a_direct_run_of_several_stages_on_a_sliding_window_model_is_replayed_not_moved():
    """Its stages may each hold another count past the coordinator's: a new stage built from two
    old ones' copies would import two lengths, and a window layer's KV would not line up."""
    from types import SimpleNamespace as NS

    from edgepipe.cluster.state.placement import Deployment, StageAssignment as A

    two, one = Deployment(1, (A("a", 0, 4), A("b", 4, 8))), Deployment(1, (A("a", 0, 8),))
    state = NS(requests={"r1": NS(seq="r1.0")}, steps=NS(ahead={"r1.0": SB.Ahead(1, 5)}))
    window, full = [NS(kv_window=0), NS(kv_window=512)], [NS(kv_window=0)] * 2
    assert kv_moves.uneven(state, "r1", two, window)
    assert not kv_moves.uneven(state, "r1", two, full)  # full-cache layers: the first step's rewind trims either length
    assert not kv_moves.uneven(state, "r1", one, window)  # one stage: one count
    assert not kv_moves.uneven(NS(requests=state.requests, steps=NS(ahead={})), "r1", two, window)  # not running ahead
