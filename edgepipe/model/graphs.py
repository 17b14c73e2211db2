"""Per-unit ONNX graphs: token embedding, one decoder layer, head with in-graph sampling.

Every unit reads and writes tensors with fixed names, so that any contiguous range of units
can be merged into one stage graph by concatenation (see ``package.merge_units``):

    unit 0            input_ids [B, S] int64            -> hidden.1 [B, S, H]
                      (learned positions, GPT-2: position_ids [B, S] int64 too; its rows are added)
    unit u (layer)    hidden.u [B, S, H]                -> hidden.{u+1} [B, S, H]
                      past_key.u / past_value.u [B, kvH, C, D] -> present_key.u / present_value.u
                      seqlens_k [B] int32, total_sequence_length [] int32 (shared)
                      a sliding-window layer instead: past_key.u [B, kvH, window_W, D] (only its
                      window), position_ids [B, S] int64, window_seqlens_k, window_total_sequence_length
    unit L+1 (head)   hidden.{L+1} [B, S, H], do_sample [] bool, temperature/top_p/uniform [B]
                      float, top_k [B] int64, logit_adjust [B|1, V] float, num_top [1] int64,
                      prompt_targets [B, S|0] int64  -> next_token [B] int64, token_logprob [B],
                      top_ids/top_logprobs [B, N], prompt_logprobs [B, S|0],
                      prompt_top_ids/prompt_top_logprobs [B, S|0, N]   (see ``head_unit``)

Attention is ONNX Runtime's GroupQueryAttention with rotary inside and past/present sharing
one buffer of capacity C, so decode appends to the KV cache in place instead of copying it. The
kernel form (weights as the GGUF's blocks, run by the native library) uses the library's
``KvAttention`` instead: the same inputs and meaning, its KV cache in fp16 (``past_key.u`` float16).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..native import ATTENTION_OP as KV_ATTENTION
from ..native import DOMAIN as GGUF_DOMAIN
from ..native import GATHER_OP as GGUF_GATHER
from ..native import GGML_TYPE_IDS
from ..native import MATMUL_OP as GGUF_MATMUL
from .config import ModelConfig
from .weights import BlockQuantized, Stored, StoredBlocks, StoredGGUF, Weight

OPSET = 21
IR_VERSION = 10  # the newest ONNX Runtime 1.32 and onnxruntime-web 1.30 both load
MS = "com.microsoft"

FLOAT, INT64, INT32, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL
FLOAT16 = TensorProto.FLOAT16
SAMPLING_INPUTS = ("do_sample", "temperature", "top_k", "top_p", "uniform", "min_p")
HEAD_CONTROL_INPUTS = ("logit_adjust", "num_top", "prompt_targets")
HEAD_LOGPROB_OUTPUTS = ("token_logprob", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs")
MAX_TOP_LOGPROBS = 20
# Bumped whenever a unit graph changes in a way an existing package must be rebuilt for
# (importer.import_model re-imports a package whose manifest records another version).
# 2: head with logit_adjust / logprob outputs / prompt logprobs. 3: a lone row's 4-bit MatMulNBits runs on two rows in-graph.
# 4: echo's prompt logprobs computed PROMPT_CHUNK positions at a time.
# 5: sliding-window layers rotate at position_ids, keep only their window of KV, see window keys (not window - 1).
# 6: a lone row's 4-bit products share one pad/slice per run of row-wise ops (fewer nodes per layer).
# 7: no in-graph padding: a lone row runs every product at M = 1 (batch invariance is the stage runner's option).
# 8: the head's repeat penalty. 9: the kernel form's layers attend with KvAttention over an fp16 KV cache.
# 10: the sampler's min_p; top_p and min_p judge the probabilities before temperature (llama.cpp's order).
GRAPH_VERSION = 10


def kernel_form(w: dict) -> bool:
    """Whether a layer's weights are the kernel form's (the file's blocks for the kernel library):
    its attention is then the library's ``KvAttention`` over an fp16 KV cache, half the bytes of
    GroupQueryAttention's fp32 one, as llama.cpp keeps it."""
    parts = [p for v in w.values() for p in (v if isinstance(v, list) else [v])]
    return any(isinstance(p, StoredGGUF) for p in parts)


def hidden_name(unit: int) -> str:
    """Name of the activation entering ``unit`` (and leaving ``unit - 1``)."""
    return f"hidden.{unit}"


class _Graph:
    """Collects nodes and initializers; names are prefixed per unit to stay unique."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self._count = 0

    def name(self, base: str) -> str:
        self._count += 1
        return f"{self.prefix}{base}_{self._count}"

    def const(self, array: np.ndarray, base: str, shared: bool = False) -> str:
        """Add an initializer. ``shared`` ones (rotary tables) keep one name across units."""
        name = base if shared else f"{self.prefix}{base}"
        # np.ascontiguousarray would turn a 0-d scalar into shape [1]
        self.initializers[name] = numpy_helper.from_array(np.array(array, order="C", copy=None), name)
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", out: list[str] | None = None, **attrs) -> list[str]:
        outputs = out or [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=self.name(op_type), domain=domain, **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], **kw) -> str:
        return self.op(op_type, inputs, **kw)[0]

    def external(self, stored: Stored, base: str, dtype: int, dims: list[int]) -> str:
        """An initializer whose bytes are already a blob (``location`` = its sha, beside the graph)."""
        name = f"{self.prefix}{base}"
        t = onnx.TensorProto()
        t.name, t.data_type, t.data_location = name, dtype, onnx.TensorProto.EXTERNAL
        t.dims.extend(dims)
        for k, v in (("location", stored.sha), ("offset", "0"), ("length", str(stored.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.initializers[name] = t
        return name

    def linear(self, x: str, w, base: str, bias: np.ndarray | None = None, out: str | None = None, rank: int = 3) -> str:
        """``x @ w.T (+ bias)`` as MatMul (float) or MatMulNBits (quantized) plus, for blocks with
        offsets, ``BlockSum(x) @ offsets.T``; a list of row groups runs each and concatenates."""
        if isinstance(w, list):
            parts = [self.linear(x, p, f"{base}.{i}", rank=rank) for i, p in enumerate(w)]
            y = self.op1("Concat", parts, axis=-1)
        elif isinstance(w, StoredGGUF):  # the file's blocks as stored, through the native kernel library
            raw = self.external(w.raw, base + ".gguf", TensorProto.UINT8, [w.shape[0], w.raw.nbytes // w.shape[0]])
            y = self.op1(GGUF_MATMUL, [x, raw], domain=GGUF_DOMAIN, qtype=GGML_TYPE_IDS[w.kind])
        elif isinstance(w, (BlockQuantized, StoredBlocks)):
            y = self._matmul_nbits(x, w, base)
            if w.offsets is not None:
                y = self.op1("Add", [y, self._block_offsets(x, w, base, rank)])
        else:
            y = self.op1("MatMul", [x, self.const(np.ascontiguousarray(w.T), base + ".weight")])
        if bias is not None:
            y = self.op1("Add", [y, self.const(bias.astype(np.float32), base + ".bias")])
        if out and self.nodes and y in self.nodes[-1].output:  # name the last node's output (no Identity)
            outputs = self.nodes[-1].output
            outputs[list(outputs).index(y)] = out
            return out
        return self.op1("Identity", [y], out=[out]) if out else y

    def _matmul_nbits(self, x: str, w, base: str) -> str:
        n, k = w.shape
        if isinstance(w, StoredBlocks):
            nb = k // w.block_size
            ins = [x, self.external(w.packed, base + ".qweight", TensorProto.UINT8, [n, nb, w.block_size * w.bits // 8]),
                   self.external(w.scales, base + ".scales", FLOAT, [n * nb])]
            if w.zero_points is not None:
                ins.append(self.external(w.zero_points, base + ".zeros", TensorProto.UINT8, [w.zero_points.nbytes]))
        else:
            ins = [x, self.const(w.packed(), base + ".qweight"), self.const(w.scales.reshape(-1), base + ".scales")]
            if w.zero_points is not None:
                if not w.has_integer_zeros:
                    raise ValueError(f"{base}: zero points must be integers for MatMulNBits")
                ins.append(self.const(w.packed_zero_points(), base + ".zeros"))
        # accuracy_level 4 lets MLAS quantize activations to int8 on the fly where it can.
        return self.op1("MatMulNBits", ins, domain=MS, K=k, N=n, bits=w.bits, block_size=w.block_size, accuracy_level=4)

    def _block_offsets(self, x: str, w, base: str, rank: int) -> str:
        """``BlockSum(x) @ offsets.T``: each block of x summed once, times the block's offset."""
        n, k = w.shape
        nb = k // w.block_size
        blocks = self.op1("Reshape", [x, self.const(np.array([0] * (rank - 1) + [nb, w.block_size], np.int64), base + ".blocks")])
        sums = self.op1("ReduceSum", [blocks, self.const(np.array([-1], np.int64), base + ".last")], keepdims=0)
        if rank == 2:  # Gemm reads offsets as stored, the same bytes as a tied embedding's table
            return self.op1("Gemm", [sums, self.const(w.offsets, base + ".offsets")], transB=1)
        return self.op1("MatMul", [sums, self.const(np.ascontiguousarray(w.offsets.T), base + ".offsets_t")])

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, base: str, out: str | None = None) -> str:
        return self.op("SimplifiedLayerNormalization", [x, self.const(weight.astype(np.float32), base)],
                       out=[out] if out else None, axis=-1, epsilon=eps, stash_type=1)[0]

    def norm(self, x: str, weight: np.ndarray, bias: np.ndarray | None, eps: float, base: str) -> str:
        """RMSNorm, or LayerNorm where the norm has a bias (GPT-2's ``ln``)."""
        if bias is None:
            return self.rms_norm(x, weight, eps, base)
        return self.op1("LayerNormalization", [x, self.const(weight.astype(np.float32), base),
                                               self.const(bias.astype(np.float32), base + ".bias")], axis=-1, epsilon=eps)

    def model(self, inputs: list, outputs: list, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, list(self.initializers.values()))
        model = helper.make_model(
            graph, ir_version=IR_VERSION, producer_name="edgepipe",
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
        )
        if any(n.domain == GGUF_DOMAIN for n in self.nodes):
            model.opset_import.append(helper.make_opsetid(GGUF_DOMAIN, 1))
        return model


