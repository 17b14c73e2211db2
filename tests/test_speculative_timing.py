"""The time-aware draft length: k from measured pass costs against the drafts expected kept,
k = 0 (plain decoding) where drafting does not pay, probes now and then; and the costs measured
from passes and draft waits. Figures are stop 34's measurements (a 1.5B target over 3 stages
with 10 ms hops, a 0.5B draft)."""

from __future__ import annotations

import pytest

from edgepipe.runtime.speculative import (DraftLength, PassCosts, expected_tokens, fit_line, pass_costs, timed_draft_length)

pytestmark = pytest.mark.pure  # no process, no model

# a plain step 54 ms of compute + 60 ms of hops; each extra verified position 0.45 of the compute; a draft step 35 ms
MEASURED = PassCosts(step_s=0.114, position_s=0.025, draft_step_s=0.035)


def test_expected_tokens_of_a_pass():
    assert expected_tokens(0.0, 5) == 1.0  # every draft rejected: the target's own token
    assert expected_tokens(1.0, 5) == 6.0  # every draft kept, and the bonus
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("acceptance, costs, expected", [
    (0.65, MEASURED, 1),  # chat on a quiet box: one draft pays (9.5 vs 8.8 tok/s), two do not
    (0.6, MEASURED, 0),  # a gain under the margin (9.2 vs 8.8 tok/s) is not worth the risk
    (0.5, MEASURED, 0),  # fewer drafts kept: plain decoding is faster
    (0.6, PassCosts(0.114, 0.035, 0.045), 0),  # chat on a loaded box (slower drafts and positions): plain
    (0.98, MEASURED, 8),  # a code edit: as many as allowed
    (0.98, PassCosts(0.114, 0.025, 0.035, draft_call_s=0.02), 8),  # a remote drafter's round trip is paid once per pass
    (0.7, PassCosts(0.114, 0.025, 0.0), 3),  # free drafts (n-gram): the verify positions alone limit k
    (0.9, PassCosts(0.114, 0.025, 0.2), 0),  # a draft step slower than a decode step: never
])
def test_timed_draft_length(acceptance, costs, expected):
    assert timed_draft_length(acceptance, costs, k_max=8) == expected


def test_the_chosen_length_is_the_fastest_and_zero_never_loses():
    for acceptance in [i / 20 for i in range(21)]:
        k = timed_draft_length(acceptance, MEASURED, k_max=8, margin=0.0)
        rates = [expected_tokens(acceptance, j) / MEASURED.pass_s(j) for j in range(9)]
        assert rates[k] == max(rates)
        assert rates[k] >= rates[0]  # never slower than plain by the measured costs


def test_bad_costs_are_refused():
    with pytest.raises(ValueError):
        PassCosts(0.0, 0.01, 0.01)
    with pytest.raises(ValueError):
        PassCosts(0.1, float("nan"), 0.01)


def test_fit_line_takes_the_median_of_each_size():
    points = [(0, 0.1), (0, 0.1), (0, 5.0), (2, 0.15), (2, 0.15), (4, 0.2)]  # one slow outlier at 0
    intercept, slope = fit_line(points)
    assert intercept == pytest.approx(0.1, abs=1e-6) and slope == pytest.approx(0.025, abs=1e-6)
    assert fit_line([(4, 0.2)]) == pytest.approx((0.0, 0.05))  # one size: through the origin
    assert fit_line([]) is None


def test_pass_costs_from_measurements():
    assert pass_costs([(1, 0.1)], []) is None  # no draft waited for yet
    costs = pass_costs([(1, 0.1)] * 3 + [(3, 0.15)] * 3 + [(5, 0.2)] * 3, [(4, 0.12), (2, 0.06)])
    assert costs.step_s == pytest.approx(0.1) and costs.position_s == pytest.approx(0.025)
    thin = pass_costs([(1, 0.1)] * 5 + [(2, 0.09)], [(4, 0.12)])  # one verify pass, faster than the steps (noise): not a line yet
    assert thin.step_s == pytest.approx(0.1) and thin.position_s == pytest.approx(0.045)
    assert costs.draft_step_s == pytest.approx(0.03) and costs.draft_call_s == pytest.approx(0.0, abs=1e-9)
    only_verify = pass_costs([(5, 0.28)], [(4, 0.12)])  # one size of pass: split at the measured share
    assert only_verify.step_s == pytest.approx(0.1) and only_verify.position_s == pytest.approx(0.045)


