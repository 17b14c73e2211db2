"""The kernel form's attention (`edgepipe.gguf.KvAttention`) against a numpy reference.

The op keeps the KV cache in fp16 (round to nearest even, numpy's ``astype(float16)``) and computes
scores, softmax and the weighted values in fp32: its cache must equal numpy's rounding bit for bit,
its output the float64 attention over the rounded cache within fp32 rounding, on every path this
CPU has (portable C included); a row's output must not depend on the rows beside it; the sliding
window, grouped heads, rotary (both layouts), scale and softcap follow GroupQueryAttention's
meaning; bad shapes and positions are one-line errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepipe.native import ATTENTION_OP, DOMAIN, gguf_kernel_library, native_library

F, H, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32
ISAS = ["portable", "avx2"]


@pytest.fixture(scope="module")
def library() -> str:
    path = gguf_kernel_library()
    assert path is not None, native_library().reason
    return str(path)


def tables(positions: int, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(positions)[:, None] * (10000.0 ** (-np.arange(pairs) / pairs))[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def session(library: str, heads: int, kv_heads: int, dim: int, threads: int = 1, pairs: int | None = None, **attrs) -> ort.InferenceSession:
    cos, sin = tables(64, dim // 2 if pairs is None else pairs)
    node = helper.make_node(ATTENTION_OP, ["qkv", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
                            ["out", "present_key", "present_value"], domain=DOMAIN, num_heads=heads, kv_num_heads=kv_heads, **attrs)
    kv = ["batch", kv_heads, "capacity", dim]
    graph = helper.make_graph([node], "kv_attention", [
        helper.make_tensor_value_info("qkv", F, ["batch", "seq", (heads + 2 * kv_heads) * dim]),
        helper.make_tensor_value_info("past_key", H, kv), helper.make_tensor_value_info("past_value", H, kv),
        helper.make_tensor_value_info("seqlens_k", I32, ["batch"]), helper.make_tensor_value_info("total", I32, [])],
        [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("present_key", H, kv),
         helper.make_tensor_value_info("present_value", H, kv)],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_in_place(sess, qkv, key, value, seqlens):
    """One step with past and present bound to the same buffers (as the stage runner binds them)."""
    binding = sess.io_binding()
    binding.bind_output("out", "cpu")  # first: get_outputs() follows the binding order
    k, v = ort.OrtValue.ortvalue_from_numpy(key), ort.OrtValue.ortvalue_from_numpy(value)
    binding.bind_ortvalue_input("past_key", k)
    binding.bind_ortvalue_output("present_key", k)
    binding.bind_ortvalue_input("past_value", v)
    binding.bind_ortvalue_output("present_value", v)
    binding.bind_cpu_input("qkv", qkv)
    binding.bind_cpu_input("seqlens_k", np.asarray(seqlens, np.int32))
    binding.bind_cpu_input("total", np.array(int(max(seqlens)) + 1, np.int32))
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy(), key, value


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [..., D] rotated with cos/sin [..., pairs] (the first 2 * pairs dims), in float32 as the op does."""
    x = x.astype(np.float32).copy()
    pairs = cos.shape[-1]
    i0 = np.arange(pairs) * 2 if interleaved else np.arange(pairs)
    i1 = i0 + 1 if interleaved else i0 + pairs
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = a * cos - b * sin
    x[..., i1] = b * cos + a * sin
    return x


