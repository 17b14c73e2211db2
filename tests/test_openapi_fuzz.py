"""A schema fuzzer (schemathesis) against ``/openapi.json``: no 5xx, every error JSON, and the server still answers.

The document fuzzed is the one the server serves (checked equal first). Valid and invalid bodies
are both generated; generation lengths are kept to a few tokens (``tame``) so a few hundred
requests take well under a minute.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, settings

from edgepipe.api.app import ENDPOINTS
from edgepipe.api.openapi import document
from harness import Server

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

DOC = document(ENDPOINTS)


def shrink(node):
    """A copy of the document whose strings and lists are short (long prompts would make each request slow)."""
    if isinstance(node, list):
        return [shrink(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: shrink(v) for k, v in node.items()}
    if out.get("type") == "string":
        out["maxLength"] = min(out.get("maxLength", 64), 64)
    if out.get("type") == "array":
        out["maxItems"] = min(out.get("maxItems", 4), 4)
    if out.get("type") == "object" and "properties" not in out:  # free-form objects (tool parameters): small and flat
        out["maxProperties"] = 3
        out["additionalProperties"] = {"type": ["string", "number", "boolean", "null"], "maxLength": 16}
    return out


def served_model_only(doc: dict) -> dict:
    """Ollama bodies name the served model (valid cases), so generation runs rather than a 404 for a random name."""
    for name in ("OllamaChatRequest", "OllamaGenerateRequest", "OllamaShowRequest", "MessagesRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": ["smollm2", "smollm2:latest"]}
    return doc


schema = schemathesis.openapi.from_dict(served_model_only(shrink(copy.deepcopy(DOC))))
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True, database="none")
schema.config.phases.update(phases=["examples", "fuzzing"])  # the coverage phase alone sends ~1,000 requests
EXAMPLES = int(os.environ.get("EDGEPIPE_FUZZ_EXAMPLES", "40"))  # per operation: 12 operations, a few hundred requests in all
SENT: list[int] = []  # status of every fuzzed request
LENGTH_FIELDS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}


def tame(body):
    """Keep generation short: lengths within the valid range are cut to a few tokens (invalid ones left alone)."""
    if not isinstance(body, dict):
        return body
    for key, most in LENGTH_FIELDS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and most < value <= 2**31 - 1:
            body[key] = most
    if "messages" in body or "prompt" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null: 256 by default
            body["max_tokens"] = 2
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
            body["prompt"] = body["prompt"][:3]
    if "input" in body and body.get("max_output_tokens") is None:  # Responses: absent or null is 256
        body["max_output_tokens"] = 2
    if "model" in body and ("messages" in body or "prompt" in body):  # Ollama bodies: num_predict
        if body.get("options") is None:
            body["options"] = {"num_predict": 2}
        options = body["options"]
        if isinstance(options, dict):
            n = options.get("num_predict")
            if n is None or (isinstance(n, int) and not isinstance(n, bool) and (n < 0 or 4 < n <= 2**31 - 1)):
                options["num_predict"] = 2
    return body


@pytest.fixture(scope="module")
def server(home, native_pkg):
    with Server(home, workers=1) as s:
        assert s.client.get("/openapi.json").json() == json.loads(json.dumps(DOC))
        yield s


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_error(server, case):
    if isinstance(case.body, dict):
        case.body = tame(case.body)
    response = case.call(base_url=server.url, timeout=60)
    SENT.append(response.status_code)
    assert response.status_code < 500, (response.status_code, response.text[:300], case.body)
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]


def test_still_answers_after_fuzzing(server):
    counts = {code: SENT.count(code) for code in sorted(set(SENT))}
    print(f"fuzzed {len(SENT)} requests, by status: {counts}")
    assert len(SENT) >= 100 and 200 in SENT and 400 in SENT, counts  # a few hundred requests, valid and invalid
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    status = server.status()["admission"]
    assert status["active"] == 0 and status["queued"] == 0