def test_a_timed_length_tries_pauses_where_plain_is_faster_and_tries_again():
    slow_drafts = PassCosts(0.114, 0.035, 0.045)  # drafting pays only on a predictable text
    length = DraftLength(k_max=8, rate=0.6, costs=slow_drafts, retry_after=4)
    assert length.k == 2 and length.trying  # 0 at the guessed rate, but a request starts with a try: its own text decides
    assert length.update(2, 0) == 1  # the first draft rejected: one observation, not yet this text's verdict; one draft a pass
    while length.drafted < DraftLength.VERDICT_DRAFTS - 1:
        assert length.update(1, 0) == 1
    assert length.update(1, 0) == 0  # four drafts rejected: plain decoding
    for _ in range(3):
        assert length.update(0, 0) == 0
    assert length.update(0, 0) == 2  # a try after 4 steps
    assert length.update(2, 1) == 0  # not worth it yet
    for _ in range(7):
        assert length.update(0, 0) == 0  # a failed try doubles the wait for the next: 8 steps
    assert length.update(0, 0) == 2
    assert length.update(2, 0) == 0 and length.wait == 16
    fast_drafts = PassCosts(0.114, 0.025, 0.01)  # the load went, or the drafter moved
    for _ in range(15):
        assert length.update(0, 0, fast_drafts) == 0
    assert length.update(0, 0, fast_drafts) == 5  # a try of what would pay on a predictable text
    assert length.update(5, 5) >= 1 and length.wait == 4  # all kept: drafting goes on, the wait is reset


def test_a_pass_observes_its_kept_drafts_and_one_rejection():
    """Drafts after the first rejected one were drafted on a token the target did not choose."""
    length = DraftLength(k_max=8, rate=0.5, costs=MEASURED)
    length.update(8, 6)  # 6 kept, the 7th rejected: 7 observations, not 8
    assert (length.drafted, length.kept) == (7, 6) and length.rate == pytest.approx((6 + 0.5) / (7 + 1))


def test_one_unlucky_pass_does_not_stop_a_predictable_text():
    length = DraftLength(k_max=8, rate=0.88, costs=PassCosts(0.145, 0.037, 0.047, ahead_from=0.8))
    first = length.k
    assert first >= 2 and length.update(first, 0) == 1  # its first pass landed on the one unpredictable token
    assert [length.update(length.k, length.k) for _ in range(6)] == [1, 1, 2, 4, 8, 8]  # then everything kept: on to k_max


def test_a_code_edit_ramps_up_from_its_first_try():
    length = DraftLength(k_max=8, rate=0.5, costs=PassCosts(0.155, 0.07, 0.094, ahead_from=0.8))  # loaded box, from a chat's rate
    assert length.trying and length.k == 2  # what would pay at 90%
    assert [length.update(length.k, length.k) for _ in range(3)] == [4, 8, 8]  # every draft kept: on to k_max


def test_a_timed_length_doubles_only_at_a_high_rate():
    length = DraftLength(k_max=8, rate=0.9, costs=MEASURED)
    first = length.k
    assert first == 3 and length.update(first, first) >= 6  # every draft kept at a high rate: twice as many at least
    assert length.update(length.k, length.k) == 8  # and on to k_max
    chat = DraftLength(k_max=8, rate=0.65, costs=MEASURED)
    assert chat.k == 1 and chat.update(1, 1) <= 2  # a kept single draft at a chat's rate does not double blindly


# -- where the draft runs ---------------------------------------------------------------------------
from edgepipe.plan.draft_site import COORDINATOR, WORKERS, DraftSite, choose_draft_site, site_to_use  # noqa: E402


@pytest.mark.parametrize("sites, current, expected", [
    ([DraftSite(COORDINATOR, 0.035)], None, COORDINATOR),  # no drafter worker
    ([DraftSite(COORDINATOR, 0.041), DraftSite("w4-phone", 0.020, call_s=0.02)], COORDINATOR, "w4-phone"),  # 0.10 vs 0.164 s a pass
    ([DraftSite(COORDINATOR, 0.035), DraftSite("w4-phone", 0.030, call_s=0.02)], COORDINATOR, COORDINATOR),  # 0.14 vs 0.14: stay
    ([DraftSite(COORDINATOR, 0.035), DraftSite("w4-phone", 0.030, call_s=0.02)], None, COORDINATOR),  # a tie goes to the coordinator
    ([DraftSite(COORDINATOR, 0.035), DraftSite("w4-phone", 0.031)], "w4-phone", "w4-phone"),  # 12% cheaper is not worth a move back
    ([DraftSite(COORDINATOR, 0.035), DraftSite("w5-b", 0.02), DraftSite("w4-a", 0.02)], None, "w4-a"),  # equal workers: by id
    ([DraftSite(COORDINATOR, 0.035), DraftSite("w5-b", 0.02)], "w4-gone", "w5-b"),  # the running drafter was lost
])
def test_the_draft_runs_where_a_pass_costs_least(sites, current, expected):
    assert choose_draft_site(sites, current) == expected
    assert choose_draft_site(list(reversed(sites)), current) == expected  # the order they are listed in does not matter


