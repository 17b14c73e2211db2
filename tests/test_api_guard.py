"""Closed by default (issue 41): with ``--api-key`` every route needs the key unless it declares itself open.

Each route is an ``api.routing.Endpoint`` whose ``guard`` has no default; these tests walk the
app's routes (each must carry its declaration; the open and worker-facing ones are exactly the
listed few), and show that a path no route declares (``/v1/embeddings`` on an old server, a
typo) answers 401 without the key and only with it a 404 or the route's own 4xx. In process
(Starlette's TestClient, a coordinator without workers): seconds.
"""

from __future__ import annotations

import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from edgepipe.api import routing
from edgepipe.api.routing import Endpoint, Guard

KEY = {"Authorization": "Bearer k3y"}
OPEN = {"/", "/health", "/favicon.ico", "/worker", "/static/{path:path}", "/metrics", "/openapi.json",
        "/dist/{name}"}  # the wheel a joining machine installs (api/dist_routes: public on purpose)
JOIN_TOKEN = {"/v1/blobs/{sha}", "/v1/worker"}  # workers hold the join token, not the key: the route checks it


@pytest.fixture(scope="module")
def make(native_pkg):
    from edgepipe.api.app import create_app
    from edgepipe.cluster.shells.coordinator import Coordinator

    def build(**kwargs):
        return create_app(Coordinator(native_pkg), native_pkg, **kwargs)

    return build


def undeclared(app) -> list[str]:
    """The app's routes that do not carry an Endpoint with a Guard (the walk the test below does)."""
    return [getattr(r, "path", repr(r)) for r in app.routes
            if not (isinstance(getattr(r, "declared", None), Endpoint) and isinstance(r.declared.guard, Guard))]


def test_every_route_declares_its_guard(make):
    app = make(api_key="k3y")
    assert undeclared(app) == []
    guards = {r.path: r.declared.guard for r in app.routes}
    assert {p for p, g in guards.items() if g is Guard.OPEN} == OPEN
    assert {p for p, g in guards.items() if g is Guard.JOIN_TOKEN} == JOIN_TOKEN
    assert len(guards) > len(OPEN) + len(JOIN_TOKEN) + 15  # the rest (the API) is guarded by the key
    # The walk catches a route added without a declaration, and the middleware guards it anyway.
    async def bare(request):
        return PlainTextResponse("served")
    sloppy = make(api_key="k3y", extra_routes=[Route("/v1/bare", bare)])
    assert undeclared(sloppy) == ["/v1/bare"]
    assert TestClient(sloppy).get("/v1/bare").status_code == 401
    assert TestClient(sloppy).get("/v1/bare", headers=KEY).text == "served"
    with pytest.raises(TypeError):
        Endpoint("/v1/x", bare)  # no guard, no endpoint


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/nope", "/v1/chat", "/v1/cluster/nope", "/api/nope", "/nope", "/statics",
                                  "/v1/blobs", "/v1/models/x/../../../etc/passwd", "/.env"])
