"""Mixture-of-experts layers: read from GGUF metadata as llama.cpp reads them, built from ONNX ops.

A MoE layer's FFN is a router (``ffn_gate_inp [E, H]``, a float linear to E logits), a top-k
choice per row, and k of E expert FFNs (GGUF stores each projection of all experts as one 3-D
tensor ``ffn_{gate,up,down}_exps [E, N, K]``) whose outputs are summed with the router's weights.
llama.cpp's ``build_moe_ffn`` for the families here (``llama`` with ``expert_count``: Mixtral and
its kin; ``qwen3moe``): probabilities ``softmax`` over all E logits, the k most probable experts,
their probabilities divided by their sum (clamped below at 2^-14), times
``expert_weights_scale`` where the file gives one other than 0 or 1; each expert
``down(silu(gate(x)) * up(x))``, times its weight, summed. ``gpt-oss``: the router's bias added,
the k largest logits chosen and their weights a softmax over those k (``SOFTMAX_WEIGHT``), each
projection's expert bias added, the activation ``swiglu_oai`` (``graphs._glu``), no renormalising.

The graph (``moe_ffn``) groups a step's rows by expert, so an expert's weights are read once per
step for all the rows that chose it and not at all when none did (a one-row decode step reads k
of E experts), and each row's result does not depend on what else is in the batch:

- the kernel form (``gguf``): the three 3-D expert tensors stay the file's blocks as stored, each
  projection one ``GgufMoEMatMul`` of the kernel library (per expert, ``GgufMatMul`` on the rows
  that chose it), the k weighted outputs summed in rank order as llama.cpp sums them;
- every other form: per expert, the rows that chose it are gathered (``NonZero`` + ``GatherND``),
  its FFN (the layer's ordinary linears: ``MatMulNBits``, ``MatMul``) runs on them, and the
  weighted result is added back (``ScatterND``, ``reduction="add"``, experts in index order):
  plain ONNX operators that ONNX Runtime and onnxruntime-web run, about 18 nodes per expert.
  Batch-invariant wherever the products are (4-bit ``MatMulNBits`` in ``graphs.pad_lone_rows``'s
  form, which pads a product only when it holds exactly one row).

Why not ONNX Runtime's ``com.microsoft.MoE``/``QMoE``: in ORT 1.32 the CPU ``MoE`` runs only
fp32 (or fused-SwiGLU) weights, 8x the bytes of the file's 4-bit blocks, and ``QMoE``'s symmetric
4/8-bit layout holds no GGUF block type with minimums (Q4_1, Q4_K) exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable

import numpy as np

from .config import ModelConfig

log = logging.getLogger(__name__)

# Architectures whose MoE layers edgepipe builds, each with llama.cpp's routing for it:
# (normalise the selected weights, gating function). Both use softmax gating today.
MOE_ARCHITECTURES: dict[str, dict] = {
    "llama": {"normalise": True},  # llm_build_llama: LLM_FFN_SILU, norm_w = true, SOFTMAX
    "qwen3moe": {"normalise": True},  # llm_build_qwen3moe: LLM_FFN_SILU, norm_w = true, SOFTMAX
    # llm_build_openai_moe_iswa: LLM_FFN_SWIGLU_OAI_MOE, norm_w = false, SOFTMAX_WEIGHT; biases on the
    # router and on every expert projection
    "gpt-oss": {"normalise": False, "gating": "softmax_weight"},
}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the selected weights' sum here (the smallest normal fp16)
_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (the default where the key is absent)
_GATING_SOFTMAX_WEIGHT = 3  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT: gpt-oss's (its graph fixes it whatever the key says)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0  # llama.cpp's constants for LLM_FFN_SWIGLU_OAI_MOE


def is_moe_layer(has: Callable[[str], bool], layer: int) -> bool:
    return has(f"blk.{layer}.ffn_gate_inp.weight")


def moe_reasons(arch: str, header) -> list[str]:
    """What in a MoE header edgepipe cannot build (empty: go ahead)."""
    m, tensors = header.metadata, header.tensors
    if arch not in MOE_ARCHITECTURES:
        return [f"mixture-of-experts layers of {arch!r} are not supported (supported: {', '.join(MOE_ARCHITECTURES)})"]
    reasons = []
    n_expert, n_used = int(m.get(f"{arch}.expert_count") or 0), int(m.get(f"{arch}.expert_used_count") or 0)
    if not 0 < n_used <= n_expert:
        reasons.append(f"{arch}.expert_used_count {n_used} is not between 1 and expert_count {n_expert}")
    gating = int(m.get(f"{arch}.expert_gating_func") or _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX and not (arch == "gpt-oss" and gating == _GATING_SOFTMAX_WEIGHT):
        reasons.append(f"expert gating function {gating} is not supported (softmax only)")
    extras = sorted({n.split(".", 2)[2].split(".")[0] for n in tensors if n.startswith("blk.")
                     and any(s in n for s in ("_shexp", "exp_probs_b", "ffn_gate_inp_shexp"))})
    if extras:
        reasons.append(f"shared experts or expert selection biases ({', '.join(extras)}) are not supported")
    for name in EXPERT_TENSORS:
        t = tensors.get(f"blk.0.{name}.weight")
        if t is not None and (len(t.shape) != 3 or t.shape[2] != n_expert):
            reasons.append(f"blk.0.{name}.weight has shape {t.shape}, not [K, N, {n_expert}] (GGUF order)")
    return reasons


def required_tensors(names: list[str]) -> list[str]:
    """The dense FFN tensors of layer 0 replaced by its router and experts."""
    dense = ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
    return [n for n in names if n not in dense] + ["blk.0.ffn_gate_inp.weight"] + [f"blk.0.{t}.weight" for t in EXPERT_TENSORS]


def moe_config(cfg: ModelConfig, a: Callable[..., object]) -> ModelConfig:
    """``cfg`` with the experts of the metadata ``a`` ("{arch}.expert_count" ...) filled in."""
    n_expert = int(a("expert_count") or 0)
    if not n_expert:
        return cfg
    return dataclasses.replace(
        cfg, n_experts=n_expert, n_experts_used=int(a("expert_used_count")),
        expert_intermediate_size=int(a("expert_feed_forward_length") or _default_expert_width(cfg, int(a("expert_used_count")))),
        expert_weights_norm=MOE_ARCHITECTURES.get(cfg.architecture, {}).get("normalise", True),
        expert_gating=MOE_ARCHITECTURES.get(cfg.architecture, {}).get("gating", "softmax"),
        expert_weights_scale=float(a("expert_weights_scale") or 0.0),
    )


def _default_expert_width(cfg: ModelConfig, n_used: int) -> int:
    """llama.cpp's expert width where the file gives none: qwen3moe ``n_ff / n_expert_used``; llama ``n_ff``."""
    return cfg.intermediate_size // n_used if cfg.architecture == "qwen3moe" else cfg.intermediate_size