def rotary_tables(cfg: ModelConfig, max_positions: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches ``[max_positions, D/2]`` for GroupQueryAttention's built-in rotary."""
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    if freq_factors is not None:  # llama-3.1 style long-context scaling shipped in the file
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def embedding_unit(cfg: ModelConfig, table: Weight, positions: np.ndarray | None = None) -> onnx.ModelProto:
    """Token ids to the first hidden state; ``positions`` ``[P, H]`` (learned positions, GPT-2):
    the row of each token's absolute position (``position_ids``, the stage runner's) is added."""
    g = _Graph("embed.")
    out = hidden_name(1)
    if isinstance(table, StoredGGUF):  # the file's blocks, dequantized per row by the kernel library
        raw = g.external(table.raw, "table.gguf", TensorProto.UINT8, [table.shape[0], table.raw.nbytes // table.shape[0]])
        y = g.op1(GGUF_GATHER, [raw, "input_ids"], domain=GGUF_DOMAIN, qtype=GGML_TYPE_IDS[table.kind])
    elif isinstance(table, (BlockQuantized, StoredBlocks)):
        y = _gather_blocks(g, table)
    else:
        y = g.op1("Gather", [g.const(table, "table"), "input_ids"], axis=0)
    if cfg.embedding_scale != 1.0:
        y = g.op1("Mul", [y, g.const(np.array(cfg.embedding_scale, np.float32), "scale")])
    inputs = [helper.make_tensor_value_info("input_ids", INT64, ["batch", "seq"])]
    if positions is not None:
        y = g.op1("Add", [y, g.op1("Gather", [g.const(np.asarray(positions, np.float32), "positions"), "position_ids"], axis=0)])
        inputs.append(helper.make_tensor_value_info("position_ids", INT64, ["batch", "seq"]))
    g.op("Identity", [y], out=[out])
    return g.model(
        inputs,
        [helper.make_tensor_value_info(out, FLOAT, ["batch", "seq", cfg.hidden_size])],
        "embedding",
    )


def _gather_blocks(g: _Graph, table) -> str:
    """Rows of a block-quantized table: GatherBlockQuantized (default zero point), plus each
    block's offset repeated over the block where the type has one. ``[B, S] -> [B, S, H]``."""
    n, k = table.shape
    nb = k // table.block_size
    if table.zero_points is not None:
        raise ValueError("quantized embeddings must use the default zero point")
    if isinstance(table, StoredBlocks):
        data = g.external(table.packed, "table.q", TensorProto.UINT8, [n, k * table.bits // 8])
        scales = g.external(table.scales, "table.scales", FLOAT, [n, nb])
    else:
        data = g.const(table.q if table.bits == 8 else table.packed().reshape(n, -1), "table.q")
        scales = g.const(table.scales, "table.scales")
    y = g.op1("GatherBlockQuantized", [data, "input_ids", scales], domain=MS, bits=table.bits, block_size=table.block_size,
              gather_axis=0, quantize_axis=1)
    if table.offsets is None:
        return y
    offsets = g.op1("Gather", [g.const(table.offsets, "table.offsets"), "input_ids"], axis=0)  # [B, S, nb]
    spread = g.op1("Expand", [g.op1("Unsqueeze", [offsets, g.const(np.array([-1], np.int64), "table.last")]),
                              g.const(np.array([1, 1, nb, table.block_size], np.int64), "table.spread")])
    return g.op1("Add", [y, g.op1("Reshape", [spread, g.const(np.array([0, 0, k], np.int64), "table.shape")])])


def layer_unit(cfg: ModelConfig, unit: int, w: dict[str, Weight | np.ndarray], cos: np.ndarray, sin: np.ndarray,
               local_rope: tuple[np.ndarray, np.ndarray] | None = None, fp16_kv: bool | None = None) -> onnx.ModelProto:
    """One decoder layer. ``w`` holds attn_norm, qkv (fused rows), qkv_bias?, q_norm?, k_norm?,
    attn_output, post_attention_norm?, ffn_norm, gate_up (fused rows; up alone where
    ``cfg.gated_ffn`` is false), ffn_down, post_ffw_norm?; with ``cfg.biases`` (GPT-2) also
    attn_norm_bias, ffn_norm_bias (LayerNorm), attn_output_bias, gate_up_bias, ffn_down_bias.
    Learned positions (``cfg.learned_positions``): attention rotates nothing.

    A sliding-window layer (``cfg.window``) attends to its last ``window`` positions and, where
    the family gives such layers their own RoPE base, rotates with ``local_rope``.

    ``fp16_kv`` (default: ``kernel_form(w)``; the importer says so for every layer of the ``gguf``
    form, float tensors or not): attention is the kernel library's KvAttention over an fp16 cache."""
    g = _Graph(f"l{unit}.")
    x, out = hidden_name(unit), hidden_name(unit + 1)
    H, D, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    eps = cfg.rms_eps

    normed = g.norm(x, w["attn_norm"], w.get("attn_norm_bias"), eps, "attn_norm")
    qkv = g.linear(normed, w["qkv"], "qkv", bias=w.get("qkv_bias"))
    window = cfg.window(unit - 1)
    rotates = not cfg.learned_positions  # (GPT-2's positions were added to the embedding)
    # GroupQueryAttention's local_window_size counts the keys a query sees, itself included (ONNX
    # Runtime 1.31; llama.cpp's and transformers' window: distance < window). A window
    # layer's cache keeps only its window (the stage runner drops older positions), so a buffer
    # index is no position: q and k are rotated before attention, at explicit position_ids.
    gqa_attrs = dict(num_heads=nq, kv_num_heads=nkv, do_rotary=1 if rotates and not window else 0, rotary_interleaved=int(cfg.rope_interleaved),
                     local_window_size=window if window else -1)
    if cfg.attention_scale is not None:
        gqa_attrs["scale"] = float(cfg.attention_scale)
    if cfg.attn_logit_softcap:
        gqa_attrs["softcap"] = float(cfg.attn_logit_softcap)
    if cfg.qk_norm or window:
        q, k, v = g.op("Split", [qkv, g.const(np.array([nq * D, nkv * D, nkv * D], np.int64), "qkv_split")], n_out=3, axis=-1)
        if cfg.qk_norm:
            q = _per_head_norm(g, q, nq, D, w["q_norm"], eps, "q_norm")
            k = _per_head_norm(g, k, nkv, D, w["k_norm"], eps, "k_norm")
        attn_in = [q, k, v]
    else:
        attn_in = [qkv, "", ""]  # packed QKV
    rope_suffix = ""
    if window and local_rope is not None:
        cos, sin = local_rope
        rope_suffix = "_local"
    kv_type = FLOAT16 if (kernel_form(w) if fp16_kv is None else fp16_kv) else FLOAT
    cos_name = sin_name = ""
    if rotates or kv_type == FLOAT16:
        if not rotates:  # KvAttention takes tables whatever do_rotary says: a one-row stand-in
            cos = sin = np.zeros((1, D // 2), np.float32)
            rope_suffix = "_none"
        cos_name = g.const(cos, "cos_cache" + rope_suffix, shared=True)
        sin_name = g.const(sin, "sin_cache" + rope_suffix, shared=True)
    lengths, rope_in = ["seqlens_k", "total_sequence_length"], [cos_name, sin_name] if rotates else []
    if window:
        rotary = dict(interleaved=int(cfg.rope_interleaved), **({"rotary_embedding_dim": 2 * cos.shape[1]} if 2 * cos.shape[1] < D else {}))
        attn_in = [g.op1("RotaryEmbedding", [attn_in[0], "position_ids", cos_name, sin_name], domain=MS, num_heads=nq, **rotary),
                   g.op1("RotaryEmbedding", [attn_in[1], "position_ids", cos_name, sin_name], domain=MS, num_heads=nkv, **rotary),
                   attn_in[2]]
        lengths, rope_in = ["window_seqlens_k", "window_total_sequence_length"], []
    # gpt-oss: a learned logit per query head joins every softmax's denominator (its value row is 0)
    sinks = [g.const(np.asarray(w["attn_sinks"], np.float32).reshape(nq), "attn_sinks")] if cfg.attention_sinks else []
    if kv_type == FLOAT16:  # the kernel library's attention over an fp16 cache: qkv packed, rotary tables always given
        packed = attn_in[0] if not attn_in[1] else g.op1("Concat", attn_in, axis=-1)
        attn, _, _ = g.op(KV_ATTENTION, [packed, f"past_key.{unit}", f"past_value.{unit}", *lengths, cos_name, sin_name, *sinks],
                          domain=GGUF_DOMAIN, out=[g.name("attn"), f"present_key.{unit}", f"present_value.{unit}"], **gqa_attrs)
    else:
        gqa_in = attn_in + [f"past_key.{unit}", f"past_value.{unit}", *lengths, *rope_in]
        if sinks:  # GroupQueryAttention's head_sink (input 11, after cos/sin, position_ids and attention_bias)
            gqa_in = gqa_in + [""] * (11 - len(gqa_in)) + sinks
        attn, _, _ = g.op(
            "GroupQueryAttention", gqa_in,
            domain=MS, out=[g.name("attn"), f"present_key.{unit}", f"present_value.{unit}"], **gqa_attrs,
        )
    attn_out = g.linear(attn, w["attn_output"], "attn_output", bias=w.get("attn_output_bias"))
    if cfg.post_norms:
        attn_out = g.op1("SimplifiedLayerNormalization", [attn_out, g.const(w["post_attention_norm"].astype(np.float32),
                              "post_attention_norm")], axis=-1, epsilon=eps, stash_type=1)
    if cfg.residual_scale != 1.0:
        attn_out = g.op1("Mul", [attn_out, g.const(np.array(cfg.residual_scale, np.float32), "res_scale")])
    if cfg.norm == "layer":
        resid = g.op1("Add", [attn_out, x])
        mlp_in = g.norm(resid, w["ffn_norm"], w.get("ffn_norm_bias"), eps, "ffn_norm")
    else:  # SkipSimplifiedLayerNormalization: residual add and the MLP's input norm in one kernel.
        mlp_in, _, _, resid = g.op("SkipSimplifiedLayerNormalization", [attn_out, x, g.const(w["ffn_norm"].astype(np.float32), "ffn_norm")],
                                   n_out=4, domain=MS, epsilon=eps)
    if "router" in w:  # a mixture of experts (model/moe.py): each expert is this FFN at its own width
        from .moe import moe_ffn

        width = cfg.expert_intermediate_size or cfg.intermediate_size
        down = moe_ffn(g, cfg, mlp_in, w, lambda rows, ew, base: _ffn(g, cfg, rows, ew["gate_up"], ew["ffn_down"], width, base, rank=2,
                                                                       gate_up_bias=ew.get("gate_up_bias"), down_bias=ew.get("ffn_down_bias")),
                       lambda gate, up: _glu(g, gate, up, cfg.ffn_activation))
    else:
        gate_up = g.linear(mlp_in, w["gate_up"], "gate_up", bias=w.get("gate_up_bias"))
        if cfg.gated_ffn:
            gate, up = g.op("Split", [gate_up, g.const(np.array([cfg.intermediate_size] * 2, np.int64), "gu_split")], n_out=2, axis=-1)
            act = _glu(g, gate, up, cfg.ffn_activation, kv_type == FLOAT16)  # act(gate) * up
        else:
            act = _activation(g, gate_up, cfg.ffn_activation, kv_type == FLOAT16)  # act(up)
        down = g.linear(act, w["ffn_down"], "ffn_down", bias=w.get("ffn_down_bias"))
    if cfg.post_norms:
        down = g.op1("SimplifiedLayerNormalization", [down, g.const(w["post_ffw_norm"].astype(np.float32), "post_ffw_norm")],
                          axis=-1, epsilon=eps, stash_type=1)
    if cfg.residual_scale != 1.0:
        down = g.op1("Mul", [down, g.const(np.array(cfg.residual_scale, np.float32), "res_scale2")])
    g.op("Add", [resid, down], out=[out])

    kv_shape = ["batch", nkv, f"window_{window}" if window else "capacity", D]  # the runner reads the window here
    position_inputs = [helper.make_tensor_value_info("position_ids", INT64, ["batch", "seq"])] if window else []
    return g.model(
        [helper.make_tensor_value_info(x, FLOAT, ["batch", "seq", H]),
         helper.make_tensor_value_info(f"past_key.{unit}", kv_type, kv_shape),
         helper.make_tensor_value_info(f"past_value.{unit}", kv_type, kv_shape),
         helper.make_tensor_value_info(lengths[0], INT32, ["batch"]),
         helper.make_tensor_value_info(lengths[1], INT32, []), *position_inputs],
        [helper.make_tensor_value_info(out, FLOAT, ["batch", "seq", H]),
         helper.make_tensor_value_info(f"present_key.{unit}", kv_type, kv_shape),
         helper.make_tensor_value_info(f"present_value.{unit}", kv_type, kv_shape)],
        f"layer{unit}",
    )


def _ffn(g: _Graph, cfg: ModelConfig, x: str, gate_up, ffn_down, width: int, base: str = "", rank: int = 3,
         gate_up_bias: np.ndarray | None = None, down_bias: np.ndarray | None = None) -> str:
    """``down(act(gate(x)) * up(x))``, gate and up as one product of fused rows (``width`` each)."""
    fused = g.linear(x, gate_up, base + "gate_up", bias=gate_up_bias, rank=rank)
    gate, up = g.op("Split", [fused, g.const(np.array([width] * 2, np.int64), base + "gu_split")], n_out=2, axis=-1)
    return g.linear(_glu(g, gate, up, cfg.ffn_activation), ffn_down, base + "ffn_down", bias=down_bias, rank=rank)


def _glu(g: _Graph, gate: str, up: str, kind: str, fp16_table: bool = False) -> str:
    """The gated activation ``act(gate) * up``; "swiglu_oai" (gpt-oss, llama.cpp's ggml_swiglu_oai):
    ``x * sigmoid(1.702 x) * (y + 1)`` with ``x = min(gate, 7)``, ``y = clamp(up, -7, 7)``."""
    if kind == "swiglu_oai":
        from .moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

        limit = g.const(np.array(SWIGLU_OAI_LIMIT, np.float32), "oai_limit")
        x = g.op1("Min", [gate, limit])
        y = g.op1("Clip", [up, g.const(np.array(-SWIGLU_OAI_LIMIT, np.float32), "oai_low"), limit])
        glu = g.op1("Mul", [x, g.op1("Sigmoid", [g.op1("Mul", [x, g.const(np.array(SWIGLU_OAI_ALPHA, np.float32), "oai_alpha")])])])
        return g.op1("Mul", [glu, g.op1("Add", [y, g.const(np.array(1.0, np.float32), "oai_one")])])
    return g.op1("Mul", [_activation(g, gate, kind, fp16_table), up])


def _activation(g: _Graph, x: str, kind: str, fp16_table: bool = False) -> str:
    """``kind`` of ``x``; ``fp16_table`` (the kernel form): GELU as llama.cpp's CPU backend computes it,
    a lookup in a table of fp16 results by the fp16 input (``GGML_GELU_FP16``), ``x`` itself from 10 on
    and 0 below -10: ``fp16(gelu(fp16(x)))``."""
    if kind == "silu":
        return g.op1("Mul", [x, g.op1("Sigmoid", [x])])
    if kind == "gelu_tanh" and fp16_table:
        half = lambda t: g.op1("Cast", [g.op1("Cast", [t], to=FLOAT16)], to=FLOAT)  # noqa: E731
        looked_up = half(g.op1("Gelu", [half(x)], approximate="tanh"))
        big = g.op1("GreaterOrEqual", [x, g.const(np.array(10.0, np.float32), "gelu_hi")])
        small = g.op1("LessOrEqual", [x, g.const(np.array(-10.0, np.float32), "gelu_lo")])
        zero = g.const(np.array(0.0, np.float32), "gelu_zero")
        return g.op1("Where", [big, x, g.op1("Where", [small, zero, looked_up])])
    if kind == "gelu_tanh":
        return g.op1("Gelu", [x], approximate="tanh")
    raise ValueError(f"activation {kind!r} is not supported")


def _per_head_norm(g: _Graph, x: str, heads: int, D: int, weight: np.ndarray, eps: float, base: str) -> str:
    shape_in = g.op1("Shape", [x])
    per_head = g.op1("Reshape", [x, g.const(np.array([0, 0, heads, D], np.int64), base + ".shape")])
    normed = g.rms_norm(per_head, weight, eps, base)
    return g.op1("Reshape", [normed, shape_in])


def head_unit(cfg: ModelConfig, unit: int, final_norm: np.ndarray, lm_head: Weight,
              final_norm_bias: np.ndarray | None = None) -> onnx.ModelProto:
    """Final norm (LayerNorm where it has a bias) + LM head on the last position, then greedy or
    seeded sampling in-graph.

    Sampling (when ``do_sample``), in llama.cpp's order: keep the ``top_k`` best (0 = all), then
    the smallest prefix whose probability reaches ``top_p`` and the tokens at least ``min_p`` times
    as likely as the best (0 = off), both judged on the model's own probabilities, then apply the
    temperature to what is kept (GRAPH_VERSION 10; before, top_p judged the tempered ones), and
    pick the token where the cumulative kept mass first exceeds ``uniform * total``. ``uniform`` is drawn by the caller
    from the request's seed, so a seeded request gives the same tokens on any pipeline.

    Controls: ``logit_adjust`` is added to the logits before the choice (greedy or sampled):
    logit_bias, presence/frequency penalties and token masks (-inf) arrive folded into it, dense
    ``[B, V]``, or one row of zeros ``[1, V]`` when no row has any (adding 0 changes no logit).

    Log-probabilities are ``log_softmax`` of the model's own logits (after the family's logit
    scale and softcap, before ``logit_adjust`` and temperature: OpenAI's and vLLM's default):
    ``token_logprob`` of the chosen token and the ``num_top`` best (ids, logprobs), N <= 20.
    ``prompt_targets`` ``[B, S]`` (non-empty only when asked: ``echo``) makes the head also run
    every position and return each one's logprob of its target (the next prompt token) and top N;
    empty ``[1, 0]``, that branch does not run, so a normal prefill stays one-position cheap.
    """
    g = _Graph("head.")
    x = hidden_name(unit)
    final_norm = (final_norm, final_norm_bias)
    last = g.op1("Gather", [x, g.const(np.array(-1, np.int64), "last")], axis=1)  # [B, H]
    logits = _head_logits(g, cfg, last, final_norm, lm_head)
    adjusted = g.op1("Add", [_repeat_penalised(g, logits), "logit_adjust"])

    greedy = helper.make_graph(
        [helper.make_node("ArgMax", [adjusted], ["greedy_token"], axis=-1, keepdims=0)],
        "greedy", [], [helper.make_tensor_value_info("greedy_token", INT64, ["batch"])])
    sample = _sampling_branch(adjusted, cfg.vocab_size)
    g.op("If", ["do_sample"], out=["next_token"], then_branch=sample, else_branch=greedy)

    logp = g.op1("LogSoftmax", [logits], axis=-1)
    chosen = g.op1("Unsqueeze", ["next_token", g.const(np.array([1], np.int64), "ax1")])
    g.op("Squeeze", [g.op1("GatherElements", [logp, chosen], axis=1), g.const(np.array([1], np.int64), "ax1b")],
         out=["token_logprob"])
    g.op("TopK", [logp, "num_top"], out=["top_logprobs", "top_ids"], axis=-1, largest=1, sorted=1)

    size = g.op1("Size", ["prompt_targets"])
    asked = g.op1("Greater", [size, g.const(np.array(0, np.int64), "zero")])
    g.op("If", [asked], out=list(HEAD_LOGPROB_OUTPUTS[3:]), then_branch=_prompt_branch(g, cfg, x, final_norm, lm_head),
         else_branch=_no_prompt_branch())
    return g.model(
        [helper.make_tensor_value_info(x, FLOAT, ["batch", "seq", cfg.hidden_size]),
         helper.make_tensor_value_info("do_sample", BOOL, []),
         helper.make_tensor_value_info("temperature", FLOAT, ["batch"]),
         helper.make_tensor_value_info("top_k", INT64, ["batch"]),
         helper.make_tensor_value_info("top_p", FLOAT, ["batch"]),
         helper.make_tensor_value_info("uniform", FLOAT, ["batch"]),
         helper.make_tensor_value_info("logit_adjust", FLOAT, ["adjust_rows", cfg.vocab_size]),
         helper.make_tensor_value_info("num_top", INT64, [1]),
         helper.make_tensor_value_info("prompt_targets", INT64, ["target_rows", "targets"]),
         helper.make_tensor_value_info("repeat_ids", INT64, ["batch", "repeat"]),
         helper.make_tensor_value_info("repeat_penalty", FLOAT, ["batch"]),
         helper.make_tensor_value_info("min_p", FLOAT, ["batch"])],
        [helper.make_tensor_value_info("next_token", INT64, ["batch"]),
         helper.make_tensor_value_info("token_logprob", FLOAT, ["batch"]),
         helper.make_tensor_value_info("top_ids", INT64, ["batch", "top"]),
         helper.make_tensor_value_info("top_logprobs", FLOAT, ["batch", "top"]),
         helper.make_tensor_value_info("prompt_logprobs", FLOAT, None),
         helper.make_tensor_value_info("prompt_top_ids", INT64, None),
         helper.make_tensor_value_info("prompt_top_logprobs", FLOAT, None)],
        "head",
    )


def _repeat_penalised(g: _Graph, logits: str) -> str:
    """llama.cpp's repeat penalty on ``logits [B, V]``: the ids in ``repeat_ids [B, R]`` have their
    logit divided by ``repeat_penalty [B]`` when positive, multiplied when negative (an empty
    ``[B, 0]``, or a penalty of 1, leaves every logit as it was)."""
    picked = g.op1("GatherElements", [logits, "repeat_ids"], axis=1)
    penalty = g.op1("Unsqueeze", ["repeat_penalty", g.const(np.array([1], np.int64), "rp_axis")])
    positive = g.op1("Greater", [picked, g.const(np.array(0.0, np.float32), "rp_zero")])
    scaled = g.op1("Where", [positive, g.op1("Div", [picked, penalty]), g.op1("Mul", [picked, penalty])])
    return g.op1("ScatterElements", [logits, "repeat_ids", scaled], axis=1)


def _head_logits(g: _Graph, cfg: ModelConfig, rows: str, final_norm: np.ndarray | tuple, lm_head: Weight) -> str:
    """Logits ``[N, V]`` of hidden rows ``[N, H]``: final norm (its weight, or (weight, bias or
    None)), LM head, the family's scale and softcap."""
    weight, bias = final_norm if isinstance(final_norm, tuple) else (final_norm, None)
    normed = g.norm(rows, weight, bias, cfg.rms_eps, "final_norm")
    if isinstance(lm_head, np.ndarray) and cfg.tie_embeddings:
        # Gemm with transB reads the embedding table as stored: one weight file for both units.
        logits = g.op1("Gemm", [normed, g.const(lm_head, "lm_head"), ], transB=1)
    else:
        logits = g.linear(normed, lm_head, "lm_head", rank=2)
    if cfg.logit_scale != 1.0:
        logits = g.op1("Div", [logits, g.const(np.array(cfg.logit_scale, np.float32), "logit_scale")])
    if cfg.final_logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
        cap = g.const(np.array(cfg.final_logit_softcap, np.float32), "softcap")
        logits = g.op1("Mul", [g.op1("Tanh", [g.op1("Div", [logits, cap])]), cap])
    return logits


PROMPT_CHUNK = 64  # echo: positions whose [chunk, V] logits exist at once (a Scan over chunks bounds the memory)


def _prompt_branch(outer: _Graph, cfg: ModelConfig, x: str, final_norm: tuple, lm_head: Weight) -> onnx.GraphProto:
    """Every position's logprob of its target and top N (``echo``), ``PROMPT_CHUNK`` positions at
    a time (rows padded with zeros to a whole chunk, the padding dropped after). Its weights are the
    outer graph's initializers (same names, so nothing is stored twice)."""
    g = _Graph("head.")
    g._count = 100_000  # node and tensor names distinct from the outer graph's
    C, H = PROMPT_CHUNK, cfg.hidden_size
    i64 = lambda v, name: g.const(np.array(v, np.int64), name)  # noqa: E731
    flat = g.op1("Reshape", [x, i64([-1, H], "p_rows")])  # [R, H]
    targets = g.op1("Reshape", ["prompt_targets", i64([-1], "p_flat")])  # [R]
    rows = g.op1("Shape", [targets])  # [1]
    padded = g.op1("Mul", [g.op1("Div", [g.op1("Add", [rows, i64([C - 1], "p_cm1")]), i64([C], "p_c")]), i64([C], "p_c2")])
    pad = g.op1("Sub", [padded, rows])
    chunks = g.op1("Reshape", [g.op1("Pad", [flat, g.op1("Concat", [i64([0, 0], "p_z2"), pad, i64([0], "p_z1")], axis=0)]),
                               i64([-1, C, H], "p_chunks")])
    tchunks = g.op1("Reshape", [g.op1("Pad", [targets, g.op1("Concat", [i64([0], "p_z1b"), pad], axis=0)]), i64([-1, C], "p_tchunks")])
    lp, ids, vals = g.op("Scan", [chunks, tchunks], n_out=3, body=_prompt_chunk(outer, cfg, final_norm, lm_head), num_scan_inputs=2)
    g.op("Reshape", [g.op1("Slice", [g.op1("Reshape", [lp, i64([-1], "p_flat2")]), i64([0], "p_s0"), rows, i64([0], "p_ax0")]),
                     g.op1("Shape", ["prompt_targets"])], out=["p_logprobs"])
    per_row = g.op1("Concat", [padded, "num_top"], axis=0)
    shape = g.op1("Concat", [g.op1("Shape", ["prompt_targets"]), "num_top"], axis=0)
    for src, name in ((vals, "p_top_logprobs"), (ids, "p_top_ids")):
        # allowzero: N = 0 is a real zero-sized dimension, not "copy the input's"
        g.op("Reshape", [g.op1("Slice", [g.op1("Reshape", [src, per_row], allowzero=1), i64([0], "p_s0b"), rows, i64([0], "p_ax0b")]),
                         shape], out=[name], allowzero=1)
    outer.initializers.update(g.initializers)
    return helper.make_graph(g.nodes, "prompt_logprobs", [], [
        helper.make_tensor_value_info("p_logprobs", FLOAT, None), helper.make_tensor_value_info("p_top_ids", INT64, None),
        helper.make_tensor_value_info("p_top_logprobs", FLOAT, None)])


def _prompt_chunk(outer: _Graph, cfg: ModelConfig, final_norm: tuple, lm_head: Weight) -> onnx.GraphProto:
    """Scan body: ``PROMPT_CHUNK`` hidden rows and their targets -> logprobs [C], top ids/logprobs [C, N]."""
    g = _Graph("head.")
    g._count = 200_000
    logp = g.op1("LogSoftmax", [_head_logits(g, cfg, "pc_rows", final_norm, lm_head)], axis=-1)  # [C, V]
    picked = g.op1("GatherElements", [logp, g.op1("Unsqueeze", ["pc_targets", g.const(np.array([1], np.int64), "pc_ax1")])], axis=1)
    g.op("Squeeze", [picked, g.const(np.array([1], np.int64), "pc_ax1b")], out=["pc_logprobs"])
    g.op("TopK", [logp, "num_top"], out=["pc_top_logprobs", "pc_top_ids"], axis=-1, largest=1, sorted=1)
    outer.initializers.update(g.initializers)
    return helper.make_graph(g.nodes, "prompt_chunk", [
        helper.make_tensor_value_info("pc_rows", FLOAT, [PROMPT_CHUNK, cfg.hidden_size]),
        helper.make_tensor_value_info("pc_targets", INT64, [PROMPT_CHUNK])], [
        helper.make_tensor_value_info("pc_logprobs", FLOAT, [PROMPT_CHUNK]),
        helper.make_tensor_value_info("pc_top_ids", INT64, [PROMPT_CHUNK, None]),
        helper.make_tensor_value_info("pc_top_logprobs", FLOAT, [PROMPT_CHUNK, None])])


def _no_prompt_branch() -> onnx.GraphProto:
    empty = [numpy_helper.from_array(np.zeros((1, 0), np.float32), "e_logprobs"),
             numpy_helper.from_array(np.zeros((1, 0, 0), np.int64), "e_top_ids"),
             numpy_helper.from_array(np.zeros((1, 0, 0), np.float32), "e_top_logprobs")]
    nodes = [helper.make_node("Identity", [t.name], [t.name + "_out"]) for t in empty]
    return helper.make_graph(nodes, "no_prompt_logprobs", [], [
        helper.make_tensor_value_info("e_logprobs_out", FLOAT, None), helper.make_tensor_value_info("e_top_ids_out", INT64, None),
        helper.make_tensor_value_info("e_top_logprobs_out", FLOAT, None)], empty)


def _sampling_branch(logits: str, vocab: int) -> onnx.GraphProto:
    c = lambda name, v, dt=np.int64: numpy_helper.from_array(np.array(v, dt), name)  # noqa: E731
    n = helper.make_node
    nodes = [
        n("Unsqueeze", ["temperature", "s_ax1"], ["s_t"]),
        n("Div", [logits, "s_t"], ["s_scaled"]),
        # top_k <= 0 means "no limit"
        n("Greater", ["top_k", "s_zero"], ["s_has_k"]),
        n("Min", ["top_k", "s_vocab"], ["s_k_capped"]),
        n("Where", ["s_has_k", "s_k_capped", "s_vocab"], ["s_k_eff"]),
        n("ReduceMax", ["s_k_eff"], ["s_kmax"], keepdims=1),
        n("TopK", ["s_scaled", "s_kmax"], ["s_vals", "s_idx"], axis=-1, largest=1, sorted=1),
        n("Shape", ["s_vals"], ["s_vshape"]),
        n("Gather", ["s_vshape", "s_one"], ["s_kdim"], axis=0),
        n("Range", ["s_zero", "s_kdim", "s_one"], ["s_rank"]),
        n("Unsqueeze", ["s_k_eff", "s_ax1"], ["s_k_col"]),
        n("Less", ["s_rank", "s_k_col"], ["s_keep_k"]),
        n("Softmax", ["s_vals"], ["s_probs"], axis=-1),
        # top_p and min_p judge the model's own probabilities, before temperature (llama.cpp's
        # sampler chain: top_k, top_p, min_p, then temperature), so its default values mean the same here
        n("Mul", ["s_vals", "s_t"], ["s_raw_vals"]),
        n("Softmax", ["s_raw_vals"], ["s_raw"], axis=-1),
        n("CumSum", ["s_raw", "s_ax1_scalar"], ["s_cum"]),
        n("Sub", ["s_cum", "s_raw"], ["s_before"]),
        n("Unsqueeze", ["top_p", "s_ax1"], ["s_p_col"]),
        n("Less", ["s_before", "s_p_col"], ["s_keep_p"]),
        # min_p: keep what is at least min_p times as likely as the best (sorted: the first column)
        n("Gather", ["s_raw", "s_first"], ["s_pmax"], axis=1),
        n("Unsqueeze", ["min_p", "s_ax1"], ["s_minp_col"]),
        n("Mul", ["s_pmax", "s_minp_col"], ["s_floor"]),
        n("LessOrEqual", ["s_floor", "s_raw"], ["s_keep_m"]),
        n("And", ["s_keep_k", "s_keep_p"], ["s_keep_kp"]),
        n("And", ["s_keep_kp", "s_keep_m"], ["s_keep"]),
        n("Where", ["s_keep", "s_probs", "s_fzero"], ["s_kept"]),
        n("CumSum", ["s_kept", "s_ax1_scalar"], ["s_cum2"]),
        n("ReduceSum", ["s_kept", "s_ax1"], ["s_total"], keepdims=1),
        n("Unsqueeze", ["uniform", "s_ax1"], ["s_u_col"]),
        n("Mul", ["s_u_col", "s_total"], ["s_thresh"]),
        n("LessOrEqual", ["s_cum2", "s_thresh"], ["s_below"]),
        n("Cast", ["s_below"], ["s_below_i"], to=INT64),
        n("ReduceSum", ["s_below_i", "s_ax1"], ["s_choice"], keepdims=1),
        n("Sub", ["s_kdim", "s_one"], ["s_last"]),
        n("Min", ["s_choice", "s_last"], ["s_choice_c"]),
        n("GatherElements", ["s_idx", "s_choice_c"], ["s_tok"], axis=1),
        n("Squeeze", ["s_tok", "s_ax1"], ["sampled_token"]),
    ]
    inits = [c("s_ax1", [1]), c("s_ax1_scalar", 1), c("s_zero", 0), c("s_one", 1), c("s_vocab", vocab), c("s_first", [0]),
             numpy_helper.from_array(np.array(0.0, np.float32), "s_fzero")]
    return helper.make_graph(nodes, "sample", [], [helper.make_tensor_value_info("sampled_token", INT64, ["batch"])], inits)


def pad_lone_rows(model: onnx.ModelProto) -> onnx.ModelProto:
    """The batch-invariant form of a graph: every 4-bit MatMulNBits runs a lone row on two rows.

    MLAS computes a one-row 4-bit product (M = 1) with a kernel of its own whose sums differ in
    the last bits from the M >= 2 kernel's, and the M >= 2 kernel gives every row the same bits
    in any batch (8-bit blocks and float MatMul are the same at M = 1 too). So each 4-bit
    product's input is padded with a copy of its first row when it holds a single row (``Pad``
    by one row (none when it holds another count) on axis 0, edge mode) and the copy is sliced off its output: a sequence
    gets the same bits alone as batched with others. A graph without 4-bit products comes back
    unchanged (the same bytes, so the same sha)."""
    targets = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == MS
               and any(a.name == "bits" and a.i == 4 for a in n.attribute)]
    if not targets:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph("lone_row.")
    axis0 = g.const(np.array([0], np.int64), "axis0")
    one = g.const(np.array([1], np.int64), "one")
    far = g.const(np.array([2**62], np.int64), "far")
    zero = g.const(np.array([0], np.int64), "zero")
    padded: dict[str, tuple[str, str]] = {}  # input -> ([1] if it holds one row else [0], its padded form)
    targets_by_name = {n.name for n in targets}
    for node in out.graph.node:
        if node.name not in targets_by_name:
            g.nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        if x not in padded:
            rows = g.op1("ReduceProd", [g.op1("Shape", [x], end=-1)], keepdims=1)
            lone = g.op1("Cast", [g.op1("Equal", [rows, one])], to=INT64)  # 1 for one row, else 0 (a MoE expert may get none)
            padded[x] = lone, g.op1("Pad", [x, g.op1("Concat", [lone, zero], axis=0), "", axis0], mode="edge")
        lone, node.input[0] = padded[x]
        node.output[0] = g.name("two_rows")
        g.nodes.append(node)
        g.op("Slice", [node.output[0], lone, far, axis0], out=[y])
    nodes = g.nodes
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(g.initializers.values())
    return out


def gpu_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The form of a graph for GPU execution providers: fewer kernels, no CPU round trip.

    A GPU step through ONNX Runtime's WebGPU EP is bound by dispatches, not bytes: on an H100 each
    kernel costs ~30 us of host time whatever its size, and the GPU idles between them. So:

    - The block sums of the block-minimum term of Q4_K / Q5_K / Q4_1 weights, ``BlockSum(x) @
      offsets`` (``_Graph._block_offsets``: Reshape, ReduceSum, MatMul), become one MatMul of ``x``
      by a 0/1 block-indicator matrix ``[K, K / block]``: the same sums, each term times an exact
      1.0, one tiled product where the WebGPU reduction dispatched per block row (over half of an
      8B step, measured). The indicator is one constant per ``K``, shared by every layer.
    - The head's ``LogSoftmax`` has no WebGPU kernel: on the CPU it split a step into two trips
      (logits to the host, log-probabilities back for TopK / GatherElements), each a full sync.
      Written as ``x - max - log(sum(exp(x - max)))`` every op stays on the GPU.

    Weights are unchanged and only the order of additions may differ from the CPU form; a graph
    with neither pattern comes back as it was (same bytes)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    inits = {i.name: i for i in model.graph.initializer}
    sums: dict[str, tuple[str, int, int]] = {}  # ReduceSum output -> (x, K, block)
    for node in model.graph.node:
        if node.op_type != "ReduceSum" or node.domain or len(node.input) < 2:
            continue
        shape = producers.get(node.input[0])
        if shape is None or shape.op_type != "Reshape" or shape.input[1] not in inits or readers.get(shape.output[0]) != 1:
            continue
        dims = numpy_helper.to_array(inits[shape.input[1]])
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        axes = numpy_helper.to_array(inits[node.input[1]]) if node.input[1] in inits else None
        if keepdims == 0 and axes is not None and axes.tolist() == [-1] and dims[-1] > 1 and dims[-2] > 0:
            sums[node.output[0]] = (shape.input[0], int(dims[-2] * dims[-1]), int(dims[-1]))
    log_softmax = {n.output[0] for n in model.graph.node if n.op_type == "LogSoftmax" and not n.domain
                   and next((a.i for a in n.attribute if a.name == "axis"), -1) == -1}
    if not sums and not log_softmax:
        return model
    reshapes = {producers[producers[o].input[0]].output[0] for o in sums}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph("gpu_form.")
    last = g.const(np.array([-1], np.int64), "last")
    indicators: dict[tuple[int, int], str] = {}
    for node in out.graph.node:
        if node.output[0] in reshapes:
            continue
        if node.output[0] in sums:
            x, k, block = sums[node.output[0]]
            if (k, block) not in indicators:
                ind = (np.arange(k)[:, None] // block == np.arange(k // block)[None, :]).astype(np.float32)
                indicators[k, block] = g.const(ind, f"blocks{k}x{block}")
            g.op("MatMul", [x, indicators[k, block]], out=[node.output[0]])
        elif node.output[0] in log_softmax:
            top = g.op1("ReduceMax", [node.input[0], last], keepdims=1)
            shifted = g.op1("Sub", [node.input[0], top])
            total = g.op1("ReduceSum", [g.op1("Exp", [shifted]), last], keepdims=1)
            g.op("Sub", [shifted, g.op1("Log", [total])], out=[node.output[0]])
        else:
            g.nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(g.nodes)
    out.graph.initializer.extend(g.initializers.values())
    return out


DECODE_ROWS_KEY = "edgepipe.decode_rows"  # metadata of a stage graph in the verify form: a decode step runs on this many positions
HEAD_POSITIONS = "head_positions"


def verify_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The form of a stage graph for speculative decoding: a verify pass of k drafted tokens is
    bit-identical, position by position, to one decode step per token.

    Why a form is needed: GroupQueryAttention on the CPU multiplies a single query row with MLAS's
    one-row kernels and several query rows with the general ones, whose sums differ in the last
    bits (measured: every form, fp32 included, differs at one query row and agrees from two on).
    So in this form each GroupQueryAttention pads a lone query position with a copy of itself
    (``Pad`` by ``1 // S`` on the sequence axis, edge mode; its output sliced back): the copy's K/V
    land one position past the sequence, scratch that the next step overwrites (the runner
    reserves it and counts it in ``seqlens_k``, told by ``edgepipe.decode_rows = 2`` in the
    metadata). The 4-bit products pad a lone row as ``pad_lone_rows`` does; every other product
    (float, 8-bit, the GGUF kernel's) gives a row the same bits at one row as at several. The head
    gets an input ``head_positions [P]`` (positions of the sequence axis to run the LM head and
    the sampler on; ``[-1]`` is the plain head), its per-row inputs and outputs then holding
    ``B * P`` rows (sequence-major), and its sampler's distribution as outputs (``sampler_form``)."""
    out = sampler_form(pad_lone_rows(model))
    if out is model:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    g = _Graph("verify.")
    one, zero = g.const(np.array([1], np.int64), "one"), g.const(np.array([0], np.int64), "zero")
    seq_axis, two = g.const(np.array([1], np.int64), "seq_axis"), g.const(np.array([2], np.int64), "two")
    padded: dict[str, str] = {}
    for node in out.graph.node:
        if (node.op_type, node.domain) in (("GroupQueryAttention", MS), (KV_ATTENTION, GGUF_DOMAIN)):
            length = g.op1("Slice", [g.op1("Shape", [node.input[0]]), one, two])  # [S]
            pads = g.op1("Concat", [zero, g.op1("Div", [one, length])], axis=0)  # [0, 1 // S]
            for i in range(3 if node.op_type == "GroupQueryAttention" else 1):  # query, key, value (KvAttention: packed)
                if node.input[i] and node.input[i] not in padded:
                    padded[node.input[i]] = g.op1("Pad", [node.input[i], pads, "", seq_axis], mode="edge")
                if node.input[i]:
                    node.input[i] = padded[node.input[i]]
            result = node.output[0]
            node.output[0] = g.name("attention_padded")
            g.nodes.append(node)
            g.op("Slice", [node.output[0], zero, length, seq_axis], out=[result])
            continue
        if node.op_type == "Gather" and not node.domain and len(node.input) == 2 and node.input[1] == "head.last":
            picked = node.output[0]
            node.input[1] = HEAD_POSITIONS
            node.output[0] = g.name("positions")  # [B, P, H]
            g.nodes.append(node)
            width = g.op1("Slice", [g.op1("Shape", [node.output[0]]), two, g.const(np.array([3], np.int64), "three")])
            g.op("Reshape", [node.output[0], g.op1("Concat", [g.const(np.array([-1], np.int64), "all"), width], axis=0)],
                 out=[picked])  # [B * P, H]
            continue
        g.nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(g.nodes)
    out.graph.initializer.extend(g.initializers.values())
    if not any("head.last" in n.input for n in out.graph.node):
        unused = [i for i, t in enumerate(out.graph.initializer) if t.name == "head.last"]
        for i in reversed(unused):
            del out.graph.initializer[i]
    if any(n.op_type == "Gather" and HEAD_POSITIONS in n.input for n in out.graph.node):
        out.graph.input.append(helper.make_tensor_value_info(HEAD_POSITIONS, INT64, ["positions"]))
    props = {p.key: p.value for p in out.metadata_props}
    helper.set_model_props(out, {**props, DECODE_ROWS_KEY: "2"})
    return out


SAMPLER_OUTPUTS = ("sampler_probs", "sampler_ids")  # the sampler's distribution (sampler_form)


def sampler_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The head with its sampler's distribution as outputs, for speculative sampling (the
    speculative-sampling rule needs the target's and the draft's distributions, not only a draw).

    ``sampler_probs [rows, N]`` float and ``sampler_ids [rows, N]`` int64: the token ids in the
    sampler's order (best logit first) and their kept probabilities after temperature, ``top_k``
    , ``top_p`` and ``min_p`` (zero past the kept prefix, not normalised: the sampler draws from
    ``probs / sum(probs)``); ``N`` is the batch's largest ``top_k`` (the vocabulary for 0). A
    greedy run (``do_sample`` false) gives its token with probability 1 (``N = 1``). These are the
    sampling branch's own tensors, so the distribution is the one ``next_token`` is drawn from,
    to the bit. A graph without a head comes back unchanged."""
    sampler = next((n for n in model.graph.node if n.op_type == "If" and list(n.output) == ["next_token"]), None)
    if sampler is None:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    sampler = next(n for n in out.graph.node if n.op_type == "If" and list(n.output) == ["next_token"])
    branches = {a.name: a.g for a in sampler.attribute}
    sample, greedy = branches["then_branch"], branches["else_branch"]
    sample.output.extend([helper.make_tensor_value_info("s_kept", FLOAT, None), helper.make_tensor_value_info("s_idx", INT64, None)])
    token = greedy.output[0].name
    greedy.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "g_ax1"))
    greedy.node.extend([helper.make_node("Unsqueeze", [token, "g_ax1"], ["g_ids"]),
                        helper.make_node("Equal", ["g_ids", "g_ids"], ["g_all"]),
                        helper.make_node("Cast", ["g_all"], ["g_probs"], to=FLOAT)])
    greedy.output.extend([helper.make_tensor_value_info("g_probs", FLOAT, None), helper.make_tensor_value_info("g_ids", INT64, None)])
    sampler.output.extend(SAMPLER_OUTPUTS)
    out.graph.output.extend([helper.make_tensor_value_info(SAMPLER_OUTPUTS[0], FLOAT, ["rows", "kept"]),
                             helper.make_tensor_value_info(SAMPLER_OUTPUTS[1], INT64, ["rows", "kept"])])
    return out
