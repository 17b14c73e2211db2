"""Pure parts of the API: tool-call rendering and parsing, and one-line validation errors (no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from edgepipe.api import schemas as S, tools
from edgepipe.api.structured import Constraint, SchemaError, vocabulary_for
from edgepipe.model.gguf_source import GGUFSource
from edgepipe.model.store import bundled_gguf, missing_reference, reference_gguf
from edgepipe.model.tokenizer import TextTokenizer

TOOLS = [S.Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
         S.Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]
USER = [S.ChatMessage(role="user", content="Weather in Paris?")]
QWEN_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
             "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
             "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}<assistant>")


def plain(messages):  # what a template without tools renders (SmolLM2's shape)
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_template_without_tools_gets_them_in_a_system_message():
    p = tools.render(None, plain, USER, TOOLS, "auto")
    assert p.text.startswith("<system>You may call one or more functions") and '"name": "get_weather"' in p.text
    assert p.forced == "" and p.tool_names == ("get_weather", "get_time")
    assert tools.render(None, plain, USER, TOOLS, "none").text == "<user>Weather in Paris?<assistant>"


def test_template_with_tools_gets_them_as_a_variable_and_calls_as_objects():
    history = USER + [S.ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
        S.ChatMessage(role="tool", content="18 C", tool_call_id="c1")]
    p = tools.render(QWEN_LIKE, plain, history, TOOLS, "auto")
    assert p.text == '<tools>get_weather;get_time;</tools><user>Weather in Paris?<assistant>[get_weather {"city": "Paris"}]<tool>18 C<assistant>'


def test_named_and_required_choices_start_the_call():
    named = tools.render(None, plain, USER, TOOLS, S.NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}))
    assert named.text.endswith('<tool_call>\n{"name": "get_time", "arguments": ') and (named.mode, named.named) == ("named", "get_time")
    out = tools.parse('{"city": "Paris"}}\n', named)
    assert out.content is None and [c["function"] for c in out.tool_calls] == [{"name": "get_time", "arguments": '{"city": "Paris"}'}]
    required = tools.render(None, plain, USER, TOOLS, "required")
    assert required.mode == "required" and tools.render(None, plain, USER, TOOLS, "auto").mode == "auto"
    misspelled = tools.parse('get_weathr", "arguments": {"city": "Oslo"}}', required)
    assert misspelled.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    cut = tools.parse('{"city": "Par', named)  # max_tokens ended it: the arguments' text as written
    assert cut.tool_calls[0]["function"]["arguments"] == '{"city": "Par'


def test_parse_free_text_and_calls():
    p = tools.render(None, plain, USER, TOOLS, "auto")
    assert tools.parse("It is sunny.", p) == tools.ParsedOutput("It is sunny.")
    out = tools.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                      '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', p)
    assert out.content == "Let me check." and [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"city": "Paris"}, {}]
    assert len({c["id"] for c in out.tool_calls}) == 2
    inside = tools.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call><tool_call>"}}\n</tool_call>', p)
    assert [json.loads(c["function"]["arguments"]) for c in inside.tool_calls] == [{"city": "</tool_call><tool_call>"}]
    assert inside.content is None
    broken = tools.parse("<tool_call>not json</tool_call>", p)
    assert broken.tool_calls == [] and broken.content == "<tool_call>not json</tool_call>"
    assert tools.holdback("text <tool_") == len("<tool_") and tools.holdback("text") == 0


@pytest.mark.parametrize("body,param,words", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "wizard"}]}, "messages", "'messages[1].role'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": 2**64}, "top_k", "less than or equal to 2147483647"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": "x"}, "stream_options", "object"),
    ({"prompt": [1, -2]}, "prompt", "a list of token ids"),
])
def test_first_error_names_the_field_in_one_line(body, param, words):
    model = S.CompletionRequest if "prompt" in body else S.ChatRequest
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(json.dumps(body))
    got_param, message = S.first_error(info.value, model)
    assert got_param == param and words in message and "\n" not in message


def test_unsupported_fields_are_named_not_ignored():
    req = S.CompletionRequest.model_validate({"prompt": "x", "suffix": "y"})
    assert S.unsupported(req)[0] == "suffix"
    assert S.unsupported(S.CompletionRequest.model_validate({"prompt": "x", "suffix": ""})) is None


# -- tool calls held to their schemas (the grammar, on the bundled model's vocabulary) ----------------
WEATHER = S.Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
CALL_TOOLS = [WEATHER, TOOLS[1]]


@pytest.fixture(scope="module")
def tok():
    src = GGUFSource(bundled_gguf())
    info = src.tokenizer_info()
    return TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)


def masks_along(tok, choice, text: str | list[int], parallel: bool = False) -> list:
    """(token, the mask before it) along ``text`` (None: free), as the coordinator asks for them; the
    last entry's token is None after the end, or the first token the mask refuses (nothing after it)."""
    prompt = tools.render(None, plain, USER, CALL_TOOLS, choice)
    lark, trigger = tools.call_grammar(CALL_TOOLS, prompt, parallel, tools.special_markers(tok))
    vocab = vocabulary_for(tok)
    mask = Constraint(vocab, vocab.compile_lark(lark), trigger).token_mask()
    ids, out = (tok.encode(text) if isinstance(text, str) else text), []
    for k in range(len(ids) + 1):
        out.append((ids[k] if k < len(ids) else None, mask(ids[:k])))
        if k < len(ids) and not allows(out[-1][1], ids[k]):
            break
    return out


