"""benchmarks/serve.py's arithmetic and llama.cpp command lines (``edgepipe.bench.serving``): the
figures its table shows and the RPC pipeline it starts, without a server."""

from __future__ import annotations

import pytest

from edgepipe.bench.serving import (COMPARISONS, Snapshot, Stream, comparison_rows, decode_breakdown, level_counters, llama_server_argv, median_breakdown, median_of,
                                    parse_metrics, ratio, summarize)

pytestmark = pytest.mark.pure


def test_level_figures_aggregate_over_the_whole_span_per_stream_from_first_token():
    # two streams: sent at 0 and 0.5, first tokens at 1 and 2, last at 5 and 4; 9 and 5 tokens
    s = summarize([Stream(0.0, 1.0, 5.0, 9), Stream(0.5, 2.0, 4.0, 5)])
    assert s["aggregate_tok_s"] == round(14 / 5.0, 2)  # all tokens over first send -> last token
    assert s["per_stream_tok_s"] == 2.0  # (9-1)/4 = 2 and (5-1)/2 = 2
    assert s["ttft_median_s"] == 1.25 and s["ttft_max_s"] == 1.5
    assert Stream(0, 1, 1, 1).decode_tok_s == 0.0  # one token: no decode rate, no division by zero


def test_medians_over_reps_and_the_ratio_row():
    reps = [{"clients": 4, "aggregate_tok_s": a, "per_stream_tok_s": 1.0, "ttft_median_s": t, "ttft_max_s": t}
            for a, t in ((30.0, 0.5), (10.0, 0.9), (20.0, 0.7))]
    m = median_of(reps)
    assert m["aggregate_tok_s"] == 20.0 and m["ttft_median_s"] == 0.7 and m["aggregate_tok_s_reps"] == [30.0, 10.0, 20.0]
    assert ratio(27.3, 30.4) == 0.9 and ratio(1.0, 0) is None and ratio(None, 2.0) is None
    theirs = {**m, "aggregate_tok_s": 25.0}
    row = comparison_rows({4: m}, {4: theirs}, "x")[0]
    assert row.startswith("| x, 4 clients | 20.0 | 25.0 | **0.80x** |")
    assert comparison_rows({1: m}, {}, "y")[0].startswith("| y, 1 client | 20.0 | – | **–x** |")


