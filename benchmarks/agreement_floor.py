"""How far arithmetic alone moves greedy top-1: llama.cpp against itself, edgepipe against both.

    python benchmarks/agreement_floor.py                 # bundled SmolLM2-135M Q4_1
    python benchmarks/agreement_floor.py --model x.gguf  # any GGUF that edgepipe and llama.cpp both run
    python benchmarks/agreement_floor.py --model x.gguf --precision gguf  # the GGUF kernel library's form

Writes `benchmarks/results/agreement_floor.json` and `.md`.

llama.cpp greedily continues the three chat prompts of `decode.py`; every engine below is then
teacher-forced through those sequences (the same positions as `decode.py`'s agreement) and the
argmax at each position is compared:

- llama.cpp as shipped (K/V in f16) and with an f32 KV cache;
- edgepipe's stage graph as built (``base``), and variants of it made here, in memory, for
  measurement only (none is a product setting):
  ``fp32-activations`` (MatMulNBits accuracy level 0: no int8 activation quantization),
  ``q8_1-sums`` (each block-minimum term multiplies llama.cpp's Q8_1 ``s``: the block's
  activations quantized to int8 with scale amax/127, summed, times the scale, rounded to fp16),
  ``f16-kv`` (GroupQueryAttention on f16 q/k/v and an f16 cache, as llama.cpp keeps it),
  ``q8_1-sums+f16-kv``, ``llama-q8`` (every MatMulNBits input quantized as llama.cpp quantizes it, Q8_1 per
  32 with an fp16 scale, products in fp32, and the minimum term on llama.cpp's `s`), ``llama-attn`` (rotary
  outside attention with ggml's f32 tables, q/k/v rounded to f16), ``llama-q8+llama-attn``,
  ``llama-attn+explicit-attn`` (attention as plain ONNX ops instead of GroupQueryAttention, no
  rounding change: how much accumulation order alone moves) and ``llama-q8+llama-attn+llama-softmax``
  (the same, with the softmax rounded to f16 before ×V as llama.cpp's ``mul_mat(v, kq)`` does).

Beside each row: llama.cpp's own top-1 lead over its runner-up at every position that row flips.

The weights are the same in every row (edgepipe's dequantized blocks equal llama.cpp's bit for
bit); only rounding differs. Both engines run in this one process, one thread each for llama.cpp
and two for edgepipe (thread counts do not change either engine's results).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgepipe.bench.decode_engines import AGREE_PROMPTS, matches
from edgepipe.bench.machine import Conditions, package_version as version
from edgepipe.bench.results import write_results
from edgepipe.model.store import bundled_gguf, home_dir, resolve
from edgepipe.runtime import stage_runner

VARIANTS = ["base", "fp32-activations", "q8_1-sums", "f16-kv", "q8_1-sums+f16-kv", "llama-q8", "llama-attn", "llama-q8+llama-attn",
            "llama-attn+explicit-attn", "llama-q8+llama-attn+llama-softmax"]


def llama_cpp_runs(model: Path, prompts: list[list[int]], n: int) -> tuple[list, list, list, list]:
    """llama.cpp's greedy continuations, its teacher-forced argmax with f16 and f32 KV caches, and the
    top-1 minus top-2 logit of its default run at each of those positions."""
    import llama_cpp

    def engine(f32_kv: bool):
        kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_kv else {}
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=max(map(len, prompts)) + n + 8, n_threads=1, n_threads_batch=1,
                              verbose=False, **kv)
        vocab = llm.n_vocab()
        logits = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))  # noqa: E731
        return llm, lambda: int(logits().argmax()), logits

    llm, argmax, logits = engine(False)
    sequences = []
    for p in prompts:
        llm.reset()
        llm.eval(p)
        tokens = [argmax()]
        while len(tokens) < n:
            llm.eval([tokens[-1]])
            tokens.append(argmax())
        sequences.append((p, tokens))

    gaps: list[list[float]] = []

    def forced(llm, argmax, logits, record: bool = False) -> list[list[int]]:
        out = []
        for p, cont in sequences:
            llm.reset()
            predicted, gap = [], []
            for step in [p] + [[t] for t in cont[:-1]]:
                llm.eval(step)
                predicted.append(argmax())
                if record:
                    top2 = np.partition(logits(), -2)[-2:]
                    gap.append(float(top2[1] - top2[0]))
            out.append(predicted)
            gaps.append(gap) if record else None
        return out

    default = forced(llm, argmax, logits, record=True)
    del llm
    return sequences, default, forced(*engine(True)), gaps


def q8_1_sums(g: onnx.GraphProto) -> None:
    """Each block sum of a minimum chain (``ReduceSum`` over ``[.., blocks, size]``) becomes llama.cpp's Q8_1 ``s``."""
    g.initializer.extend([numpy_helper.from_array(np.array(127, np.float32), "q8_127"),
                          numpy_helper.from_array(np.array([-1], np.int64), "q8_last")])
    nodes = []
    for i, nd in enumerate(g.node):
        if nd.op_type == "ReduceSum" and any(x.endswith(".last") for x in nd.input):
            b, p = nd.input[0], f"q8s{i}_"
            nodes += [helper.make_node("Abs", [b], [p + "abs"]), helper.make_node("ReduceMax", [p + "abs", "q8_last"], [p + "amax"], keepdims=1),
                      helper.make_node("Div", [p + "amax", "q8_127"], [p + "d"]), helper.make_node("Div", ["q8_127", p + "amax"], [p + "id"]),
                      helper.make_node("Mul", [b, p + "id"], [p + "scaled"]), helper.make_node("Round", [p + "scaled"], [p + "q"]),
                      helper.make_node("ReduceSum", [p + "q", "q8_last"], [p + "isum"], keepdims=1),
                      helper.make_node("Mul", [p + "d", p + "isum"], [p + "s"]),
                      helper.make_node("Cast", [p + "s"], [p + "s16"], to=TensorProto.FLOAT16),
                      helper.make_node("Cast", [p + "s16"], [p + "s32"], to=TensorProto.FLOAT),
                      helper.make_node("Squeeze", [p + "s32", "q8_last"], [nd.output[0]])]
        else:
            nodes.append(nd)
    del g.node[:]
    g.node.extend(nodes)