def test_a_site_needs_real_seconds():
    with pytest.raises(ValueError):
        DraftSite("w1", float("inf"))
    with pytest.raises(ValueError):
        choose_draft_site([])


@pytest.mark.parametrize("sites, current, pinned, remotes, expected", [
    ([DraftSite(COORDINATOR, 0.041), DraftSite("w4-phone", 0.020)], COORDINATOR, None, True, "w4-phone"),  # the cheapest
    ([DraftSite(COORDINATOR, 0.041), DraftSite("w4-phone", 0.020)], COORDINATOR, COORDINATOR, True, COORDINATOR),  # --draft-on coordinator
    ([DraftSite(COORDINATOR, 0.041), DraftSite("w4-phone", 0.020)], "w4-phone", None, False, COORDINATOR),  # no drafter worker attached
    ([DraftSite(COORDINATOR, 0.001), DraftSite("w4-a", 0.030), DraftSite("w5-b", 0.020)], "w4-a", WORKERS, True, "w4-a"),  # pinned: stays
    ([DraftSite(COORDINATOR, 0.001), DraftSite("w4-a", 0.030), DraftSite("w5-b", 0.020)], COORDINATOR, WORKERS, True, "w5-b"),
    ([DraftSite(COORDINATOR, 0.001)], "w4-gone", WORKERS, True, COORDINATOR),  # pinned to workers, none live: here
    ([], COORDINATOR, None, True, COORDINATOR),  # nothing measured yet
])
def test_the_site_in_use_follows_the_pin_and_the_costs(sites, current, pinned, remotes, expected):
    assert site_to_use(sites, current, pinned, remotes) == expected


# -- the drafter worker's messages ---------------------------------------------------------------------
import numpy as np  # noqa: E402

from edgepipe.net import messages as M  # noqa: E402
from edgepipe.net.protocol import ProtocolError, decode, encode  # noqa: E402


def _round_trip(msg):
    return M.parse(decode(encode(msg)), vocab_size=100)


def test_drafter_messages_round_trip():
    load = M.DraftLoad("draft-fp32", "a" * 64, ["b" * 64], 2048, 8)
    assert _round_trip(load.to_message()) == load
    draft = M.Draft(3, "r1.0", 5, 4, 7, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}, True)
    back = _round_trip(draft.to_message({"ids": np.array([1, 2, 3], np.int32)}))
    assert (back.id, back.seq, back.keep, back.k, back.step, dict(back.sampling), back.rule) == (3, "r1.0", 5, 4, 7, dict(draft.sampling), True)
    assert M.Hello.from_fields({"role": "drafter"}).drafter and not M.Hello.from_fields({}).drafter
    drafted = M.Drafted(3, True, [5, 6], [[5, 9], [6]], [[0.75, 0.25], [1.0]], 0.02)
    assert _round_trip(drafted.to_message()) == drafted
    ready = M.DraftReady(True, "draft-fp32", 0.03, 1.5, 1024)
    assert _round_trip(ready.to_message()) == ready


@pytest.mark.parametrize("msg", [
    M.Draft(1, "s", -1, 4, 0).to_message(),  # a negative keep
    M.Draft(1, "s", 0, 65, 0).to_message(),  # more drafts than a pass may carry
    M.Draft(1, "s", 0, 4, 0, {"temperature": "hot", "top_k": 1, "top_p": 1.0, "seed": 0}).to_message(),
    M.Drafted(1, True, [5, 100]).to_message(),  # a token outside the vocabulary
    M.Drafted(1, True, [5], [[5]], None).to_message(),  # ids without probabilities
    M.Drafted(1, True, [5], [[5, 6]], [[float("nan"), 0.5]]).to_message(),
    M.DraftLoad("d", "g", ["f"], 0).to_message(),  # no context
    M.DraftReady(True, step_s=-1.0).to_message(),
])
def test_bad_drafter_frames_are_refused_in_one_line(msg):
    with pytest.raises(ProtocolError) as info:
        _round_trip(msg)
    assert "\n" not in str(info.value)


def test_a_bad_role_is_refused():
    with pytest.raises(ProtocolError):
        M.Hello.from_fields({"role": "boss"})


# -- a drafter worker as the coordinator's drafter, in memory ----------------------------------------------
import asyncio  # noqa: E402
import threading  # noqa: E402