class ExpertView:
    """One expert of a source's 3-D expert tensors, seen as the 2-D ``[N, K]`` tensors the
    importer's linear readers take (``tensor``, ``rows``, ``raw_rows``, ``dense``, ``linear``):
    expert ``e`` is rows ``[e * N, (e + 1) * N)`` of the tensor read as ``[E * N, K]``."""

    def __init__(self, src, expert: int):
        self.src, self.expert = src, expert

    def has(self, name: str) -> bool:
        return self.src.has(name)

    def tensor(self, name: str):
        t = self.src.tensor(name)
        n_expert = t.shape[0]
        share = t.nbytes // n_expert
        return dataclasses.replace(t, shape=tuple(t.shape[1:]), offset=t.offset + self.expert * share, nbytes=share)

    def _first(self, name: str) -> int:
        return self.expert * self.src.tensor(name).shape[1]

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        base = self._first(name)
        return self.src.raw_rows(name, base + start, base + stop)

    def rows(self, name: str, start: int, stop: int):
        base = self._first(name)
        return self.src.rows(name, base + start, base + stop)

    def linear(self, name: str):
        return self.rows(name, 0, self.tensor(name).shape[0])

    def dense(self, name: str) -> np.ndarray:
        from .weights import BlockQuantized

        t = self.tensor(name)
        w = self.linear(name)
        return np.asarray(w.dequantize() if isinstance(w, BlockQuantized) else w, np.float32).reshape(t.shape)


Linear = Callable[..., object]  # (source, *tensor names of the layer) -> the stacked linear in the package's precision