def test_rpc_pipeline_offloads_every_layer_evenly_over_the_servers_in_order():
    argv = llama_server_argv("llama-server", "m.gguf", 9000, 1, 16, 8192, rpc=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    assert argv[argv.index("--rpc") + 1] == "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    assert argv[argv.index("-ts") + 1] == "1,1,1" and argv[argv.index("-sm") + 1] == "layer"
    assert int(argv[argv.index("-ngl") + 1]) >= 999 and argv[argv.index("-np") + 1] == "16" and argv[argv.index("-t") + 1] == "1"
    alone = llama_server_argv("llama-server", "m.gguf", 9000, 2, 16, 8192)
    assert "--rpc" not in alone and "-ngl" not in alone and alone[alone.index("-c") + 1] == "8192"


def test_the_pipeline_against_one_server_is_the_3_stage_pipeline_against_llama_server_alone():
    """issue 38: 16 streams through edgepipe's 3 stages against ``llama-server -np 16`` on the machine's 2 cores."""
    pipeline, one, both = COMPARISONS["pipeline"], COMPARISONS["server"], COMPARISONS["pipeline-server"]
    assert (both.workers, both.worker_threads) == (pipeline.workers, pipeline.worker_threads) == (3, 1)
    assert (both.llama_threads, both.rpc_servers) == (one.llama_threads, one.rpc_servers) == (2, 0)
    argv = llama_server_argv("llama-server", "m.gguf", 9000, both.llama_threads, 16, 16 * 512)
    assert "--rpc" not in argv and argv[argv.index("-np") + 1] == "16" and argv[argv.index("-t") + 1] == "2"
    assert len({c.label for c in COMPARISONS.values()}) == len(COMPARISONS)  # each kind its own rows


def _snap(tokens, wall, before, compute, calls, coord, workers):
    text = (f"edgepipe_tokens_generated_total {tokens}\nedgepipe_step_wall_seconds_total {wall}\n"
            f"edgepipe_coordinator_seconds_total {before}\n"
            f'edgepipe_stage_compute_seconds_sum{{worker="a"}} {compute / 2}\nedgepipe_stage_compute_seconds_sum{{worker="b"}} {compute / 2}\n'
            f'edgepipe_stage_compute_seconds_count{{worker="a"}} {calls}\n# HELP x y\n')
    return Snapshot(parse_metrics(text), coord, workers)


def test_decode_breakdown_cancels_the_prefill_by_the_long_minus_the_short_request():
    # prefill (shared by both requests): 1 token, 0.5 s wall, 0.4 s compute; a decode step: 30 ms wall,
    # 1 ms before send, 25 ms compute; the client sees 32 ms a token; coordinator CPU 3 ms, workers' 27 ms a token
    def req(decode_tokens, t0):
        a = _snap(t0, t0, t0, t0, t0, t0, t0)
        n = decode_tokens
        b = _snap(t0 + 1 + n, t0 + 0.5 + 0.030 * n, t0 + 0.01 + 0.001 * n, t0 + 0.4 + 0.025 * n, t0 + 1 + n,
                  t0 + 0.2 + 0.003 * n, t0 + 0.45 + 0.027 * n)
        return a, b, 0.032 * (n - 0)  # client first->last: the decode tokens' gaps

    b = decode_breakdown(req(63, 10.0), req(7, 100.0), stages=3)
    assert b["tokens"] == 56
    assert b["step_ms"] == pytest.approx(30.0, abs=0.01) and b["compute_ms"] == pytest.approx(25.0, abs=0.01)
    assert b["before_send_ms"] == pytest.approx(1.0, abs=0.01) and b["transit_ms"] == pytest.approx(4.0, abs=0.01)
    assert b["hops"] == 4 and b["per_hop_ms"] == pytest.approx(1.0, abs=0.01)
    assert b["between_steps_ms"] == pytest.approx(2.0, abs=0.01) and b["coordinator_cpu_ms"] == pytest.approx(3.0, abs=0.01)
    assert b["workers_cpu_beyond_compute_ms"] == pytest.approx(2.0, abs=0.01) and b["stage_calls_per_token"] == 1.0
    assert decode_breakdown(req(63, 10.0), req(7, 100.0), stages=1, threads=2)["workers_cpu_beyond_compute_ms"] is None
    with pytest.raises(ValueError, match="no decode steps"):
        decode_breakdown(req(7, 0.0), req(7, 5.0), stages=1)


def test_level_counters_per_token_and_per_stage_call():
    a = Snapshot(parse_metrics("edgepipe_tokens_generated_total 10\nedgepipe_stage_compute_seconds_count{worker=\"a\"} 5\n"), 1.0, 2.0)
    text = ("edgepipe_tokens_generated_total 74\n"  # 64 tokens in 16 stage calls of 4 sequences, 0.8 s compute
            'edgepipe_stage_compute_seconds_count{worker="a"} 21\nedgepipe_stage_compute_seconds_sum{worker="a"} 0.8\n'
            'edgepipe_stage_batch_size_sum{worker="a"} 64\nedgepipe_time_per_output_token_seconds_sum 1.5\n'
            "edgepipe_time_per_output_token_seconds_count 60\n")
    c = level_counters(a, Snapshot(parse_metrics(text), 1.128, 3.28))
    assert c["tokens"] == 64 and c["stage_calls_per_token"] == 0.25 and c["batch_mean"] == 4.0
    assert c["compute_ms_per_call"] == 50.0 and c["decode_step_ms"] == 25.0
    assert c["coordinator_cpu_ms_per_token"] == 2.0 and c["workers_cpu_ms_per_token"] == 20.0
    assert level_counters(a, a) == {}


def test_breakdown_medians_keep_a_figure_that_is_none():
    m = median_breakdown([{"a": 1.0, "b": None}, {"a": 3.0, "b": None}, {"a": 2.0, "b": None}])
    assert m == {"a": 2.0, "b": None}
