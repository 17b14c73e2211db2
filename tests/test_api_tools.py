"""Pure parts of the API: tool-call rendering and parsing, and one-line validation errors (no server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from edgepipe.api import schemas as S, tools

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
    assert named.text.endswith('<tool_call>\n{"name": "get_time", "arguments": ') and named.stop == ("</tool_call>",)
    out = tools.parse('{"city": "Paris"}}\n', named)
    assert out.content is None and [c["function"] for c in out.tool_calls] == [{"name": "get_time", "arguments": '{"city": "Paris"}'}]
    required = tools.render(None, plain, USER, TOOLS, "required")
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
