"""Stop rules and streamed text of one sequence (pure logic)."""

from __future__ import annotations

import pytest

from edgepipe.runtime.sequence import GenerationParams, SequenceState, uniform_draw

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\n", 7: "EN", 8: "D"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run(tokens, **kw):
    state = SequenceState([], GenerationParams(**kw), decode, eos_ids=(0,))
    out = []
    for t in tokens:
        delta = state.push(t)
        out.append(delta.text)
        if delta.finished:
            break
    return "".join(out), state.finish_reason, out


def test_eos_stops():
    assert run([1, 2, 0, 3]) [:2] == ("Hello", "stop")


def test_max_tokens_stops_with_length():
    assert run([1, 2, 3, 4, 5], max_tokens=3)[:2] == ("Hello wor", "length")


def test_stop_string_is_cut_and_never_streamed():
    text, reason, pieces = run([1, 2, 7, 8, 3], stop=("END",))
    assert (text, reason) == ("Hello", "stop")
    assert "E" not in "".join(pieces)


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    text, reason, _ = run([1, 7, 2, 5], stop=("END",), max_tokens=4)
    assert (text, reason) == ("HelENlo!", "length")


def test_uniform_draw_is_pure():
    assert uniform_draw(5, 3) == uniform_draw(5, 3)
    assert uniform_draw(5, 3) != uniform_draw(5, 4)
    assert 0 <= uniform_draw(123, 0) < 1


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)])
def test_bad_params_are_refused(kw):
    with pytest.raises(ValueError):
        GenerationParams(**kw)