def replace_attention(g: onnx.GraphProto, rewrite) -> None:
    """Every GroupQueryAttention node becomes the nodes ``rewrite(node)`` returns, in graph order."""
    nodes: list = []
    for nd in g.node:
        nodes += rewrite(nd) if nd.op_type == "GroupQueryAttention" else [nd]
    del g.node[:]
    g.node.extend(nodes)


def f16_kv(g: onnx.GraphProto, base_dir: Path) -> None:
    """GroupQueryAttention on f16 q/k/v, rotary tables and cache; its output cast back to f32."""
    inits = {t.name: t for t in g.initializer}

    def rewrite(nd) -> list:
        nodes = []
        for j in (0, 1, 2):
            if nd.input[j]:
                nodes.append(helper.make_node("Cast", [nd.input[j]], [nd.input[j] + "_f16"], to=TensorProto.FLOAT16))
                nd.input[j] += "_f16"
        for j in (7, 8):  # cos/sin caches (shared by every layer: converted once)
            t = inits.get(nd.input[j]) if len(nd.input) > j else None
            if t is not None and t.data_type == TensorProto.FLOAT:
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t, base_dir=str(base_dir)).astype(np.float16), t.name))
        out = nd.output[0]
        nd.output[0] = out + "_f16"
        return nodes + [nd, helper.make_node("Cast", [out + "_f16"], [out], to=TensorProto.FLOAT)]

    replace_attention(g, rewrite)
    for value in list(g.input) + list(g.output):
        if value.name.startswith(("past_key", "past_value", "present_key", "present_value")):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16