def allows(mask, token) -> bool:
    return mask is None or bool(np.unpackbits(mask, bitorder="little")[token])


def refused(steps) -> bool:
    """Some token of the text was not allowed."""
    return steps[-1][0] is not None


def test_named_call_follows_the_parameters_schema(tok):
    named = S.NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    good = masks_along(tok, named, '{"city": "Paris"}}')
    assert not refused(good)
    eos = tok.eos_ids[0]
    assert allows(good[-1][1], eos) and not allows(good[-1][1], tok.encode(",")[0])  # the call is over: only EOS
    assert refused(masks_along(tok, named, '{"type": "string"}}'))  # the schema echoed back: refused
    assert refused(masks_along(tok, named, '{"city": "Paris", "country": "FR"}}'))  # an undeclared argument
    assert refused(masks_along(tok, named, '{}}'))  # a required one missing
    assert refused(masks_along(tok, named, "The weather"))


def test_required_call_picks_a_declared_name_and_parallel_only_when_asked(tok):
    one = masks_along(tok, "required", 'get_time", "arguments": {}}')
    assert not refused(one)
    assert refused(masks_along(tok, "required", 'get_temperature", "arguments": {}}'))  # no undeclared name
    last = one[-1][1]
    assert allows(last, tok.eos_ids[0]) and not allows(last, tok.encode("\n")[0])
    second = 'get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
    assert not refused(masks_along(tok, "required", second, parallel=True))
    assert refused(masks_along(tok, "required", second, parallel=False))


def test_auto_is_free_until_a_call_opens_then_held_until_it_closes(tok):
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> More text.'
    steps = masks_along(tok, "auto", text)
    assert not refused(steps)
    opened = text.index("<tool_call>") + len("<tool_call>")
    closed = text.index("</tool_call>") + len("</tool_call>")
    ids = tok.encode(text)
    ends = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert all(m is None for end, (_, m) in zip(ends, steps) if end < opened)
    assert all(m is not None for end, (_, m) in zip(ends, steps) if opened <= end < closed)
    assert all(m is None for end, (_, m) in zip(ends, steps) if end >= closed)  # free again: another call may follow
    long_before = "The weather depends on the city. " * 20 + '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}'
    assert refused(masks_along(tok, "auto", long_before))  # found after a long free stretch too
    assert refused(masks_along(tok, "auto", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}'))
    assert refused(masks_along(tok, "auto", 'Hi <tool_call>\n{"name": "weather", "arguments": {}}'))


def test_unusable_tool_schema_is_a_schema_error(tok):
    broken = S.Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}})
    prompt = tools.render(None, plain, USER, [broken], "required")
    vocab = vocabulary_for(tok)
    with pytest.raises(SchemaError, match="Invalid type"):
        vocab.compile_lark(tools.call_grammar([broken], prompt, False)[0])


@pytest.fixture(scope="module")
def qwen_tok():
    path = reference_gguf("qwen05")
    if not path.is_file():
        pytest.fail(missing_reference("qwen05"))
    src = GGUFSource(path)
    info = src.tokenizer_info()
    return TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)


