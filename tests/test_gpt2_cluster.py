"""GPT-2 through 3 worker processes: cut anywhere (an embedding alone, the head alone), the tokens
of the single process; chat turns that start from cached prefix blocks, whose first computed
position the embedding alone never saw (its learned positions start where the frame says); a
forced rebalance mid-stream that hands the embedding to another worker."""

from __future__ import annotations

import httpx
import pytest

from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.model.store import local_form
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from harness import Server
from test_gpt2 import POSITIONS, _reference, write_gpt2_gguf
from test_families import train_vocab
from test_living_cluster import PROMPT, stream_tokens
from test_prefix_cluster import play_turns, reference_tokens

pytestmark = pytest.mark.slow  # three worker processes (about a minute on 2 busy cores)
N = 40


@pytest.fixture(scope="module")
def gpt2_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("gpt2-home")
    vocab = train_vocab("bpe")
    write_gpt2_gguf(_reference(len(vocab["tokens"])), vocab, home / "gpt2.gguf")
    import_model(home / "gpt2.gguf", home / "models", "native", name="gpt2", max_context=POSITIONS, measure_cost=False)
    return home


def reference(pkg: Package, cuts: list[int]) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    params = GenerationParams(max_tokens=N, ignore_eos=True)
    return generate(pkg.pipeline(cuts, precision=local_form(pkg)), ids, params, tok.decode, pkg.manifest.eos_ids).tokens


def rebalance(server: Server, stages: list[tuple[str, int, int]]) -> dict:
    reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=120, json={
        "stages": [{"worker": w, "start": a, "end": b} for w, a, b in stages], "pin_s": 600})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_three_workers_cut_anywhere_and_a_moved_embedding(gpt2_home):
    pkg = Package(gpt2_home / "models" / "gpt2")
    expected = reference(pkg, [])
    assert reference(pkg, [1, 3]) == expected and len(set(expected)) > 3
    with Server(gpt2_home, workers=3, args=("--model", "gpt2", "--placement", "memory"), timeout=300) as server:
        a, b, c = sorted(w["id"] for w in server.status()["workers"])
        rebalance(server, [(a, 0, 1), (b, 1, 3), (c, 3, 5)])  # the embedding alone, then two layers, then a layer and the head
        text, _ = stream_tokens(server, N)
        assert text == pkg.tokenizer.decode(expected)
        turns = play_turns(server, 12)
        for messages, got in turns:
            assert got == reference_tokens(pkg, messages, 12)
        assert server.status()["prefix_cache"]["hits"] >= len(turns) - 1  # later turns started from cached blocks
        rebalance(server, [(a, 0, 2), (b, 2, 4), (c, 4, 5)])  # the head alone
        moved = {}

        def on_chunk(n):  # mid-stream, the embedding goes to c, which holds no position of this sequence
            if n == 12 and not moved:
                moved.update(rebalance(server, [(c, 0, 1), (a, 1, 3), (b, 3, 5)]))

        text, _ = stream_tokens(server, N, on_chunk)
        assert moved and server.status()["plan"]["stages"][0]["worker"] == c
        assert text == pkg.tokenizer.decode(expected)