def reference(qkv, key, value, seqlens, heads, kv_heads, rotary=True, interleaved=False, window=-1, scale=None, softcap=0.0, pairs=None):
    """(output, cache after) in numpy: new K/V rotated and rounded to fp16 into the cache, then
    float64 attention of each query over its visible keys of the rounded cache."""
    batch, seq, _ = qkv.shape
    dim = key.shape[3]
    cos, sin = tables(64, dim // 2 if pairs is None else pairs)
    key, value = key.copy(), value.copy()
    q = qkv[..., : heads * dim].reshape(batch, seq, heads, dim)
    k = qkv[..., heads * dim: (heads + kv_heads) * dim].reshape(batch, seq, kv_heads, dim)
    v = qkv[..., (heads + kv_heads) * dim:].reshape(batch, seq, kv_heads, dim)
    out = np.zeros((batch, seq, heads, dim))
    scale = 1 / np.sqrt(dim) if scale is None else scale
    for b in range(batch):
        past = seqlens[b] + 1 - seq
        pos = past + np.arange(seq)
        qb, kb = (rotate(q[b], cos[pos][:, None], sin[pos][:, None], interleaved), rotate(k[b], cos[pos][:, None], sin[pos][:, None], interleaved)) \
            if rotary else (q[b], k[b])
        key[b, :, pos] = kb.astype(np.float16)  # (b, pos) index first: [seq, kv_heads, dim]
        value[b, :, pos] = v[b].astype(np.float16)
        for i in range(seq):
            lo = max(0, pos[i] - window + 1) if window > 0 else 0
            for h in range(heads):
                g = h // (heads // kv_heads)
                s = key[b, g, lo: pos[i] + 1].astype(np.float64) @ qb[i, h].astype(np.float64) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                out[b, i, h] = p @ value[b, g, lo: pos[i] + 1].astype(np.float64) / p.sum()
    return out.reshape(batch, seq, heads * dim), key, value


def check(got, want):
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() / scale < 2e-5, f"off the reference by {np.abs(got - want).max() / scale:.2e}"


def random_case(rng, batch, seq, heads, kv_heads, dim, capacity, seqlens):
    qkv = rng.standard_normal((batch, seq, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    key = (rng.standard_normal((batch, kv_heads, capacity, dim))).astype(np.float16)
    value = (rng.standard_normal((batch, kv_heads, capacity, dim))).astype(np.float16)
    return qkv, key, value, np.asarray(seqlens, np.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", [
    dict(heads=12, kv_heads=2, dim=128, seq=1, seqlens=[40]),  # Qwen2.5-1.5B's shapes, a decode step
    dict(heads=14, kv_heads=2, dim=64, seq=5, seqlens=[9], interleaved=1),  # a prefill chunk after 5 positions
    dict(heads=4, kv_heads=4, dim=16, seq=3, seqlens=[30], window=7, softcap=20.0, scale=0.3),
    dict(heads=6, kv_heads=2, dim=32, seq=1, seqlens=[12], do_rotary=0, window=4),  # a window layer (rotated outside)
    dict(heads=8, kv_heads=2, dim=32, seq=2, seqlens=[5], pairs=8),  # rotary on the first 16 of 32 dims
])
def test_matches_numpy(library, isa, case, monkeypatch):
    monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
    case = dict(case)
    heads, kv_heads, dim, seq, seqlens = (case.pop(k) for k in ("heads", "kv_heads", "dim", "seq", "seqlens"))
    pairs = case.pop("pairs", None)
    attrs = {"do_rotary": 1, "rotary_interleaved": 0, **case}
    sess = session(library, heads, kv_heads, dim, pairs=pairs, **{k: v for k, v in attrs.items() if k != "window"},
                   **({"local_window_size": attrs["window"]} if "window" in attrs else {}))
    rng = np.random.default_rng(len(seqlens) * 100 + dim)
    qkv, key, value, lengths = random_case(rng, 1, seq, heads, kv_heads, dim, 48, seqlens)
    want, want_key, want_value = reference(qkv, key, value, lengths, heads, kv_heads, rotary=bool(attrs["do_rotary"]),
                                           interleaved=bool(attrs["rotary_interleaved"]), window=attrs.get("window", -1),
                                           scale=attrs.get("scale"), softcap=attrs.get("softcap", 0.0), pairs=pairs)
    got, key, value = run_in_place(sess, qkv, key, value, lengths)
    assert np.array_equal(key.view(np.uint16), want_key.view(np.uint16)), "the new keys are not numpy's fp16 rounding"
    assert np.array_equal(value.view(np.uint16), want_value.view(np.uint16)), "the new values are not numpy's fp16 rounding"
    check(got, want)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_gives_the_same_bits_alone_batched_and_on_two_threads(library, isa, monkeypatch):
    monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
    rng = np.random.default_rng(7)
    heads, kv_heads, dim = 12, 2, 128
    qkv, key, value, lengths = random_case(rng, 3, 1, heads, kv_heads, dim, 64, [20, 41, 7])
    batched, batched_key, _ = run_in_place(session(library, heads, kv_heads, dim, threads=2, do_rotary=1), qkv, key.copy(), value.copy(), lengths)
    alone = session(library, heads, kv_heads, dim, do_rotary=1)
    for row in range(3):
        got, row_key, _ = run_in_place(alone, qkv[row:row + 1], key[row:row + 1].copy(), value[row:row + 1].copy(), lengths[row:row + 1])
        assert np.array_equal(got[0], batched[row])
        assert np.array_equal(row_key[0], batched_key[row])
    want, _, _ = reference(qkv, key, value, lengths, heads, kv_heads)
    check(batched, want)


def test_a_decode_step_gives_the_prefills_bits(library):
    """Position p's output is the same whether it comes in a prefill of p + 1 positions or as a
    decode step after them (each query's arithmetic depends only on its visible keys)."""
    rng = np.random.default_rng(3)
    heads, kv_heads, dim = 8, 2, 64
    sess = session(library, heads, kv_heads, dim, do_rotary=1)
    qkv, key, value, _ = random_case(rng, 1, 6, heads, kv_heads, dim, 16, [5])
    prefill, _, _ = run_in_place(sess, qkv, key.copy(), value.copy(), [5])
    step_key, step_value = key.copy(), value.copy()
    run_in_place(sess, qkv[:, :5], step_key, step_value, [4])
    step, _, _ = run_in_place(sess, qkv[:, 5:], step_key, step_value, [5])
    assert np.array_equal(step[0, 0], prefill[0, 5])


def test_not_bound_in_place_present_is_past_plus_the_new_positions(library):
    rng = np.random.default_rng(5)
    sess = session(library, 4, 2, 16, do_rotary=1)
    qkv, key, value, lengths = random_case(rng, 1, 1, 4, 2, 16, 8, [3])
    out, present_key, present_value = sess.run(None, {"qkv": qkv, "past_key": key, "past_value": value, "seqlens_k": lengths,
                                                      "total": np.array(4, np.int32)})
    want, want_key, want_value = reference(qkv, key, value, lengths, 4, 2)
    assert np.array_equal(present_key.view(np.uint16), want_key.view(np.uint16))
    assert np.array_equal(present_value.view(np.uint16), want_value.view(np.uint16))
    check(out, want)


def test_bad_input_is_one_line(library):
    rng = np.random.default_rng(1)
    sess = session(library, 4, 2, 16, do_rotary=1)
    qkv, key, value, _ = random_case(rng, 1, 1, 4, 2, 16, 8, [3])
    with pytest.raises(Exception, match="seqlens_k must be at least seq - 1 and below the cache's capacity"):
        sess.run(None, {"qkv": qkv, "past_key": key, "past_value": value, "seqlens_k": np.array([8], np.int32), "total": np.array(9, np.int32)})
    with pytest.raises(Exception, match=r"KvAttention: shapes must be qkv \[B, S"):
        sess.run(None, {"qkv": qkv, "past_key": key, "past_value": value[:, :, :7].copy(), "seqlens_k": np.array([3], np.int32),
                        "total": np.array(4, np.int32)})
    with pytest.raises(Exception, match="num_heads must be a multiple of kv_num_heads"):
        session(library, 5, 2, 16)
