"""Issue 12 in-process: the pure checks (frame limits, rate limits, event log, worker-output
validation, credentials), the blob cache's integrity check (attack 3) and the HTTP edges of
attacks 5 and 7 (admin routes from another host, non-UTF-8 credentials, JSON errors)."""

from __future__ import annotations

import hashlib
import http.server
import logging
import math
import os
import threading

import numpy as np
import pytest
from starlette.testclient import TestClient

from edgepipe.worker.blobcache import BlobCache
from edgepipe.net import auth, limits, validate
from edgepipe.net.validate import InvalidWorkerFrame


# -- limits ------------------------------------------------------------------------------------
def test_frame_limits_are_sized_from_the_model():
    assert limits.hello_frame_limit(0) <= 64 << 10  # a hello is a few KB; the limit leaves room
    assert limits.hello_frame_limit(1000) == (64 << 10) + 1000 * 4 * 80  # ... for the names of held files
    # SmolLM2-135M: hidden 576, 8192 positions -> a prefill frame is ~18.9 MB, a decode lane far less
    assert limits.activation_frame_limit(8192, 576) == limits.HEADER_SLACK_BYTES + 8192 * 576 * 4
    assert limits.data_frame_limit(8192, 576, 10_000) == limits.HEADER_SLACK_BYTES + 8192 * 10_000
    assert limits.control_frame_limit(16, 8) == limits.HEADER_SLACK_BYTES + limits.LINK_PROBE_MAX_BYTES


