"""Tool calls held to their parameter schemas, through 3 real workers with the openai SDK (issue 31).

On the bundled 135M model, which left to itself echoes a schema back as the arguments or drops
required fields: forced (named) and required calls sampled at temperature 1 with 20 seeds each
all parse and validate against their tool's schema; with "auto" every call the model starts
validates too; parallel calls only where the request allows them; the SDK's own structured-output
helpers (``parse`` with a pydantic model, as response format and as a tool) get validated
objects, on chat and on the Responses API. On Qwen2.5-Coder-0.5B (slow), whose template renders
the tools and whose call markers are special tokens, forced and required calls validate too;
under "auto" it writes its call as JSON text (fenced or bare) rather than between the markers:
that comes back as ``tool_calls`` too (issue 42), to the openai and the ollama clients.
The strings have a
``maxLength``: the grammar holds a call's shape, but at temperature 1 the 135M model sometimes
writes a name for 200 tokens, and a call cut by ``max_tokens`` cannot be valid (it ends "length").
"""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from edgepipe.model.store import missing_reference, reference_gguf
from harness import Server


openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
COUNTRY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                                            "population_millions": {"type": "number"}},
           "required": ["name", "country", "population_millions"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "record_city", "description": "Record facts about a city", "parameters": COUNTRY}}]
SCHEMAS = {"get_weather": WEATHER, "record_city": COUNTRY}
ASK = [{"role": "user", "content": "Tokyo is the capital of Japan and has about 14 million people. What is the weather there?"}]


@pytest.fixture(scope="module")
def client(three_workers_openai):
    return three_workers_openai


def calls_of(response) -> list[tuple[str, dict, str]]:
    """(name, parsed arguments, finish_reason) of every call of every choice; each choice must have one."""
    out = []
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            out.append((call.function.name, json.loads(call.function.arguments), choice.finish_reason))
    return out


def assert_valid(calls) -> None:
    for name, args, _ in calls:
        validator = jsonschema_rs.validator_for(SCHEMAS[name])
        assert validator.is_valid(args), (name, args, [e.message for e in validator.iter_errors(args)])


def sampled_calls(client, choice, seeds: int, first_seed: int) -> list:
    calls = []
    for seed in range(first_seed, first_seed + seeds, 10):  # n=10: choice seeds seed..seed+9
        r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, n=min(10, seeds),
                                           max_tokens=200, tool_choice=choice)
        calls += calls_of(r)
        assert all(len(c.message.tool_calls) == 1 for c in r.choices)  # parallel_tool_calls not asked for: one call
    return calls


@pytest.mark.slow  # 3 minutes on two cores: -m slow (four seeds of each stay in the default run)
@pytest.mark.parametrize("choice", ["get_weather", "record_city", "required"])
def test_forced_and_required_calls_validate_across_twenty_seeds(client, choice):
    named = {"type": "function", "function": {"name": choice}} if choice != "required" else choice
    calls = sampled_calls(client, named, 20, 1000)
    assert len(calls) == 20 and {c[0] for c in calls} <= ({choice} if choice != "required" else set(SCHEMAS))
    assert_valid(calls)
    assert len({json.dumps(c[1]) for c in calls}) > 3  # sampled, not one call twenty times


@pytest.mark.parametrize("choice", ["record_city", "required"])
def test_forced_and_required_calls_validate(client, choice):
    named = {"type": "function", "function": {"name": choice}} if choice != "required" else choice
    calls = sampled_calls(client, named, 4, 500)
    assert len(calls) == 4
    assert_valid(calls)


def test_parallel_required_calls_and_streaming(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, seed=5, n=3, max_tokens=128,
                                       tool_choice="required", parallel_tool_calls=True)
    complete = []
    for ch in r.choices:
        calls = ch.message.tool_calls
        assert calls, ch
        if ch.finish_reason == "length":  # the model went on calling until max_tokens: its last call is cut
            calls = calls[:-1]
        complete.append([(c.function.name, json.loads(c.function.arguments), ch.finish_reason) for c in calls])
    assert max(len(calls) for calls in complete) >= 2  # parallel calls happen when asked for
    assert_valid([c for calls in complete for c in calls])
    stream = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=96, stream=True, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "record_city"}})
    args = "".join(tc.function.arguments or "" for chunk in stream for ch in chunk.choices for tc in ch.delta.tool_calls or [])
    assert_valid([("record_city", json.loads(args), "tool_calls")])


@pytest.mark.slow  # up to 80 s: the model starts calls rarely (the lazy grammar's masks are tested in test_api_tools.py)
def test_auto_calls_the_model_starts_validate(client):
    """The 135M model starts a call on its own about once in eight answers to this; every one it starts must validate."""
    ask = [{"role": "system", "content": "You are a function calling assistant. Answer with a <tool_call> only."},
           {"role": "user", "content": "Call get_weather for Tokyo."}]
    calls, texts = [], []
    for seed in range(7000, 7048, 8):
        r = client.chat.completions.create(model="smollm2", messages=ask, tools=TOOLS, temperature=1.0, seed=seed, n=8, max_tokens=64,
                                           tool_choice="auto")
        for ch in r.choices:
            texts.append(ch.message.content)
            done = ch.message.tool_calls or []
            if ch.finish_reason == "length":  # a call cut by max_tokens cannot be complete
                done = done[:-1]
            calls += [(c.function.name, json.loads(c.function.arguments), ch.finish_reason) for c in done]
        if calls:
            break
    assert calls, texts
    assert_valid(calls)