def test_special_token_markers_are_written_and_accepted(tok, qwen_tok):
    """Qwen2.5 writes <tool_call> and </tool_call> as single special tokens its decode drops: the
    turn's decode writes them, and the grammar takes the token as well as the spelled-out text."""
    assert tools.special_markers(tok) == {}  # SmolLM2: ordinary text
    markers = tools.special_markers(qwen_tok)
    assert sorted(markers.values()) == ["</tool_call>", "<tool_call>"]
    opening, closing = (next(t for t, m in markers.items() if m == text) for text in ("<tool_call>", "</tool_call>"))
    call = qwen_tok.encode('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    ids = qwen_tok.encode("Sure.") + [opening] + call + [closing]
    auto = tools.render(None, plain, USER, CALL_TOOLS, "auto")
    assert qwen_tok.decode(ids).count("tool_call") == 0  # what the model's own decode shows
    text = tools.decoder(qwen_tok, auto)(ids)
    assert text == 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert [c["function"]["name"] for c in tools.parse(text, auto).tool_calls] == ["get_weather"]
    steps = masks_along(qwen_tok, "auto", ids)
    assert not refused(steps) and steps[-1][1] is None  # held through the call, free after its closing token
    assert refused(masks_along(qwen_tok, "auto", ids[:-len(call) - 1] + qwen_tok.encode('\n{"name": "get_time", "arguments": {"x": 1}}')))
    second = qwen_tok.encode('get_weather", "arguments": {"city": "Oslo"}}\n') + [closing] + qwen_tok.encode("\n") + [opening] + \
        qwen_tok.encode('\n{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert not refused(masks_along(qwen_tok, "required", second, parallel=True))


def test_held_calls_send_text_until_a_call_opens():
    auto = tools.render(None, plain, USER, TOOLS, "auto")
    held = tools.HeldCalls(auto)
    sent = [held.feed(piece) for piece in ("It is ", "sunny <tool", '_call>\n{"name": "get_time", ', '"arguments": {}}\n</tool_call>')]
    assert sent == ["It is ", "sunny ", "", ""]  # "<tool" waited until it turned out to be a call
    parsed, rest = held.finish()
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_time"] and rest == ""
    plain_text = tools.HeldCalls(auto)
    assert plain_text.feed("a <tool") == "a " and plain_text.finish() == (tools.ParsedOutput("a <tool"), "<tool")
    named = S.NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    forced = tools.HeldCalls(tools.render(None, plain, USER, TOOLS, named))
    assert forced.feed("{}}") == "" and forced.finish()[0].tool_calls


# -- calls written as bare JSON, without the markers (issue 42: Qwen2.5-Coder under "auto") ---------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
JSON_TOOLS = [S.Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}),
              S.Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]


def auto_prompt():
    return tools.render(None, plain, USER, JSON_TOOLS, "auto")


@pytest.mark.pure
@pytest.mark.parametrize("text,content", [
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None),
    ('  {"name": "get_weather", "parameters": {"city": "Paris"}}\n', None),  # Llama 3.1's spelling
    ('I will check.\n```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', "I will check."),
    ('```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]\n```', None),
])
def test_a_call_written_as_json_is_a_call(text, content):
    out = tools.parse(text, auto_prompt())
    assert out.content == content and out.tool_calls, out
    first = out.tool_calls[0]
    assert first["function"]["name"] == "get_weather" and json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    assert first["id"].startswith("call_") and first["type"] == "function"


@pytest.mark.pure
@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # not the schema: required city missing, town not allowed
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}',  # minimum 1
    '{"name": "get_wether", "arguments": {"city": "Paris"}}',  # not a declared tool
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "note": "extra"}',  # not the call's shape
    'Try {"name": "get_weather", "arguments": {"city": "Paris"}} yourself.',  # inside a sentence: an example, not a call
    '```json\n{"city": "Paris"}\n```',  # some JSON, no call
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]',  # a list is all calls or none
])
def test_json_that_is_not_a_valid_call_stays_text(text):
    assert tools.parse(text, auto_prompt()) == tools.ParsedOutput(text)


@pytest.mark.pure
def test_json_calls_only_under_auto():
    named = tools.render(None, plain, USER, JSON_TOOLS, "none")
    assert tools.parse('{"name": "get_weather", "arguments": {"city": "Paris"}}', named).tool_calls == []


@pytest.mark.pure
def test_streamed_json_call_is_held_and_plain_code_flows():
    held = tools.HeldCalls(auto_prompt())
    pieces = ["Sure", ".\n", "``", "`json\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n```"]
    assert [held.feed(p) for p in pieces] == ["Sure", ".\n", "", "", "", "", ""]
    parsed, rest = held.finish()
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"] and rest == "" and parsed.content == "Sure."
    code = tools.HeldCalls(auto_prompt())
    sent = [code.feed(p) for p in ["Here:\n", "```", "python\n", "print(1)\n", "```\n", "Done."]]
    assert "".join(sent) == "Here:\n```python\nprint(1)\n```\nDone." and sent[3]  # released once the block is not JSON
    assert code.finish() == (tools.ParsedOutput("Here:\n```python\nprint(1)\n```\nDone."), "")
    almost = tools.HeldCalls(auto_prompt())
    assert almost.feed('{"name": "get_weather", "arguments": {"town": 1}}') == ""
    parsed, rest = almost.finish()  # not a valid call: the held text goes out as content at the end
    assert parsed.tool_calls == [] and rest == '{"name": "get_weather", "arguments": {"town": 1}}'
