"""``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic Messages) through 3 real
workers, spoken by the official ``openai`` and ``anthropic`` clients (issue 31).

Both run on the chat completions' path: for the same greedy request the text equals the chat
route's, plain and streamed; function tools come back as ``function_call`` items / ``tool_use``
blocks whose arguments validate against the tool's schema (held to it as in chat), and the
results go back in as ``function_call_output`` items / ``tool_result`` blocks; errors come in
each API's own shape. (``anthropic`` 2.x no longer sends sampling parameters: ``temperature``
goes in ``extra_body``; the server samples by default, so greedy requests say ``temperature: 0``.)
"""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "Name three colours of the rainbow."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


@pytest.fixture(scope="module")
def oai(three_workers_openai):
    return three_workers_openai


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_text(oai):
    """The chat route's greedy answer to SYSTEM + QUESTION in 24 tokens."""
    r = oai.chat.completions.create(model="smollm2", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                    max_tokens=24, temperature=0)
    assert r.choices[0].message.content
    return r.choices[0].message.content


def test_responses_plain_equals_chat(oai, chat_text):
    r = oai.responses.create(model="smollm2", instructions=SYSTEM, input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.output_text == chat_text
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.usage.output_tokens <= 24
    items = oai.responses.create(model="smollm2", max_output_tokens=24, temperature=0,
                                 input=[{"role": "system", "content": SYSTEM},
                                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == chat_text


def test_responses_streamed_equals_chat(oai, chat_text):
    events = list(oai.responses.create(model="smollm2", instructions=SYSTEM, input=QUESTION, max_output_tokens=24, temperature=0,
                                       stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text
    assert events[-1].response.output_text == chat_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the SDK's own accumulation of the events (it needs response.completed: an answer that ends before max_output_tokens)
    plain = oai.responses.create(model="smollm2", input="Say hello.", max_output_tokens=64, temperature=0)
    with oai.responses.stream(model="smollm2", input="Say hello.", max_output_tokens=64, temperature=0) as stream:
        final = stream.get_final_response()
    assert plain.status == final.status == "completed" and final.output_text == plain.output_text


def test_responses_function_tool_and_its_output(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model="smollm2", input=ask, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=48, temperature=1.0, extra_body={"seed": 3})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert jsonschema_rs.validator_for(WEATHER).is_valid(json.loads(calls[0].arguments)), calls[0].arguments
    follow = oai.responses.create(model="smollm2", tools=tools, max_output_tokens=12, temperature=0, input=ask + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 18}'}], tool_choice="none")
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]
    streamed = list(oai.responses.create(model="smollm2", input=ask, tools=tools, tool_choice="required", max_output_tokens=48,
                                         temperature=0, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) == 1 and jsonschema_rs.validator_for(WEATHER).is_valid(json.loads(done[0].arguments))


def test_responses_json_schema_text_format(oai):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = oai.responses.create(model="smollm2", input="Invent a person.", max_output_tokens=48, temperature=0,
                             text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
    assert r.status == "completed" and jsonschema_rs.validator_for(person).is_valid(json.loads(r.output_text)), r.output_text


def test_messages_plain_and_streamed_equal_chat(claude, chat_text):
    m = claude.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.content[0].text == chat_text and m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 24
    with claude.messages.stream(model="smollm2", max_tokens=24, system=[{"type": "text", "text": SYSTEM}], extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == chat_text and final.content[0].text == chat_text and final.stop_reason == m.stop_reason


def test_messages_tool_use_and_result(claude):
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model="smollm2", max_tokens=48, tools=tools, messages=ask, extra_body={"temperature": 1.0},
                               tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert jsonschema_rs.validator_for(WEATHER).is_valid(uses[0].input), uses[0].input
    follow = claude.messages.create(model="smollm2", max_tokens=12, tools=tools, tool_choice={"type": "none"}, extra_body={"temperature": 0}, messages=ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C and sunny"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text
    with claude.messages.stream(model="smollm2", max_tokens=48, tools=tools, messages=ask, extra_body={"temperature": 0},
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1
    assert jsonschema_rs.validator_for(WEATHER).is_valid(streamed[0].input), streamed[0].input


def test_messages_output_format_json_schema(claude):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    m = claude.messages.create(model="smollm2", max_tokens=48, messages=[{"role": "user", "content": "Invent a person."}],
                               extra_body={"temperature": 0}, output_config={"format": {"type": "json_schema", "schema": person}})
    assert m.stop_reason == "end_turn" and jsonschema_rs.validator_for(person).is_valid(json.loads(m.content[0].text)), m.content


def test_errors_in_each_apis_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="smollm2", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server.url + "/v1/messages", json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json={"model": "gpt-9", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    admission = server.status()["admission"]
    assert admission["active"] == 0 and admission["queued"] == 0


def test_the_key_guards_both_routes_and_anthropics_header_carries_it(keyed_server):
    keyed = anthropic.Anthropic(base_url=keyed_server.url, api_key="sekrit", max_retries=0)  # sent as x-api-key
    m = keyed.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert m.content[0].text is not None
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(keyed_server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4})
    assert r.status_code == 401
    r = httpx.post(keyed_server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4}, headers={"x-api-key": "sekrit"})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")