class _Local:
    name, states_distributions = "local", False

    def __init__(self):
        self.calls = []

    def draft(self, seq, ids, k, params=None, step=0):
        self.calls.append((seq, len(ids), k))
        return [7] * k

    def prime(self, seq, ids):
        pass

    def forget(self, seq):
        pass


def test_drafts_go_to_the_drafter_worker_and_come_back_here_when_it_fails():
    from edgepipe.cluster.shells.draft_placement import PlacedDrafter
    from edgepipe.cluster.shells.drafters import RemoteDrafter

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sent, behaviour = [], {"mode": "answer"}
    remote = None

    async def send(msg):
        sent.append(msg)
        if behaviour["mode"] == "closed":
            raise ConnectionError("channel closed")
        if msg.type.value == "draft":
            unknown = behaviour["mode"] == "forgot" and msg["keep"] > 0
            reply = M.Drafted(msg["id"], not unknown, None if unknown else [3] * msg["k"], compute_s=0.001 * msg["k"],
                              error="unknown sequence" if unknown else None)
            remote.answered(reply)

    moves = []
    local = _Local()
    placed = PlacedDrafter(local, package=None, on_move=lambda site, why: moves.append(site))
    placed.local_step_s = 0.05
    remote = RemoteDrafter("w9-drafter", send, loop, step_s=0.01, timeout_s=2.0)
    try:
        placed.add(remote)
        assert placed.site == "w9-drafter" and moves == ["w9-drafter"]  # 0.04 s a pass there against 0.2 s here
        assert placed.draft("r1", [1, 2, 3], 4) == [3, 3, 3, 3]
        assert placed.draft("r1", [1, 2, 3, 3, 9], 2) == [3, 3]
        assert [(m["keep"], list(m.tensors["ids"])) for m in sent] == [(0, [1, 2, 3]), (3, [3, 9])]  # only the new ids travel
        behaviour["mode"] = "forgot"  # it rejoined and lost its sequences: everything again
        assert placed.draft("r1", [1, 2, 3, 3, 9, 4], 1) == [3] and sent[-1]["keep"] == 0 and len(sent[-1].tensors["ids"]) == 6
        behaviour["mode"] = "closed"
        assert placed.draft("r1", [1, 2, 3, 3, 9, 4, 5], 2) == [7, 7]  # drafted here instead: the pass still gets drafts
        assert placed.site == "coordinator" and moves[-1] == "coordinator" and placed.fallbacks == 1 and not placed.remotes
        assert local.calls == [("r1", 7, 2)] and placed.remote_drafts == 3
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_silent_drafter_is_dropped_after_its_timeout():
    from edgepipe.cluster.shells.draft_placement import PlacedDrafter
    from edgepipe.cluster.shells.drafters import RemoteDrafter

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def swallow(msg):
        pass

    placed = PlacedDrafter(_Local(), package=None)
    placed.local_step_s = 0.05
    placed.add(RemoteDrafter("w9-drafter", swallow, loop, step_s=0.01, timeout_s=0.2))
    try:
        assert placed.draft("r1", [1, 2], 3) == [7, 7, 7] and placed.site == "coordinator"
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_draft_slower_than_a_step_is_tried_rarely():
    hopeless = PassCosts(0.088, 0.0, 0.1)  # a draft step dearer than a decode step: not even all drafts kept would pay
    length = DraftLength(k_max=8, rate=0.99, costs=hopeless, retry_after=4)
    assert length.k == 0
    assert all(length.update(0, 0) == 0 for _ in range(DraftLength.RETRY_MOST - 1))
    assert length.update(0, 0) == 1  # then one try: the costs are measured again


def test_drafting_ahead_hides_the_drafts_of_a_pass_that_keeps_everything():
    """Measured on a loaded box (stop 35's first benchmark): a 0.5B draft step of 94 ms against a
    155 ms step. Drafting one pass at a time does not pay even at 98% kept; drafting the next
    pass while this one travels (what a model drafter does from an 80% rate on) does."""
    loaded = dict(step_s=0.155, position_s=0.07, draft_step_s=0.094)
    assert timed_draft_length(0.98, PassCosts(**loaded), k_max=8) == 0
    assert timed_draft_length(0.98, PassCosts(**loaded, ahead_from=0.8), k_max=8) >= 4
    assert timed_draft_length(0.6, PassCosts(**loaded, ahead_from=0.8), k_max=8) == 0  # below 80% nothing is drafted ahead
    ahead = PassCosts(**loaded, ahead_from=0.8)
    assert ahead.pass_s(4, 1.0) == pytest.approx(0.155 + 4 * 0.07 + max(0.0, 4 * 0.094 - (0.155 + 4 * 0.07)))  # all hidden