def llama_q8(g: onnx.GraphProto, base_dir: Path) -> None:
    """Every MatMulNBits reads its activations as llama.cpp quantizes them for Q4_0/Q4_1/Q5_x/Q8_0
    weights (``quantize_row_q8_1``): per block of 32, ``q = round(x * 127/amax)``, value ``q * fp16(amax/127)``,
    and MatMulNBits multiplies those in fp32 (accuracy level 0). A block-minimum chain then adds
    ``m * s`` with llama.cpp's ``s = fp16(amax/127 * sum(q))``, and gives back the ``8 * scale`` part of its
    offset on the exact block sums, so the total is llama.cpp's ``d_w d_a sum(q_w q_a) + m s`` per block."""
    inits = {t.name: t for t in g.initializer}
    g.initializer.extend([numpy_helper.from_array(np.array(127, np.float32), "l8_127"),
                          numpy_helper.from_array(np.array(0, np.float32), "l8_0"),
                          numpy_helper.from_array(np.array([-1], np.int64), "l8_last"),
                          numpy_helper.from_array(np.array([-1, 32], np.int64), "l8_blocks")])
    quantized: dict[str, tuple[str, str, str]] = {}  # activation -> (fake-quantized, exact block sums, llama's s)
    chain_of: dict[str, str] = {}  # a chain ReduceSum's output -> its activation

    def quantize(x: str, out: list) -> tuple[str, str, str]:
        if x not in quantized:
            p = f"l8_{len(quantized)}_"
            out += [helper.make_node("Shape", [x], [p + "lead"], end=-1),
                    helper.make_node("Concat", [p + "lead", "l8_blocks"], [p + "bshape"], axis=0),
                    helper.make_node("Reshape", [x, p + "bshape"], [p + "b"]),
                    helper.make_node("Abs", [p + "b"], [p + "abs"]),
                    helper.make_node("ReduceMax", [p + "abs", "l8_last"], [p + "amax"], keepdims=1),
                    helper.make_node("Div", [p + "amax", "l8_127"], [p + "d"]),
                    helper.make_node("Div", ["l8_127", p + "amax"], [p + "id_raw"]),
                    helper.make_node("Greater", [p + "amax", "l8_0"], [p + "nz"]),
                    helper.make_node("Where", [p + "nz", p + "id_raw", "l8_0"], [p + "id"]),
                    helper.make_node("Mul", [p + "b", p + "id"], [p + "scaled"]),
                    helper.make_node("Round", [p + "scaled"], [p + "q"]),
                    helper.make_node("Cast", [p + "d"], [p + "d16h"], to=TensorProto.FLOAT16),
                    helper.make_node("Cast", [p + "d16h"], [p + "d16"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", [p + "q", p + "d16"], [p + "aqb"]),
                    helper.make_node("Shape", [x], [p + "shape"]),
                    helper.make_node("Reshape", [p + "aqb", p + "shape"], [p + "aq"]),
                    helper.make_node("ReduceSum", [p + "q", "l8_last"], [p + "isum"], keepdims=1),
                    helper.make_node("Mul", [p + "d16", p + "isum"], [p + "bsum_k"]),
                    helper.make_node("Squeeze", [p + "bsum_k", "l8_last"], [p + "bsum"]),
                    helper.make_node("Mul", [p + "d", p + "isum"], [p + "s_k"]),
                    helper.make_node("Cast", [p + "s_k"], [p + "s16"], to=TensorProto.FLOAT16),
                    helper.make_node("Cast", [p + "s16"], [p + "s32"], to=TensorProto.FLOAT),
                    helper.make_node("Squeeze", [p + "s32", "l8_last"], [p + "s"])]
            quantized[x] = (p + "aq", p + "bsum", p + "s")
        return quantized[x]

    reshaped = {nd.output[0]: nd.input[0] for nd in g.node if nd.op_type == "Reshape"}
    nodes: list = []
    for nd in g.node:
        if nd.op_type == "MatMulNBits":
            nd.input[0] = quantize(nd.input[0], nodes)[0]
            for a in nd.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
            nodes.append(nd)
        elif nd.op_type == "ReduceSum" and any(x.endswith(".last") for x in nd.input):
            x = reshaped[nd.input[0]]
            chain_of[nd.output[0]] = x
            nodes.append(helper.make_node("Identity", [quantize(x, nodes)[2]], [nd.output[0]]))
        elif nd.op_type == "MatMul" and nd.input[0] in chain_of and nd.input[1].endswith(".offsets_t"):
            unit = nd.input[1][: -len(".offsets_t")]
            offsets = numpy_helper.to_array(inits[nd.input[1]], base_dir=str(base_dir))
            scales = numpy_helper.to_array(inits[unit + ".scales"], base_dir=str(base_dir)).reshape(offsets.shape[1], offsets.shape[0]).T
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(8 * scales, np.float32), unit + ".l8_eight_scales_t"))
            _, bsum, s = quantized[chain_of[nd.input[0]]]
            out, p = nd.output[0], unit + ".l8_"
            nd.output[0] = p + "main"
            nodes += [nd, helper.make_node("Sub", [bsum, s], [p + "diff"]),
                      helper.make_node("MatMul", [p + "diff", unit + ".l8_eight_scales_t"], [p + "back"]),
                      helper.make_node("Add", [p + "main", p + "back"], [out])]
        else:
            nodes.append(nd)
    del g.node[:]
    g.node.extend(nodes)


