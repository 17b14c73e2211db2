"""Replicated stages on real processes: the bundled model on three local workers, an operator's
plan that replicates the second stage over two of them, concurrent greedy streams each equal to
its solo single-process reference, both replicas computing, and no KV left once they end."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from edgepipe.model.store import local_form

from harness import Server
from test_concurrency import solo_tokens

PROMPTS = [("Name a fruit.", 16), ("What is 2 + 2?", 20), ("Write one line about the sea.", 24), ("Say hi.", 12),
           ("List two planets.", 20), ("Who wrote Hamlet?", 16)]


def test_concurrent_streams_through_a_replicated_stage_equal_their_solo_references(native_pkg, home):
    alone = native_pkg.pipeline(batch_invariant=True, precision=local_form(native_pkg))
    expected = [solo_tokens(native_pkg, p, n, alone) for p, n in PROMPTS]
    with Server(home, workers=3, args=("--placement", "memory", "--batch-invariant")) as server:
        status = server.status()
        first, *twins = sorted(w["id"] for w in status["workers"])
        n, cut = status["n_units"], status["n_units"] // 2
        reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=180, json={"stages": [
            {"worker": first, "start": 0, "end": cut}, *({"worker": w, "start": cut, "end": n} for w in twins)], "pin_s": 600})
        assert reply.status_code == 200, reply.text
        plan = server.status()["plan"]
        assert plan["replicated"] and [s.get("replica") for s in plan["stages"]] == [None, [1, 2], [2, 2]]
        computed = {w["id"]: (w["stats"] or {}).get("computed", 0) for w in server.status()["workers"]}

        def ask(item):
            prompt, max_tokens = item
            with httpx.Client(base_url=server.url, timeout=300) as c:
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                                                         "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(ask, PROMPTS))
        for (prompt, _), g, e in zip(PROMPTS, got, expected):
            assert g == e, prompt
        done = server.wait_for(lambda s: all((w["stats"] or {}).get("kv_bytes") == 0 for w in s["workers"])
                               and all((w["stats"] or {}).get("computed", 0) > computed[w["id"]] for w in s["workers"]), timeout=30)
        assert done["plan"]["id"] == reply.json()["plan"]  # still the replicated plan: nothing fell back
        assert sorted(tuple(w.get("replica") or ()) for w in done["workers"]) == [(), (1, 2), (2, 2)]
        live = server.client.get("/v1/cluster/plan").json()  # predicted next to measured, a row per replica
        assert [s.get("replica") for s in live["stages"]] == [None, [1, 2], [2, 2]] and live["stages"][1]["predicted_s"] == live["stages"][2]["predicted_s"]
        bad = httpx.post(server.url + "/v1/cluster/rebalance", timeout=30, json={"stages": [
            {"worker": first, "start": 0, "end": cut}, {"worker": twins[0], "start": cut, "end": n}, {"worker": twins[0], "start": cut, "end": n}]})
        assert bad.status_code == 400 and "twice" in bad.json()["error"]["message"]
