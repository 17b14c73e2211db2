"""The model package manifest: what a unit is, which files it needs, what it costs.

This module is read by workers too, so it needs nothing beyond the standard library.
A package on disk is a directory ``<name>/`` with ``manifest.json`` and ``blobs/<sha256>``;
every graph, weight and tokenizer file is a blob named by the SHA-256 of its bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

FORMAT_VERSION = 1
UnitKind = Literal["embedding", "layer", "head"]


class HashMismatch(ValueError):
    """A blob's bytes do not hash to its name."""


@dataclass(frozen=True)
class UnitVariant:
    """One way to run a unit: its graph blob and the weight blobs that graph references."""

    precision: str  # "int4" | "int8" | "fp32"
    graph: str  # sha256 of the unit's ONNX graph (weights external)
    files: tuple[str, ...]  # sha256 of each weight file, sorted
    weight_bytes: int  # bytes of files owned by this unit (shared tables excluded)
    kv_bytes_per_token: int | None = None  # where this variant's KV differs from the unit's (the gguf form's fp16 cache)
    expert_bytes: int = 0  # a MoE layer: one expert's weight bytes in this variant (weight_bytes counts all of them); 0 = dense


@dataclass(frozen=True)
class Unit:
    index: int
    kind: UnitKind
    name: str
    cost_s: float  # measured seconds for one decode token on the importing machine
    kv_bytes_per_token: int
    out_bytes_per_token: int  # activation (or token id) bytes leaving this unit per token
    variants: dict[str, UnitVariant] = field(default_factory=dict)
    kv_window: int = 0  # positions of KV kept at most (sliding-window layer); 0 = the whole context
    experts: int = 0  # a MoE layer (model/moe.py): E experts, of which each row is routed to `experts_used`; 0 = dense
    experts_used: int = 0


@dataclass(frozen=True)
class Manifest:
    format: int
    name: str
    source: dict  # {"path", "sha256", "kind"}
    precision: str  # the default variant
    config: dict  # ModelConfig.to_dict()
    units: tuple[Unit, ...]
    shared_files: dict[str, tuple[str, ...]]  # precision -> blobs every stage needs (rotary tables)
    tokenizer: str  # sha256 of tokenizer.json
    chat_template: str | None
    eos_ids: tuple[int, ...]
    bos_id: int | None
    add_bos: bool
    max_context: int

    @property
    def n_layers(self) -> int:
        return self.config["n_layers"]

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    def variant(self, unit: int, precision: str | None = None) -> UnitVariant:
        u = self.units[unit]
        key = precision or self.precision
        if key not in u.variants:
            raise KeyError(f"unit {unit} has no {key} variant (has {', '.join(u.variants)})")
        return u.variants[key]

    def kv_bytes_per_token(self, unit: int, precision: str | None = None) -> int:
        """KV bytes per position of ``unit`` when run as ``precision``'s variant (default: the
        package's own): the kernel form keeps an fp16 cache, half the fp32 one of the others."""
        u = self.units[unit]
        variant = u.variants.get(precision or self.precision)
        return u.kv_bytes_per_token if variant is None or variant.kv_bytes_per_token is None else variant.kv_bytes_per_token

    def stage_files(self, start: int, end: int, precision: str | None = None) -> tuple[str, ...]:
        """Every weight blob a stage ``[start, end)`` needs, sorted and unique."""
        prec = precision or self.precision
        files = set(self.shared_files.get(prec, ())) if any(self.units[u].kind == "layer" for u in range(start, end)) else set()
        for u in range(start, end):
            files.update(self.variant(u, prec).files)
        return tuple(sorted(files))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        d = json.loads(text)
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"manifest format {d.get('format')} is not {FORMAT_VERSION}")
        units = tuple(
            Unit(**{**u, "variants": {k: UnitVariant(**{**v, "files": tuple(v["files"])}) for k, v in u["variants"].items()}})
            for u in d.pop("units")
        )
        d["shared_files"] = {k: tuple(v) for k, v in d["shared_files"].items()}
        d["eos_ids"] = tuple(d["eos_ids"])
        return cls(units=units, **d)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_blob(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise HashMismatch(f"{path.name}: sha256 is {actual[:16]}…, expected {expected[:16]}…")
