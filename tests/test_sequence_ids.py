"""Sequence ids have one definition (``cluster.sequence_ids``): a request's lives and its
checkpoint copies are told apart, and each belongs to its request, whatever the request id holds."""

import pytest

from edgepipe.cluster.state import sequence_ids as ids


@pytest.mark.pure
@pytest.mark.parametrize("rid", ["r1", "chatcmpl-7.x", "a.b.c"])
def test_lives_and_checkpoints_are_told_apart_and_belong_to_their_request(rid):
    lives = [ids.live(rid, e) for e in range(3)]
    copies = [ids.checkpoint(rid, n) for n in (1, 2)]
    assert len(set(lives + copies)) == 5
    assert not any(ids.is_checkpoint(s) for s in lives) and all(ids.is_checkpoint(s) for s in copies)
    assert {ids.request_of(s) for s in lives + copies} == {rid}
