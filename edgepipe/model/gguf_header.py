"""Read a GGUF header (metadata and tensor table, no tensor data) fast, and refuse what we cannot build.

The one GGUF header parser (``gguf_source`` reads the file through it too). ``gguf.GGUFReader``
parses every metadata array element by element, which takes ~25 s for a 262k-token vocabulary;
``read_header`` skips arrays it does not need in one step per array (string arrays: one length
read per string), so a refusal comes from the header in well under a second; ``parse_header``
with ``full_arrays`` decodes them (numeric arrays in one numpy call) for the importer.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..native.quant_types import FLOAT_TYPES, QUANT_TYPES, type_name
from .config import UnsupportedModel
from .families import family, refusal

# GGUF metadata value types: id -> (struct format, size); 8 = string, 9 = array.
_SCALAR = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 64  # arrays up to this many elements are kept; longer ones become their length

# Tensor types (ggml ids) the importer keeps exactly: the float ones and the rows of the type table.
TENSOR_TYPES = {**{i: name for name, i in FLOAT_TYPES.items()}, **{t.ggml_id: t.name for t in QUANT_TYPES}}
# RoPE scaling kinds the graphs reproduce ("su"/"longrope" arrive as factor tensors).
ROPE_SCALING = ("none", "linear", "llama3", "longrope", "su", "yarn")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest axis first
    type_id: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict  # key -> value; long arrays -> their length (int)
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


def read_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file; raises ``ValueError`` on a damaged header."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, table, _ = parse_header(buf, full_arrays=False)
    return GGUFHeader(meta, {name: TensorInfo(name, shape, type_id) for name, shape, type_id, _offset in table})


def parse_header(buf, full_arrays: bool) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """``(metadata, [(name, shape, ggml type, data offset)], end of header)`` of the GGUF in
    ``buf`` (bytes or an mmap). Arrays longer than ``_KEEP_ARRAY`` become their length unless
    ``full_arrays``. Raises ``ValueError`` (or ``struct.error``) on a damaged header."""
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    pos = 24
    meta: dict = {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        meta[key], pos = _value(buf, pos, vtype, full_arrays)
    table = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        type_id, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        table.append((name, tuple(int(d) for d in shape), int(type_id), int(offset)))
    return meta, table, pos


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if pos + 8 + n > len(buf):
        raise ValueError("header runs past the end of the file")
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _value(buf, pos: int, vtype: int, full_arrays: bool = False):
    if vtype in _SCALAR:
        fmt, size = _SCALAR[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + size
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR and (full_arrays or n > _KEEP_ARRAY):
            end = pos + n * _SCALAR[etype][1]
            if end > len(buf):
                raise ValueError("header runs past the end of the file")
            return (np.frombuffer(buf, np.dtype(_SCALAR[etype][0]), n, pos).tolist() if full_arrays else n), end
        if etype == _STRING and full_arrays:  # vocabularies and merges: the hot loop of the header
            items, unpack = [], struct.unpack_from
            for _ in range(n):
                (length,) = unpack("<Q", buf, pos)
                pos += 8
                items.append(bytes(buf[pos : pos + length]).decode("utf-8", errors="replace"))
                pos += length
            if pos > len(buf):
                raise ValueError("header runs past the end of the file")
            return items, pos
        if n <= _KEEP_ARRAY or full_arrays:
            items = []
            for _ in range(n):
                item, pos = _value(buf, pos, etype, full_arrays)
                items.append(item)
            return items, pos
        if etype == _STRING:
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + length
            return n, pos
        for _ in range(n):  # arrays of arrays: rare, walk them
            _, pos = _value(buf, pos, etype)
        return n, pos
    raise ValueError(f"unknown metadata value type {vtype}")


def unsupported_reasons(header: GGUFHeader) -> list[str]:
    """Everything in this header that edgepipe cannot build (empty: go ahead)."""
    from .tokenizer import SUPPORTED_TOKENIZERS

    m = header.metadata
    arch = header.architecture
    refused = refusal(arch)
    if refused:
        return [refused]
    fam = family(arch)
    reasons = []
    tok_model = m.get("tokenizer.ggml.model")
    if tok_model is None:
        reasons.append("no tokenizer in the file (tokenizer.ggml.model is missing)")
    elif tok_model not in SUPPORTED_TOKENIZERS:
        reasons.append(f"tokenizer model {tok_model!r} is not supported (supported: {', '.join(SUPPORTED_TOKENIZERS)})")
    bad = sorted({type_name(t.type_id) for t in header.tensors.values() if t.type_id not in TENSOR_TYPES})
    if bad:
        reasons.append(f"tensor type {', '.join(bad)} is not supported (supported: {', '.join(TENSOR_TYPES.values())})")
    scaling = m.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ROPE_SCALING:
        reasons.append(f"RoPE scaling {scaling!r} is not supported (supported: {', '.join(ROPE_SCALING)})")
    if m.get(f"{arch}.expert_count"):
        from .moe import moe_reasons

        reasons += moe_reasons(arch, header)
    required = fam.required_tensors(header.tensors)
    if m.get(f"{arch}.expert_count"):  # the router and 3-D experts instead of the dense FFN
        from .moe import required_tensors

        required = required_tensors(required)
    missing = [n for n in dict.fromkeys(required) if n not in header.tensors]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        reasons.append(f"missing tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:4])}{more}")
    return reasons


def check_supported(path: str | Path) -> GGUFHeader:
    """Read the header and raise ``UnsupportedModel`` naming everything that is missing."""
    from .gguf_source import CorruptModel

    try:
        header = read_header(path)
    except (ValueError, struct.error, OSError) as exc:
        raise CorruptModel(f"{Path(path).name}: not a readable GGUF file, truncated or damaged ({exc})") from None
    reasons = unsupported_reasons(header)
    if reasons:
        raise UnsupportedModel(f"{Path(path).name}: " + "; ".join(reasons))
    return header
