"""MoE GGUF files for tests: a dense model "upcycled" into a mixture of identical experts.

Each layer's FFN (gate, up, down, its blocks as stored) is copied into ``experts`` experts,
stacked as llama.cpp stores them (3-D ``ffn_{gate,up,down}_exps``), under a random float32
router. With the selected weights renormalised (llama.cpp's ``norm_w`` for these families),
every layer computes ``sum_i w_i * ffn(x)`` with ``sum_i w_i = 1``: the dense layer up to float
rounding, so the dense model's greedy text is the reference, with no MoE download.

``tied``: the router's rows come in groups of ``used`` equal rows (a random row per group), so
each row picks one whole group (which group varies from row to row) and each weight is exactly
``1 / used``; with ``used = 2``, ``y / 2 + y / 2 == y`` in float: the MoE layer equals the dense
layer to the bit wherever its products give a row the same bits in any batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_DENSE = ("ffn_gate", "ffn_up", "ffn_down")


def upcycle(source: Path, target: Path, experts: int = 4, used: int = 2, seed: int = 0, tied: bool = False) -> Path:
    """Write ``target``: ``source`` (a dense ``llama`` GGUF) with every FFN turned into
    ``experts`` copies, ``used`` of them routed per row, under a seeded random router."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_uint32(f"{arch}.expert_count", experts)
    writer.add_uint32(f"{arch}.expert_used_count", used)
    rng = np.random.default_rng(seed)
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in _DENSE:
            layer = parts[1]
            stacked = np.ascontiguousarray(np.broadcast_to(t.data, (experts, *t.data.shape)))
            writer.add_tensor(f"blk.{layer}.{parts[2]}_exps.weight", stacked, raw_shape=stacked.shape, raw_dtype=t.tensor_type)
            if parts[2] == "ffn_gate":
                router = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1
                if tied:
                    router = np.repeat(router[::used], used, axis=0)[:experts]
                writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)  # bytes per row for blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