def expert_weights(src, layer: int, linear: Linear, blocks: Callable[[str], object] | None = None) -> dict:
    """A MoE layer's FFN weights: ``router`` float ``[E, H]`` and either ``expert_blocks`` (with
    ``blocks``, the gguf form: each 3-D expert tensor whole, as stored, where the kernel library
    runs its type) or ``experts``, per expert ``{"gate_up": rows of gate then up, "ffn_down"}`` as
    ``linear`` builds them."""
    from ..native import kernel_handles
    from .weights import StoredGGUF

    p = f"blk.{layer}."
    router = np.ascontiguousarray(src.dense(p + "ffn_gate_inp.weight"), np.float32)
    names = dict(zip(("gate", "up", "down"), EXPERT_TENSORS))
    out: dict = {"router": router}
    if src.has(p + "ffn_gate_inp.bias"):  # gpt-oss: the router's and each expert's biases
        out["router_bias"] = src.vector(p + "ffn_gate_inp.bias")
        out["expert_bias"] = {part: np.ascontiguousarray(src.dense(p + name + ".bias").reshape(router.shape[0], -1), np.float32)
                              for part, name in names.items()}
    kinds = {src.tensor(p + n + ".weight").kind for n in names.values()}
    if blocks is not None and all(kernel_handles(k) for k in kinds):
        stored = {part: blocks(name) for part, name in names.items()}
        if all(isinstance(v, StoredGGUF) for v in stored.values()):
            return {**out, "expert_blocks": stored}
    if blocks is not None:
        missing = sorted(k for k in kinds if not kernel_handles(k))
        log.warning("layer %d: the kernel library has no %s: its experts run per expert as MatMulNBits blocks (the fallback "
                    "form's experts, exact)", layer, "/".join(missing))
    experts = []
    for e in range(router.shape[0]):
        view = ExpertView(src, e)
        ew = {"gate_up": linear(view, "ffn_gate_exps", "ffn_up_exps"), "ffn_down": linear(view, "ffn_down_exps")}
        if "expert_bias" in out:
            ew["gate_up_bias"] = np.concatenate([out["expert_bias"]["gate"][e], out["expert_bias"]["up"][e]])
            ew["ffn_down_bias"] = out["expert_bias"]["down"][e]
        experts.append(ew)
    return {**out, "experts": experts}


Ffn = Callable[[str, dict, str], str]  # (rows [n, H], one expert's weights, name prefix) -> [n, H]


def moe_ffn(g, cfg: ModelConfig, x: str, w: dict, ffn: Ffn, glu: Callable[[str, str], str] | None) -> str:
    """The MoE FFN of ``x [B, S, H]`` in graph ``g`` (``graphs._Graph``): ``[B, S, H]`` out.

    With ``expert_blocks`` (the gguf form) each projection is one ``GgufMoEMatMul`` over the 3-D
    blocks (rows grouped by expert in the kernel library), ``glu`` between them, and the
    slots' weighted outputs summed in rank order as llama.cpp sums them; else each expert is
    ``ffn`` on the rows that chose it (``NonZero``/``GatherND``), added back with ``ScatterND``.
    ``glu(gate, up)``: the gated activation between the projections (the kernel form's).

    Routing (``cfg.expert_gating``): "softmax" over all E logits, the k most probable, renormalised
    where ``expert_weights_norm``; "softmax_weight" (gpt-oss): the k largest logits (router bias
    added), their weights a softmax over those k."""
    from onnx import TensorProto

    router = w["router"]
    E, k, H = router.shape[0], cfg.n_experts_used, cfg.hidden_size
    i64 = lambda v, name: g.const(np.array(v, np.int64), name)  # noqa: E731
    shape = g.op1("Shape", [x])
    rows = g.op1("Reshape", [x, i64([-1, H], "moe.rows")])  # [R, H]
    logits = g.linear(rows, router, "router", bias=w.get("router_bias"), rank=2)  # [R, E]
    if cfg.expert_gating == "softmax_weight":
        top, chosen = g.op("TopK", [logits, i64([k], "moe.k")], n_out=2, axis=-1, largest=1, sorted=1)  # [R, k]
        weights = g.op1("Softmax", [top], axis=-1)
    else:
        probs = g.op1("Softmax", [logits], axis=-1)
        weights, chosen = g.op("TopK", [probs, i64([k], "moe.k")], n_out=2, axis=-1, largest=1, sorted=1)  # [R, k]
    if cfg.expert_weights_norm:
        total = g.op1("ReduceSum", [weights, i64([-1], "moe.last")], keepdims=1)
        total = g.op1("Max", [total, g.const(np.array(WEIGHT_SUM_FLOOR, np.float32), "moe.floor")])
        weights = g.op1("Div", [weights, total])
    if cfg.expert_weights_scale not in (0.0, 1.0):
        weights = g.op1("Mul", [weights, g.const(np.array(cfg.expert_weights_scale, np.float32), "moe.scale")])
    axis1 = i64([1], "moe.axis1")
    if "expert_blocks" in w:
        from ..native import DOMAIN, GGML_TYPE_IDS, MOE_OP

        def project(inp: str, part: str) -> str:  # [R, K] or [R, k, K] -> [R, k, N]
            stored = w["expert_blocks"][part]
            n = stored.shape[0] // E
            raw = g.external(stored.raw, f"moe_exps.{part}.gguf", TensorProto.UINT8, [E, n, stored.raw.nbytes // stored.shape[0]])
            return g.op1(MOE_OP, [inp, chosen, raw], domain=DOMAIN, qtype=GGML_TYPE_IDS[stored.kind])

        bias = w.get("expert_bias")

        def biased(y: str, part: str) -> str:  # llama.cpp's ggml_add_id: each slot's expert's bias row
            return y if bias is None else g.op1("Add", [y, g.op1("Gather", [g.const(bias[part], f"moe_exps.{part}.bias"), chosen], axis=0)])

        act = glu(biased(project(rows, "gate"), "gate"), biased(project(rows, "up"), "up"))  # [R, k, F]
        down = biased(project(act, "down"), "down")
        down = g.op1("Mul", [down, g.op1("Unsqueeze", [weights, i64([-1], "moe.last2")])])  # [R, k, H]
        return g.op1("Reshape", [g.op1("ReduceSum", [down, axis1], keepdims=0), shape])
    acc = g.op1("ConstantOfShape", [g.op1("Shape", [rows])], value=_zero_tensor())
    zero = g.const(np.array(0.0, np.float32), "moe.zero")
    for e in range(E):
        hit = g.op1("Equal", [chosen, i64(e, f"moe.e{e}")])  # [R, k]
        weight = g.op1("ReduceSum", [g.op1("Where", [hit, weights, zero]), axis1], keepdims=0)  # [R]
        picked = g.op1("ReduceMax", [g.op1("Cast", [hit], to=TensorProto.INT32), axis1], keepdims=0)  # [R] 0/1
        index = g.op1("Transpose", [g.op1("NonZero", [picked])], perm=[1, 0])  # [n, 1]: the rows that chose e
        y = ffn(g.op1("GatherND", [rows, index]), w["experts"][e], f"exp{e}.")  # [n, H]
        y = g.op1("Mul", [y, g.op1("Unsqueeze", [g.op1("GatherND", [weight, index]), axis1])])
        acc = g.op1("ScatterND", [acc, index, y], reduction="add")
    return g.op1("Reshape", [acc, shape])


def _zero_tensor():
    from onnx import helper, TensorProto

    return helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])


