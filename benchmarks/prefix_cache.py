"""Prefix cache: a multi-turn chat with a ~1.5k-token system prompt, each turn resending the
whole history, on one cluster with the cache and one without (``serve --no-prefix-cache``),
side by side, with 1 and 3 local workers. Per turn: time to first token (the prefill step as
the coordinator timed it, from ``/metrics``, and the client's wall time of the whole answer),
the positions the cache supplied, and whether the tokens are identical.

    python -m benchmarks.prefix_cache [--turns 4] [--workers 1 3] [--max-tokens 24]
    # results to benchmarks/results/prefix_cache.md|json

Run from the repository root (``tests.harness`` starts the servers). Uses the bundled model
(int4) from the default edgepipe home (``$EDGEPIPE_HOME`` or the platform's data directory).
"""

from __future__ import annotations

import argparse
import time

from edgepipe.bench.cluster import Server
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import home_dir, resolve

TOPICS = ["the water cycle", "how bridges carry loads", "why the sky is blue", "what a compiler does", "how vaccines train the body",
          "the history of the printing press", "how a heat pump moves heat", "what makes a good password"]
QUESTIONS = ["Give me one sentence on the water cycle.", "Now one on bridges.", "Which of the two is older as a topic?",
             "Summarise our chat in five words.", "Thanks. One more fact about heat pumps?", "And passwords?"]


def system_prompt(tokenizer, target_tokens: int = 1500) -> str:
    """A long, fixed system prompt of about ``target_tokens`` tokens (deterministic)."""
    rules, i = [], 0
    while len(tokenizer.encode(" ".join(rules))) < target_tokens:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(f"Rule {i + 1}: when the user asks about {topic}, answer in plain words, cite no sources, keep it under "
                     f"forty words, and never repeat an earlier answer verbatim.")
        i += 1
    return "You are a helpful tutor. Follow these rules. " + " ".join(rules)


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{"))


def play(server: Server, system: str, turns: int, max_tokens: int) -> list[dict]:
    messages, out = [{"role": "system", "content": system}], []
    for q in QUESTIONS[:turns]:
        messages = messages + [{"role": "user", "content": q}]
        before = server.client.get("/metrics").text
        t0 = time.perf_counter()
        r = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                                              "return_token_ids": True})
        wall = time.perf_counter() - t0
        r.raise_for_status()
        after = server.client.get("/metrics").text
        body = r.json()
        choice = body["choices"][0]
        out.append({"prompt_tokens": body["usage"]["prompt_tokens"], "token_ids": choice["token_ids"],
                    "ttft_s": metric(after, "edgepipe_time_to_first_token_seconds_sum") - metric(before, "edgepipe_time_to_first_token_seconds_sum"),
                    "wall_s": wall,
                    "reused": int(metric(after, "edgepipe_prefix_reused_positions_total") - metric(before, "edgepipe_prefix_reused_positions_total"))})
        messages = messages + [{"role": "assistant", "content": choice["message"]["content"]}]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default="prefix_cache")
    args = ap.parse_args()
    home = home_dir(None)
    pkg = resolve("smollm2", "int4", home)
    system = system_prompt(pkg.tokenizer)
    run = Conditions.start()
    runs = {}
    for workers in args.workers:
        for mode, flags in (("cache", ()), ("no cache", ("--no-prefix-cache",))):
            with Server(home, workers=workers, args=("--precision", "int4", "--placement", "memory", *flags), timeout=300) as server:
                play(server, " ".join(reversed(system.split()))[:2000], 1, 4)  # warm-up on an unrelated prompt (first-call costs)
                runs[(workers, mode)] = play(server, system, args.turns, args.max_tokens)
                if mode == "cache":
                    runs[(workers, "status")] = server.status()["prefix_cache"]
    run.finish()
    rows, identical = [], True
    for workers in args.workers:
        on, off = runs[(workers, "cache")], runs[(workers, "no cache")]
        for i, (a, b) in enumerate(zip(on, off)):
            same = a["token_ids"] == b["token_ids"]
            identical &= same
            rows.append({"workers": workers, "turn": i + 1, "prompt_tokens": a["prompt_tokens"], "reused_positions": a["reused"],
                         "ttft_cache_s": round(a["ttft_s"], 3), "ttft_no_cache_s": round(b["ttft_s"], 3),
                         "speedup": round(b["ttft_s"] / a["ttft_s"], 2) if a["ttft_s"] > 0 else None,
                         "wall_cache_s": round(a["wall_s"], 3), "wall_no_cache_s": round(b["wall_s"], 3), "tokens_identical": same})
    report = {**run.as_dict(), "model": pkg.manifest.name, "max_tokens": args.max_tokens, "system_prompt_tokens": len(pkg.tokenizer.encode(system)), "rows": rows,
              "tokens_identical": identical, "cache_status": {str(w): runs[(w, "status")] for w in args.workers}}
    lines = ["# Prefix cache: multi-turn chat, time to first token with and without", "",
             f"- {run.line()} (a shared machine: compare the columns of one row, measured minutes apart)",
             f"- model {report['model']} (int4), local workers on this machine, `--placement memory`",
             f"- system prompt {report['system_prompt_tokens']} tokens; each turn resends the whole history and asks for "
             f"{args.max_tokens} tokens (greedy); one cluster with the cache, one with `--no-prefix-cache`, same turns",
             "- TTFT: the prefill step's wall time as the coordinator timed it (FORWARD out to the first token back, "
             "from `edgepipe_time_to_first_token_seconds` in /metrics); wall: the client's time for the whole answer",
             f"- tokens identical with and without the cache, every turn: **{'yes' if identical else 'NO'}**", "",
             "| workers | turn | prompt tokens | reused positions | TTFT cache (s) | TTFT no cache (s) | TTFT speedup | wall cache (s) | wall no cache (s) | tokens identical |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['turn']} | {r['prompt_tokens']} | {r['reused_positions']} | {r['ttft_cache_s']} | "
                     f"{r['ttft_no_cache_s']} | {r['speedup']}x | {r['wall_cache_s']} | {r['wall_no_cache_s']} | {'yes' if r['tokens_identical'] else 'no'} |")
    lines += ["", "Turn 1 finds nothing cached (its system prompt is new to the cluster): it computes every position and keeps the "
              "prompt's full blocks of 32 tokens. Each later turn reuses the blocks of the turn before (system prompt, earlier "
              "questions, and the answers as the chat template wrote them back), computing only the new tail.", ""]
    write_results(args.out, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
