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


# -- incremental detokenisation on real tokenizers: the streamed text is the whole decode ----------
@pytest.mark.parametrize("which", ["smollm2", "qwen05", "gemma270m"])
def test_streamed_text_equals_the_decode_of_all_ids_on_real_tokenizers(which):
    from edgepipe.model.gguf_source import GGUFSource
    from edgepipe.model.store import bundled_gguf, missing_reference, reference_gguf
    from edgepipe.model.tokenizer import TextTokenizer

    path = bundled_gguf() if which == "smollm2" else reference_gguf(which)
    if not path.is_file():
        pytest.fail(missing_reference(which))
    src = GGUFSource(path)
    info = src.tokenizer_info()
    tok = TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)
    text = " Grüße aus Köln — 東京 🚀 naïve café\n\tdef f(x):  return x**2  # ok 12345 ümlaut"
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    rng = __import__("random").Random(7)
    noise = [rng.randrange(tok.tokenizer.get_vocab_size()) for _ in range(40)]  # odd byte pieces too
    for sequence in (ids, noise, ids[:5] + noise[:9] + ids[5:]):
        calls = []

        def counted(part, calls=calls):
            calls.append(len(part))
            return tok.decode(part)

        state = SequenceState([], GenerationParams(max_tokens=len(sequence)), counted, eos_ids=())
        streamed = "".join(state.push(t).text for t in sequence)
        assert streamed == tok.decode(sequence)
        assert max(calls) < len(sequence) // 2  # each push decodes a window, not every id so far
