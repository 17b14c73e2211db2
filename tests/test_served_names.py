"""The ``model`` field: the served model answers to every name a user meets it by (package name,
file stem, alias, ``/api/tags``' ``name:latest``); another name is a 404 ``model_not_found`` in
each API's own error shape, listing what is served."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from edgepipe.api.served import ServedNames


@pytest.mark.pure
def test_a_gguf_import_answers_to_its_file_stem_package_name_alias_and_tag():
    served = ServedNames.of("qwen2-5-coder-0-5b-instruct-native", "qwen05", "/models/qwen2.5-coder-0.5b-instruct.gguf")
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2-5-coder-0-5b-instruct", "qwen2-5-coder-0-5b-instruct-native",
                 "qwen05", "qwen05:latest", "qwen2-5-coder-0-5b-instruct-native:latest", "Qwen2.5-Coder-0.5B-Instruct"):
        assert served.answers(name), name
    for name in ("gpt-4o", "qwen2.5-coder", "qwen05:7b", "qwen2.5-coder-0.5b-instruct-int4", "", ":latest", "smollm2"):
        assert not served.answers(name), name
    assert served.listing() == "qwen2-5-coder-0-5b-instruct-native, qwen05"


@pytest.mark.pure
def test_a_renamed_import_still_answers_to_its_file():
    served = ServedNames.of("mine-int4", None, "/m/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert served.answers("mine") and served.answers("mine-int4") and served.answers("SmolLM2-135M-Instruct.Q4_1")
    assert not served.answers("smollm2") and served.shown == ("mine-int4",)


@pytest.fixture(scope="module")
def client(native_pkg):
    from edgepipe.api.app import create_app
    from edgepipe.cluster.shells.coordinator import Coordinator

    return TestClient(create_app(Coordinator(native_pkg), native_pkg))


def names_of(native_pkg) -> list[str]:
    from pathlib import Path

    from edgepipe.model.store import stem

    m = native_pkg.manifest
    return [m.name, stem(m.name), "smollm2", Path(m.source["path"]).stem, m.name + ":latest"]


def test_every_name_is_served_by_each_api(client, native_pkg):
    listed = client.get("/v1/models").json()["data"][0]["id"]
    tagged = client.get("/api/tags").json()["models"][0]["name"]
    for name in (*names_of(native_pkg), listed, tagged):
        assert client.get(f"/v1/models/{name}").status_code == 200, name
        r = client.post("/api/chat", json={"model": name, "messages": []})  # Ollama's load call: answers at once
        assert r.status_code == 200 and r.json()["model"] == tagged, (name, r.text)
        # past the model check: refused on the next field, not as an unknown model
        r = client.post("/v1/chat/completions", json={"model": name, "messages": [], "max_tokens": 1})
        assert r.status_code == 400, (name, r.text)
        r = client.post("/v1/messages", json={"model": name, "messages": [], "max_tokens": 1})
        assert r.status_code == 400, (name, r.text)


def test_an_unknown_model_is_a_404_in_each_shape_listing_what_is_served(client, native_pkg):
    name = native_pkg.manifest.name
    r = client.post("/v1/chat/completions", json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and name in r.json()["error"]["message"]
    r = client.get("/v1/models/gpt-17")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and name in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={"model": "claude-9", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    assert name in r.json()["error"]["message"]
    for route, body in (("/api/chat", {"messages": []}), ("/api/generate", {"prompt": ""}), ("/api/show", {})):
        r = client.post(route, json={"model": "llama3:8b", **body})
        assert r.status_code == 404 and set(r.json()) == {"error"} and "not found" in r.json()["error"], (route, r.text)
        assert name + ":latest" in r.json()["error"], r.text