def test_unusable_tool_schema_is_a_400_naming_tools(three_workers):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]
    r = three_workers.client.post("/v1/chat/completions", json={"messages": ASK, "tools": bad, "tool_choice": "required", "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "Invalid type" in r.json()["error"]["message"], r.text
    r = three_workers.client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                               "ignore_eos": True, "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text


def test_openai_sdk_pydantic_helpers_return_validated_objects(client):
    """The SDK's structured-output helpers (``parse``: a pydantic model as a strict JSON schema, as
    response format and as a function tool) get objects that validate into the model."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: float

    for seed in (1, 2):
        r = client.chat.completions.parse(model="smollm2", messages=ASK, response_format=City, max_tokens=96, temperature=1.0, seed=seed)
        assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content
    tool = openai.pydantic_function_tool(City, name="record_city")
    r = client.chat.completions.parse(model="smollm2", messages=ASK, tools=[tool], max_tokens=96, temperature=1.0, seed=3,
                                      tool_choice={"type": "function", "function": {"name": "record_city"}})
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, City)
    parsed = client.responses.parse(model="smollm2", input=ASK, text_format=City, max_output_tokens=96, temperature=1.0,
                                    extra_body={"seed": 4})
    assert isinstance(parsed.output_parsed, City), parsed.output_text


def test_instructor_returns_validated_objects_in_its_tool_and_json_schema_modes(client):
    """instructor (a widely used structured-output library on top of the openai client) gets
    objects that validate into its pydantic model from the bundled model, in its function-calling
    mode (a named tool call, held to the tool's schema) and its JSON-schema mode (response_format),
    at temperature 1 with no retries: a malformed or runaway answer fails the test. (Before numbers
    were bounded, ``structured.bounded_numbers``, both modes ran digits to ``max_tokens`` here.)"""
    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: float

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        for seed in (5, 6):
            city = patched.chat.completions.create(model="smollm2", messages=ASK, response_model=City, max_retries=0, max_tokens=96,
                                                   temperature=1.0, seed=seed)
            assert isinstance(city, City), (mode, city)


# -- Qwen2.5-Coder-0.5B: its template renders the tools, its markers are special tokens -----------------
@pytest.fixture(scope="module")
def qwen_server(home):
    path = reference_gguf("qwen05")
    if not path.is_file():
        pytest.fail(missing_reference("qwen05"))
    with Server(home, workers=3, args=("--model", str(path), "--placement", "memory"), timeout=600) as server:
        yield server


@pytest.fixture(scope="module")
def qwen(qwen_server):
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0)
    return client, client.models.list().data[0].id


WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow  # shares the Qwen cluster above
def test_qwen_auto_call_written_as_json_comes_back_as_tool_calls(qwen, qwen_server):
    """Under "auto" Qwen2.5-Coder-0.5B writes ``{"name": "get_weather", "arguments": {...}}`` as text;
    it matches a declared tool and validates, so the openai client (plain and streamed) and the
    ollama client get it as a tool call, not as content."""
    client, model = qwen
    tools = TOOLS[:1]
    r = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=tools, temperature=0, max_tokens=96)
    choice = r.choices[0]
    assert choice.message.tool_calls, choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip().startswith(("{", "```"))
    assert_valid([("get_weather", json.loads(call.function.arguments), "tool_calls")])
    stream = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=tools, temperature=0, max_tokens=96, stream=True)
    names, args, content, finish = [], "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                names.append(tc.function.name) if tc.function.name else None
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == json.loads(call.function.arguments) and finish == "tool_calls"
    assert "{" not in content and "```" not in content, content  # the call's text was held, not streamed
    ollama = pytest.importorskip("ollama")
    oc = ollama.Client(host=qwen_server.url)
    o = oc.chat(model=oc.list().models[0].model, messages=WEATHER_ASK, tools=tools, options={"temperature": 0, "num_predict": 96})
    assert o.message.tool_calls and o.message.tool_calls[0].function.name == "get_weather", o.message
    assert o.message.tool_calls[0].function.arguments["city"] == "Paris"


@pytest.mark.slow  # 3 minutes on two cores (importing the model, then 40 sampled answers)
def test_qwen_forced_and_required_calls_validate_across_twenty_seeds(qwen):
    client, model = qwen
    for choice in ({"type": "function", "function": {"name": "record_city"}}, "required"):
        calls = []
        for seed in (100, 200):
            r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, n=10, max_tokens=200,
                                               tool_choice=choice)
            calls += calls_of(r)
        assert len(calls) == 20
        assert_valid(calls)


@pytest.mark.slow  # shares the Qwen cluster above
def test_qwen_instructor_modes_return_validated_objects(qwen):
    """instructor's tool and JSON-schema modes on Qwen2.5-Coder-0.5B through 3 workers: validated
    objects, no retries, temperature 1."""
    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: float

    client, model = qwen
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        for seed in (7, 8):
            city = patched.chat.completions.create(model=model, messages=ASK, response_model=City, max_retries=0, max_tokens=128,
                                                   temperature=1.0, seed=seed)
            assert isinstance(city, City), (mode, city)