def test_rate_limiter_bursts_then_refills_per_address():
    rl = limits.RateLimiter(rate_per_s=1.0, burst=3)
    assert [rl.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rl.allow("b", 0.0)  # other addresses are not affected
    assert not rl.allow("a", 0.5) and rl.allow("a", 1.6) and not rl.allow("a", 1.7)
    small = limits.RateLimiter(1.0, 1, max_keys=2)
    for key in "abc":
        small.allow(key, 0.0)
    assert small.allow("a", 0.0)  # 'a' was forgotten (oldest), it starts with a full bucket


def test_event_log_keeps_a_bounded_count_per_kind():
    log = limits.EventLog(per_kind=5, initial=[{"kind": "join", "worker": "w1"}, {"kind": "up", "plan": 1}])
    for i in range(600):
        log.append({"kind": "refused", "i": i})
    log.append({"kind": "leave", "worker": "w1"})
    kinds = [e["kind"] for e in log]
    assert kinds[:2] == ["join", "up"] and kinds[-1] == "leave" and kinds.count("refused") == 5
    assert [e["i"] for e in log if e["kind"] == "refused"] == list(range(595, 600))
    assert log.dropped == {"refused": 595} and len(log) == 8 and log[-1]["kind"] == "leave"


def test_json_safe_turns_non_finite_floats_into_null():
    safe = limits.json_safe({"a": math.inf, "b": [math.nan, 1.5, (2, -math.inf)], "c": b"\x01", 3: object})
    assert safe["a"] is None and safe["b"] == [None, 1.5, [2, None]] and safe["c"] == "01" and isinstance(safe["3"], str)


# -- credentials -------------------------------------------------------------------------------
def test_secrets_compare_in_constant_time_and_never_match_empty():
    assert auth.same_secret("abc", "abc") and not auth.same_secret("abc", "abd") and not auth.same_secret("ab", "abc")
    assert not auth.same_secret("", "") and not auth.same_secret(None, "x")
    assert auth.bearer_matches(b"Bearer k", "k") and not auth.bearer_matches(b"Bearer \xff\xfe", "k")
    assert not auth.bearer_matches(b"Bearer k", None)
    a = auth.derived_secret("tok", "ws://10.0.0.2:9000", 3)
    assert a == auth.derived_secret("tok", "ws://10.0.0.2:9000/", 3)
    assert len({a, auth.derived_secret("tok", "ws://10.0.0.2:9000", 4), auth.derived_secret("tok", "ws://10.0.0.3:9000", 3),
                auth.derived_secret("other", "ws://10.0.0.2:9000", 3)}) == 4
    assert len(set(auth.plan_secrets(3))) == 3


# -- worker output (attack 6) ------------------------------------------------------------------
def token_fields(tokens, plan=4, n=None):
    n = len(tokens) if n is None else n
    return {"plan": plan, "batch": [{"seq": f"s{i}", "step": i} for i in range(n)], "tokens": tokens}


def test_token_frames_only_from_the_last_stage_and_in_vocab():
    ok = validate.token_frame(token_fields([5, 0, 49151]), sender="w3", last_stage="w3", plan_id=4, vocab_size=49152)
    assert [(t.seq, t.step, t.token) for t in ok] == [("s0", 0, 5), ("s1", 1, 0), ("s2", 2, 49151)]
    bad = [
        (token_fields([5]), "w2", "last stage"),  # a middle stage answering
        (token_fields([-5]), "w3", "outside"),
        (token_fields([10 ** 9]), "w3", "outside"),
        (token_fields([49152]), "w3", "outside"),
        (token_fields([1.0]), "w3", "integer"),
        (token_fields([True]), "w3", "integer"),
        (token_fields([1, 2], n=1), "w3", "equally long"),
        (token_fields([1], plan=5), "w3", "plan"),
        ({"plan": 4, "batch": [{"step": 0}], "tokens": [1]}, "w3", "sequence"),
    ]
    for fields, sender, words in bad:
        with pytest.raises(InvalidWorkerFrame, match=words):
            validate.token_frame(fields, sender=sender, last_stage="w3", plan_id=4, vocab_size=49152)


def test_timings_are_well_formed_finite_and_name_the_plan():
    good = [["w1", 0.01, 1, 4, 2], ["w2", 0.02, 1, 2, 2]]
    assert validate.timings(good, ("w1", "w2"))[1] == validate.StageTiming("w2", 0.02, 1, 2, 2)
    for raw in ("x", [["w1", 0.01, 1, 4]], [["w1", math.nan, 1, 4, 1]], [["w1", math.inf, 1, 4, 1]], [["w1", -1.0, 1, 4, 1]],
                [["w1", 0.01, 0, 4, 1]], [["w1", 0.01, 1, 3, 1]], [["w1", 0.01, 1, 4, 0]], [[5, 0.01, 1, 4, 1]], [["w1", "0.1", 1, 4, 1]]):
        with pytest.raises(InvalidWorkerFrame):
            validate.timings(raw)
    with pytest.raises(InvalidWorkerFrame, match="plan has"):
        validate.timings(good, ("w1", "w3"))  # a worker reporting times for a stage it does not run


def test_relays_only_to_the_next_stage_of_the_plan():
    stages = ("w1", "w2", "w3")
    assert validate.relay_frame({"plan": 2, "relay_to": "w3"}, sender="w2", stages=stages, plan_id=2) == "w3"
    for fields, sender in (({"plan": 2, "relay_to": "w1"}, "w2"), ({"plan": 2, "relay_to": "w3"}, "w1"), ({"plan": 1, "relay_to": "w2"}, "w1")):
        with pytest.raises(InvalidWorkerFrame):
            validate.relay_frame(fields, sender=sender, stages=stages, plan_id=2)


def test_probe_times_and_pong_stats():
    assert validate.probe_times([0.1, 0.2], 2) == (0.1, 0.2)
    for raw in ([0.1], [0.1, math.nan], [0.1, 0.0], [0.1, 1e9], "fast"):
        with pytest.raises(InvalidWorkerFrame):
            validate.probe_times(raw, 2)
    assert validate.pong_stats({"kv_bytes": 10, "queue": 0})["busy_s"] is None
    for bad in ({"kv_bytes": -1}, {"busy_s": math.inf}, {"queue": "3"}):
        with pytest.raises(InvalidWorkerFrame):
            validate.pong_stats(bad)


def test_activation_problems_are_named():
    x = np.zeros((2, 3, 8), np.float32)
    assert validate.activation_problem(x, 8, 16) is None
    assert validate.activation_problem(x.astype(np.float16), 8) is None
    y = x.copy()
    y[1, 2, 5] = np.nan
    y[0, 0, 0] = np.inf
    assert "2 of 48 values" in validate.activation_problem(y, 8)
    assert "hidden size 8" in validate.activation_problem(x, 16)
    assert "context is 2" in validate.activation_problem(x, 8, 2)
    assert "int64" in validate.activation_problem(x.astype(np.int64))
    assert "shape" in validate.activation_problem(np.zeros((2, 8), np.float32))


# -- attack 3: cached files are checked before use ---------------------------------------------
@pytest.fixture
def blob_server(tmp_path):
    """A plain HTTP server with one 3 MiB blob at /v1/blobs/<sha> (what the coordinator serves)."""
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    sha = hashlib.sha256(data).hexdigest()
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200 if self.path == f"/v1/blobs/{sha}" else 404)
            self.end_headers()
            if self.path == f"/v1/blobs/{sha}":
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", sha, data, hits
    server.shutdown()