def llama_rotary_tables(theta_base: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin as ggml's rope cache builds them: ``theta *= powf(base, -2/n_dims)`` step by step in f32."""
    theta_scale = np.float32(np.float64(theta_base) ** np.float64(np.float32(-2.0) / np.float32(head_dim)))
    theta = np.arange(positions, dtype=np.float32)
    cos = np.empty((positions, head_dim // 2), np.float32)
    sin = np.empty_like(cos)
    for i in range(head_dim // 2):
        cos[:, i] = np.cos(theta.astype(np.float64)).astype(np.float32)
        sin[:, i] = np.sin(theta.astype(np.float64)).astype(np.float32)
        theta = (theta * theta_scale).astype(np.float32)
    return cos, sin


def llama_attn(g: onnx.GraphProto, theta_base: float, base_dir: Path) -> None:
    """Rotary outside GroupQueryAttention with ggml's f32 tables, then q, k and v rounded to f16 (llama.cpp
    keeps K and V in an f16 cache and converts Q to f16 for its K*Q product; the softmax's f16 rounding
    before *V stays inside GroupQueryAttention and is not reproduced). One sequence per run."""
    inits = {t.name: t for t in g.initializer}
    cos = numpy_helper.to_array(inits["cos_cache"], base_dir=str(base_dir))
    lcos, lsin = llama_rotary_tables(theta_base, 2 * cos.shape[1], cos.shape[0])
    g.initializer.extend([numpy_helper.from_array(lcos, "la_cos"), numpy_helper.from_array(lsin, "la_sin"),
                          numpy_helper.from_array(np.array([1], np.int64), "la_one"),
                          numpy_helper.from_array(np.array([0], np.int64), "la_zero"),
                          numpy_helper.from_array(np.array([2], np.int64), "la_two")])
    first = True

    def rewrite(nd) -> list:
        nonlocal first
        nodes = []
        attrs = {a.name: helper.get_attribute_value(a) for a in nd.attribute}
        heads, kv_heads, dim = attrs["num_heads"], attrs["kv_num_heads"], 2 * cos.shape[1]
        if first:  # position of the first new token: seqlens_k + 1 - S (batch of one)
            nodes += [helper.make_node("Shape", [nd.input[0]], ["la_shape"]),
                      helper.make_node("Slice", ["la_shape", "la_one", "la_two"], ["la_S"]),
                      helper.make_node("Cast", [nd.input[5]], ["la_seqlens"], to=TensorProto.INT64),
                      helper.make_node("Slice", ["la_seqlens", "la_zero", "la_one"], ["la_last"]),
                      helper.make_node("Add", ["la_last", "la_one"], ["la_total"]),
                      helper.make_node("Sub", ["la_total", "la_S"], ["la_start"])]
            first = False
        p = nd.output[0] + ".la_"
        g.initializer.append(numpy_helper.from_array(np.array([heads * dim, kv_heads * dim, kv_heads * dim], np.int64), p + "split"))
        nodes.append(helper.make_node("Split", [nd.input[0], p + "split"], [p + "q", p + "k", p + "v"], axis=-1))
        for name, n in (("q", heads), ("k", kv_heads)):
            nodes.append(helper.make_node("RotaryEmbedding", [p + name, "la_start", "la_cos", "la_sin"], [p + name + "r"],
                                          domain="com.microsoft", interleaved=int(attrs.get("rotary_interleaved", 0)), num_heads=n))
        for name, src in (("q", p + "qr"), ("k", p + "kr"), ("v", p + "v")):
            nodes += [helper.make_node("Cast", [src], [p + name + "16"], to=TensorProto.FLOAT16),
                      helper.make_node("Cast", [p + name + "16"], [p + name + "32"], to=TensorProto.FLOAT)]
        inputs = [p + "q32", p + "k32", p + "v32"] + list(nd.input[3:7])
        kept = [a for a in nd.attribute if a.name != "do_rotary"]
        gqa = helper.make_node("GroupQueryAttention", inputs, list(nd.output), domain=nd.domain, name=nd.name)
        gqa.attribute.extend(kept)
        return nodes + [gqa]

    replace_attention(g, rewrite)


def llama_softmax(g: onnx.GraphProto, round_probs: bool = True) -> None:
    """Each GroupQueryAttention (after ``llama_attn``) becomes explicit ops, so that the softmax can be
    rounded to f16 before the product with V, as llama.cpp's ``mul_mat(v, kq)`` converts it: the new K/V
    written into the cache at the sequence's position, Q·Kᵀ times the scale, a causal mask, softmax
    in f32, ×V. One sequence per run (batch of one); the cache keeps its capacity."""
    c = lambda name, value: g.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))  # noqa: E731
    c("ls_two_ax", [2]), c("ls_max", [np.iinfo(np.int64).max]), c("ls_zero_s", 0), c("ls_one_s", 1), c("ls_zero1", [0])
    g.initializer.append(numpy_helper.from_array(np.array(-np.inf, np.float32), "ls_ninf"))
    dim = 2 * next(t for t in g.initializer if t.name == "la_cos").dims[1]
    first = True

    def rewrite(nd) -> list:
        nonlocal first
        nodes = []
        attrs = {a.name: helper.get_attribute_value(a) for a in nd.attribute}
        heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        q, k, v, past_k, past_v = nd.input[:5]
        out, present_k, present_v = nd.output[:3]
        p = out + ".ls_"
        if first:  # la_start / la_total / la_S come from llama_attn: [1] int64 each
            nodes += [helper.make_node("Squeeze", ["la_start"], ["ls_start"]), helper.make_node("Squeeze", ["la_total"], ["ls_total"]),
                      helper.make_node("Range", ["ls_start", "ls_total", "ls_one_s"], ["ls_rows"]),
                      helper.make_node("Unsqueeze", ["ls_rows", "ls_one1"], ["ls_rows_col"]),
                      helper.make_node("Range", ["ls_zero_s", "ls_total", "ls_one_s"], ["ls_cols"]),
                      helper.make_node("Greater", ["ls_cols", "ls_rows_col"], ["ls_future"])]
            c("ls_one1", [1])
            first = False
        for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            c(p + name + "_shape", [1, -1, n, dim])
        src = {"q": q, "k": k, "v": v}
        for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            nodes += [helper.make_node("Reshape", [src[name], p + name + "_shape"], [p + name + "4"]),
                      helper.make_node("Transpose", [p + name + "4"], [p + name + "h"], perm=[0, 2, 1, 3])]
        for name, past, present in (("k", past_k, present_k), ("v", past_v, present_v)):
            nodes += [helper.make_node("Slice", [past, "ls_zero1", "la_start", "ls_two_ax"], [p + name + "_before"]),
                      helper.make_node("Slice", [past, "la_total", "ls_max", "ls_two_ax"], [p + name + "_after"]),
                      helper.make_node("Concat", [p + name + "_before", p + name + "h", p + name + "_after"], [present], axis=2),
                      helper.make_node("Slice", [present, "ls_zero1", "la_total", "ls_two_ax"], [p + name + "_used"])]
        group = heads // kv_heads
        c(p + "grouped", [1, kv_heads, -1, 0]), c(p + "tiles", [group, 1])
        c(p + "heads", [1, heads, -1, 0]), c(p + "flat", [1, 0, -1])
        nodes += [helper.make_node("Reshape", [p + "qh", p + "grouped"], [p + "qg"]),  # [1, kvh, group*S, D]
                  helper.make_node("Transpose", [p + "k_used"], [p + "kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [p + "qg", p + "kt"], [p + "raw"])]
        scale = attrs.get("scale") or 0.0
        g.initializer.append(numpy_helper.from_array(np.array(scale if scale else 1 / np.sqrt(dim), np.float32), p + "scale"))
        nodes += [helper.make_node("Mul", [p + "raw", p + "scale"], [p + "scaled"]),
                  helper.make_node("Tile", ["ls_future", p + "tiles"], [p + "future"]),  # rows are (group, position)
                  helper.make_node("Where", [p + "future", "ls_ninf", p + "scaled"], [p + "masked"]),
                  helper.make_node("Softmax", [p + "masked"], [p + "probs"], axis=-1),
                  helper.make_node("Cast", [p + "probs"], [p + "probs16"], to=TensorProto.FLOAT16 if round_probs else TensorProto.FLOAT),
                  helper.make_node("Cast", [p + "probs16"], [p + "probs32"], to=TensorProto.FLOAT),
                  helper.make_node("MatMul", [p + "probs32", p + "v_used"], [p + "ctx"]),  # [1, kvh, group*S, D]
                  helper.make_node("Reshape", [p + "ctx", p + "heads"], [p + "ctx_h"]),
                  helper.make_node("Transpose", [p + "ctx_h"], [p + "ctx_t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [p + "ctx_t", p + "flat"], [out])]
        return nodes

    replace_attention(g, rewrite)


def variant_graph(base: onnx.ModelProto, name: str, base_dir: Path, rope_base: float) -> onnx.ModelProto:
    m = copy.deepcopy(base)
    for part in name.split("+"):
        if part == "fp32-activations":
            for nd in m.graph.node:
                for a in nd.attribute:
                    if nd.op_type == "MatMulNBits" and a.name == "accuracy_level":
                        a.i = 0
        elif part == "q8_1-sums":
            q8_1_sums(m.graph)
        elif part == "f16-kv":
            f16_kv(m.graph, base_dir)
        elif part == "llama-q8":
            llama_q8(m.graph, base_dir)
        elif part == "llama-attn":
            llama_attn(m.graph, rope_base, base_dir)
        elif part in ("llama-softmax", "explicit-attn"):
            llama_softmax(m.graph, round_probs=part == "llama-softmax")
        elif part != "base":
            raise SystemExit(f"unknown variant {part!r} (known: {', '.join(VARIANTS)})")
    return m


def edgepipe_forced(graph: Path, sequences: list) -> list[list[int]]:
    """Teacher-forced argmax at every position (the runner keeps its KV in the graph's dtype: the
    f16-kv variants declare an f16 cache, the gguf form's KvAttention has one)."""
    runner = stage_runner.StageRunner(graph, threads=2)
    greedy, out = stage_runner.SamplingBatch.greedy(1), []
    for i, (prompt, cont) in enumerate(sequences):
        seq = f"agree{i}"
        predicted = [int(runner.run(seq, np.array([prompt], np.int64), greedy)[0])]
        for t in cont[:-1]:
            predicted.append(int(runner.run(seq, np.array([[t]], np.int64), greedy)[0]))
        runner.drop(seq)
        out.append(predicted)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--tokens", type=int, default=100, help="continuation tokens per prompt (default 100, as decode.py)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated (default: {','.join(VARIANTS)})")
    ap.add_argument("--precision", default="native", choices=["native", "gguf"],
                    help="edgepipe's form of the file: native (MatMulNBits) or gguf (the kernel library; its graphs have "
                         "no MatMulNBits, so only variants that leave the products alone apply: base, f16-kv, llama-attn, ...)")
    ap.add_argument("--home", help="edgepipe home (default $EDGEPIPE_HOME or the user data dir)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.precision == "gguf" and any(p in ("fp32-activations", "q8_1-sums", "llama-q8") for v in args.variants.split(",") for p in v.split("+")):
        if args.variants != ",".join(VARIANTS):
            sys.exit("--precision gguf: fp32-activations, q8_1-sums and llama-q8 rewrite MatMulNBits nodes, which its graphs do not have")
        args.variants = "base"
    model = Path(args.model) if args.model else bundled_gguf()
    run = Conditions.start()
    pkg = resolve(str(model), args.precision, home_dir(args.home))
    tok = pkg.tokenizer
    prompts = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in AGREE_PROMPTS]
    sequences, llama_default, llama_f32, gaps = llama_cpp_runs(model, prompts, args.tokens)
    flat_gaps = [g for seq in gaps for g in seq]

    def flipped_gaps(predicted: list[list[int]]) -> list[float]:
        """llama.cpp's top-2 gaps at the positions where ``predicted`` differs from its default argmax."""
        return sorted(g for pa, pb, ga in zip(predicted, llama_default, gaps) for x, y, g in zip(pa, pb, ga) if x != y)

    rows = [{"engine": "llama.cpp, f32 KV cache", "vs_llama_cpp": matches(llama_f32, llama_default)[0], "vs_llama_cpp_f32_kv": None,
             "flipped_gaps": flipped_gaps(llama_f32)}]
    graph = pkg.blob(pkg.stage_graph(0, len(pkg.manifest.units)))
    base = onnx.load(str(graph), load_external_data=False)
    for name in args.variants.split(","):
        path = graph.parent / f"agreement-floor-{name}.onnx"  # beside the graph: its weights are external blobs there
        try:
            onnx.save(variant_graph(base, name, graph.parent, float(pkg.manifest.config["rope_theta"])), str(path))
            predicted = edgepipe_forced(path, sequences)
        finally:
            path.unlink(missing_ok=True)
        rows.append({"engine": f"edgepipe {name}", "vs_llama_cpp": matches(predicted, llama_default)[0],
                     "vs_llama_cpp_f32_kv": matches(predicted, llama_f32)[0], "predicted": predicted,
                     "flipped_gaps": flipped_gaps(predicted)})
        print(f"{rows[-1]['engine']}: {rows[-1]['vs_llama_cpp']} / {rows[-1]['vs_llama_cpp_f32_kv']}", flush=True)
    base_rows = [r for r in rows if r["engine"] == "edgepipe base"]
    for r in rows:
        r["vs_edgepipe_base"] = matches(r["predicted"], base_rows[0]["predicted"])[0] if base_rows and "predicted" in r else None
    positions = sum(len(c) for _, c in sequences)
    report = {**run.finish().as_dict(), "model": model.name, "precision": args.precision,
              "positions": positions, "near_ties": {str(t): sum(g < t for g in flat_gaps) for t in (0.05, 0.1, 0.25, 0.5)},
              "versions": {d: version(d) for d in ("onnxruntime", "llama_cpp_python")},
              "rows": [{k: v for k, v in r.items() if k != "predicted"} for r in rows]}
    stem = ("agreement_floor" if not args.model else f"agreement_floor-{model.stem}") + ("-gguf" if args.precision == "gguf" else "")
    pct = lambda n: "–" if n is None else f"{n / positions:.1%} ({n})"  # noqa: E731
    lines = [f"# Top-1 agreement under different arithmetic: {model.name}" + (" (edgepipe's gguf form: the kernel library)" if args.precision == "gguf" else ""), "",
             f"- date: {report['date']}; produced by `python benchmarks/agreement_floor.py`; onnxruntime {report['versions']['onnxruntime']}, "
             f"llama-cpp-python {report['versions']['llama_cpp_python']}",
             f"- {run.line()} (results are exact, not timings)",
             f"- {positions} teacher-forced positions along llama.cpp's greedy continuations of {len(AGREE_PROMPTS)} chat prompts; "
             "positions where llama.cpp's own top-1 leads its top-2 logit by less than "
             + ", ".join(f"{t}: {n}" for t, n in report["near_ties"].items()), "",
             "| engine | = llama.cpp (f16 KV, its default) | = llama.cpp f32 KV | = edgepipe as built | llama.cpp's top-2 gaps where it differs from llama.cpp's default |",
             "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['engine']} | {pct(r['vs_llama_cpp'])} | {pct(r['vs_llama_cpp_f32_kv'])} | {pct(r.get('vs_edgepipe_base'))} | "
              f"{', '.join(f'{g:.3f}' for g in r['flipped_gaps'])} |" for r in rows]
    write_results(stem, report, "\n".join(lines), args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
