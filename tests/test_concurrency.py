"""Many sequences in flight on a ``--batch-invariant`` cluster: each gets exactly the tokens it
gets alone, and stages batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form


PROMPTS = [
    ("Name a fruit.", 12), ("What is 2 + 2?", 20), ("Write one line about the sea.", 28), ("Say hi.", 8),
    ("List two planets.", 24), ("Who wrote Hamlet?", 16), ("Describe snow in five words.", 32), ("Give me a colour.", 10),
]


def solo_tokens(pkg, prompt: str, max_tokens: int, pipeline=None) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    out = generate(pipeline or pkg.pipeline(precision=local_form(pkg)), ids, GenerationParams(max_tokens=max_tokens), tok.decode, pkg.manifest.eos_ids).tokens
    return [t for t in out if t not in pkg.manifest.eos_ids]


def _batch_counts(server) -> tuple[float, float]:
    """(stage calls that carried one sequence, all stage calls) so far."""
    lines = server.client.get("/metrics").text.splitlines()
    alone = sum(float(x.split()[-1]) for x in lines if x.startswith("edgepipe_stage_batch_size_bucket") and 'le="1.0"' in x)
    return alone, sum(float(x.split()[-1]) for x in lines if x.startswith("edgepipe_stage_batch_size_count"))


def test_eight_concurrent_requests_through_two_workers(native_pkg, keyed_server):
    alone = native_pkg.pipeline(batch_invariant=True, precision=local_form(native_pkg))  # one sequence at a time: each is dropped when it ends
    expected = [solo_tokens(native_pkg, p, n, alone) for p, n in PROMPTS]
    server = keyed_server  # serve --workers 2 --placement memory --api-key sekrit --batch-invariant
    assert len(server.status()["plan"]["stages"]) == 2
    before = _batch_counts(server)

    def ask(item):
        prompt, n = item
        with httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": "Bearer sekrit"}) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                                     "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, PROMPTS))
    for (prompt, _), g, e in zip(PROMPTS, got, expected):
        assert g == e, prompt
    after = _batch_counts(server)
    assert after[0] - before[0] < after[1] - before[1], "no stage ever batched"
    server.wait_for(lambda s: all((w["stats"] or {}).get("kv_bytes") == 0 for w in s["workers"]), timeout=30)
