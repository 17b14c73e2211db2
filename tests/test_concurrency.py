"""Many sequences in flight: each gets exactly the tokens it gets alone, and stages batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from harness import Server

PROMPTS = [
    ("Name a fruit.", 12), ("What is 2 + 2?", 20), ("Write one line about the sea.", 28), ("Say hi.", 8),
    ("List two planets.", 24), ("Who wrote Hamlet?", 16), ("Describe snow in five words.", 32), ("Give me a colour.", 10),
]


def solo_tokens(pkg, prompt: str, max_tokens: int, pipeline=None) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    out = generate(pipeline or pkg.pipeline(), ids, GenerationParams(max_tokens=max_tokens), tok.decode, pkg.manifest.eos_ids).tokens
    return [t for t in out if t not in pkg.manifest.eos_ids]


def test_eight_concurrent_requests_through_three_workers(int4_pkg, home):
    alone = int4_pkg.pipeline()  # one sequence at a time: each is dropped when it ends
    expected = [solo_tokens(int4_pkg, p, n, alone) for p, n in PROMPTS]
    with Server(home, workers=3, args=("--placement", "memory", "--worker-threads", "1")) as server:
        assert len(server.status()["plan"]["stages"]) == 3

        def ask(item):
            prompt, n = item
            with httpx.Client(base_url=server.url, timeout=300) as c:
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                                         "temperature": 0, "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(ask, PROMPTS))
        for (prompt, _), g, e in zip(PROMPTS, got, expected):
            assert g == e, prompt
        metrics = server.client.get("/metrics").text
        batched = [line for line in metrics.splitlines() if line.startswith("edgepipe_stage_batch_size_bucket") and 'le="1.0"' in line]
        counts = [line for line in metrics.splitlines() if line.startswith("edgepipe_stage_batch_size_count")]
        assert sum(float(b.split()[-1]) for b in batched) < sum(float(c.split()[-1]) for c in counts), "no stage ever batched"
        server.wait_for(lambda s: all((w["stats"] or {}).get("kv_bytes") == 0 for w in s["workers"]), timeout=30)