def test_attack3_corrupt_cached_blob_is_deleted_and_fetched_again(tmp_path, blob_server, caplog):
    url, sha, data, hits = blob_server
    cache = BlobCache(tmp_path / "cache")
    assert cache.fetch(url, sha) == len(data) and cache.fetch(url, sha) == 0 and len(hits) == 1
    path = cache.path(sha)
    st = path.stat()
    with open(path, "r+b") as f:  # overwrite 64 KiB in place: same inode and size ...
        f.seek(1 << 20)
        f.write(b"\x00" * (64 << 10))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old mtime: only ctime tells
    for fresh in (cache, BlobCache(tmp_path / "cache")):  # this process, and a restarted worker
        with open(path, "r+b") as f:
            f.seek(1 << 20)
            f.write(b"\x01" * 16)
        with caplog.at_level(logging.WARNING, logger="edgepipe.blobcache"):
            assert fresh.fetch(url, sha) == len(data), "a corrupt cached file was used"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        assert fresh.repaired == [sha] and "corrupt" in caplog.text
        caplog.clear()
    assert len(hits) == 3
    again = BlobCache(tmp_path / "cache")  # verified once: the marker spares a new process the hash
    assert again.fetch(url, sha) == 0 and (tmp_path / "cache" / ".verified" / sha).read_text() == again._stamp(sha)


# -- attacks 5 and 7 at the HTTP edge ----------------------------------------------------------
@pytest.fixture
def app_factory(native_pkg):
    from edgepipe.api.app import create_app
    from edgepipe.cluster.shells.coordinator import Coordinator

    def make(**kwargs):
        return create_app(Coordinator(native_pkg), native_pkg, **kwargs)

    return make


def test_attack5_cluster_control_from_another_host_needs_a_credential(app_factory):
    app = app_factory()
    remote = TestClient(app, client=("192.0.2.7", 5555))
    local = TestClient(app, client=("127.0.0.1", 5555))
    for client, status in ((remote, 403), (local, 404)):  # 404: no such worker, but past the admin check
        assert client.post("/v1/cluster/workers/w1/emulation", json={"slowdown": 50}).status_code == status
    assert remote.post("/v1/cluster/rebalance", json={"stages": []}).status_code == 403
    assert remote.get("/v1/cluster/status").status_code == 200  # reading stays open without --api-key
    app.state.coordinator.event("stages_timed", speed=math.inf, nested={"x": math.nan})
    response = remote.get("/v1/cluster/events")
    assert response.status_code == 200 and response.json()["events"][-1]["speed"] is None


def test_attack7_non_utf8_authorization_is_401_not_500(app_factory):
    """The raw header bytes reach the middleware as a server passes them (TestClient would
    re-encode them as UTF-8, hiding the bug), so the ASGI app is called directly."""
    import asyncio

    app = app_factory(api_key="k3y")

    async def call(value: bytes) -> tuple[int, bytes]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http", "path": "/v1/models",
                 "raw_path": b"/v1/models", "query_string": b"", "root_path": "", "headers": [(b"authorization", value)],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8420)}
        await app(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    for value in (b"Bearer \xff\xfe", b"Bearer k3y\xff", b"Bearer k3", b"bearer k3y", b""):
        status, body = asyncio.run(call(value))
        assert status == 401 and b"invalid_api_key" in body, (value, status, body)
    assert asyncio.run(call(b"Bearer k3y"))[0] == 200


def test_request_bodies_over_the_limit_are_413_before_buffering(app_factory):
    from edgepipe.api.app import MAX_BODY_BYTES

    client = TestClient(app_factory())
    declared = client.post("/v1/chat/completions", content=b"{}", headers={"content-length": str(MAX_BODY_BYTES + 1)})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    streamed = client.post("/v1/completions", content=chunks())
    assert streamed.status_code == 413, streamed.text
    # within the limit the route itself answers (400: not a valid request, but read and judged)
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