def expert_file_bytes(files: dict[str, tuple[str, int]], n_experts: int) -> int:
    """One expert's weight bytes in a unit's externalized initializers (``name -> (sha, bytes)``:
    expert 0's ``l{unit}.exp0.*``, or the whole 3-D ``l{unit}.moe_exps.*`` over ``n_experts``, as
    ``moe_ffn`` names them); 0 for a dense unit."""
    whole = sum(n for name, (_, n) in files.items() if ".moe_exps." in name)
    return sum(n for name, (_, n) in files.items() if ".exp0." in name) + (whole // n_experts if n_experts else 0)


def routed_file_bytes(files: dict[str, tuple[str, int]], n_experts: int, n_used: int) -> int:
    """Weight bytes one decode row reads of a unit (``name -> (sha, bytes)``, each blob once): all
    of a dense unit's; of a MoE layer its shared initializers (attention, router, norms) and
    ``n_used`` experts' (what the import's estimate of an unmeasured layer prices, as the one-row
    step it measures elsewhere reads)."""
    one = expert_file_bytes(files, n_experts)
    if not one:
        return sum(dict(files.values()).values())
    shared = {sha: n for name, (sha, n) in files.items() if ".moe_exps." not in name and not _EXPERT_NAME.search(name)}
    return sum(shared.values()) + n_used * one


_EXPERT_NAME = re.compile(r"\.exp\d+\.")


def with_experts(units: list, unit_files, precision: str, cfg: ModelConfig) -> list:
    """The importer's units with their MoE layers marked (``experts``, ``experts_used``) and their
    ``precision`` variant's bytes counted as a worker holds them: every expert's initializer (an
    upcycled file's identical experts share one blob, yet each is loaded), ``expert_bytes`` one
    expert's share. ``unit_files``: per unit index, ``initializer name -> (sha, bytes)``."""
    out = []
    for u in units:
        files = unit_files.get(u.index) if isinstance(unit_files, dict) else unit_files[u.index]
        one = expert_file_bytes(files or {}, cfg.n_experts)
        if not one or precision not in u.variants:
            out.append(u)
            continue
        variant = dataclasses.replace(u.variants[precision], weight_bytes=sum(n for _, n in files.values()), expert_bytes=one)
        out.append(dataclasses.replace(u, experts=cfg.n_experts, experts_used=cfg.n_experts_used,
                                       variants={**u.variants, precision: variant}))
    return out