def test_unknown_paths_are_401_without_the_key(make, path):
    client = TestClient(make(api_key="k3y"))
    for method in ("GET", "POST", "DELETE"):
        r = client.request(method, path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
        keyed = client.request(method, path, headers=KEY)
        assert keyed.status_code in (400, 404, 405), (method, path, keyed.text)  # with the key: the route's own answer
        assert keyed.json()["error"]["message"]


def test_every_key_route_is_401_without_it_and_the_open_ones_answer(make):
    app = make(api_key="k3y")
    client = TestClient(app)
    checked = 0
    for route in app.routes:
        e = route.declared
        if e.websocket:
            continue
        path = e.path.replace("{model:path}", "smollm2").replace("{worker}", "w1").replace("{sha}", "0" * 64)
        path = path.replace("{path:path}", "worker.js")
        r = client.request(e.methods[0], path, headers={"Authorization": "Bearer wrong"})
        if e.guard is Guard.API_KEY:
            assert r.status_code == 401, (e.path, r.status_code)
            checked += 1
        else:
            assert r.status_code in (200, 404), (e.path, r.status_code, r.text[:200])  # a blob that does not exist: 404
    assert checked > 15
    # Without any key configured nothing asks for one (today's behaviour).
    assert TestClient(make()).get("/v1/models").status_code == 200


def test_the_worker_socket_answers_the_join_token_not_the_key(make):
    """/v1/worker stays reachable without the API key (a tab or a worker has only the join token);
    its own gate refuses a wrong hello. A WebSocket to any other path is closed without the key."""
    from edgepipe.net.protocol import MessageType, decode

    client = TestClient(make(api_key="k3y", join_token="j0in"))
    with client.websocket_connect("/v1/worker") as ws:  # accepted: the gate reads a hello
        ws.send_bytes(b"\x00\x00\x00\x00")
        answer = decode(ws.receive_bytes())
        assert answer.type is MessageType.ERROR and "hello" in answer["message"]
    with pytest.raises(WebSocketDisconnect) as closed:
        with client.websocket_connect("/v1/chat/completions") as ws:
            ws.receive_bytes()
    assert closed.value.code == 1008
    assert client.get("/v1/blobs/" + "0" * 64).status_code == 401  # the join token, not the key, opens unit files
    assert client.get("/v1/blobs/" + "0" * 64, headers={"Authorization": "Bearer j0in"}).status_code == 404


@pytest.mark.pure
def test_guard_of_is_closed_for_undeclared_and_redirected_paths():
    async def h(request):
        return PlainTextResponse("")

    routes = [Endpoint("/worker", h, Guard.OPEN).route(), Endpoint("/v1/x", h, Guard.API_KEY, ("POST",)).route(),
              WebSocketRoute("/v1/raw", h), Endpoint("/v1/sock", h, Guard.JOIN_TOKEN, (), websocket=True).route()]

    def guard(path, method="GET", kind="http"):
        return routing.guard_of(routes, {"type": kind, "path": path, "method": method, "root_path": ""})

    assert guard("/worker") is Guard.OPEN and guard("/worker/") is Guard.OPEN  # Starlette redirects the slash
    assert guard("/v1/x") is Guard.API_KEY and guard("/v1/x", "POST") is Guard.API_KEY
    assert guard("/v1/sock", kind="websocket") is Guard.JOIN_TOKEN
    assert guard("/v1/raw", kind="websocket") is Guard.API_KEY  # a route nobody declared
    assert guard("/v1/embeddings") is Guard.API_KEY and guard("/worker/x") is Guard.API_KEY
    assert Endpoint("/v1/models/{model:path}", h, Guard.API_KEY).documented_path == "/v1/models/{model}"


def test_embeddings_and_image_parts_get_a_clear_400(make):
    """Issue 42: embeddings are "not served by this model" (not "no route"); an image part is
    refused as "text-only" on the OpenAI, Anthropic, Responses and Ollama routes, in each one's error shape."""
    client = TestClient(make(api_key="k3y"))
    for path in ("/v1/embeddings", "/api/embed", "/api/embeddings"):
        r = client.post(path, json={"model": "smollm2", "input": "hi"}, headers=KEY)
        error = r.json()["error"]
        message = error["message"] if path.startswith("/v1") else error  # Ollama: {"error": "..."}
        assert r.status_code == 400 and "not served by this model" in message, (path, r.text)
    assert client.post("/v1/embeddings", json={}, headers=KEY).json()["error"]["code"] == "model_not_supported"
    png = "data:image/png;base64,iVBORw0KGgo="
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                                                           {"type": "image_url", "image_url": {"url": png}}]}]}),
        ("/v1/messages", {"model": "smollm2", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": png}]}]}),
        ("/api/chat", {"model": "smollm2", "messages": [{"role": "user", "content": "hi", "images": ["iVBO"]}]}),
        ("/api/generate", {"model": "smollm2", "prompt": "hi", "images": ["iVBO"]}),
    ]:
        r = client.post(path, json=body, headers=KEY)
        error = r.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert r.status_code == 400 and "text-only model" in message, (path, r.text)
        if path == "/v1/messages":
            assert r.json()["type"] == "error"  # Anthropic's shape
    # A text-only body with another mistake keeps its own message.
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "text"}]}]}, headers=KEY)
    assert r.status_code == 400 and "text-only" not in r.json()["error"]["message"]


def test_favicon_is_open_and_an_svg(make):
    r = TestClient(make(api_key="k3y")).get("/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml") and r.content.startswith(b"<svg")
