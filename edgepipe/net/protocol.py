"""Frames between coordinator and workers: a msgpack header followed by raw tensor bytes.

    frame := u32 little-endian header length | msgpack header | tensor bytes ...

The header is a map with at least ``type`` (a :class:`MessageType` value) and ``v`` (the
protocol version). Tensors are described in ``header["tensors"]`` as ``[name, dtype, shape]``
and their bytes follow the header in that order, C-contiguous. ``decode`` checks every length
against the frame, so a truncated or garbage frame raises :class:`ProtocolError` with one line
that says what is wrong, and nothing is half-applied. See ``docs/protocol.md``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import Enum

import msgpack
import numpy as np

from .. import PROTOCOL_VERSION

MAX_HEADER_BYTES = 1 << 20
ALLOWED_DTYPES = {"float32", "float16", "int64", "int32", "uint8", "bool"}


class ProtocolError(ValueError):
    """A frame that cannot be decoded or does not belong to this protocol."""


class MessageType(str, Enum):
    HELLO = "hello"  # worker -> coordinator: who I am, what I can hold
    WELCOME = "welcome"  # coordinator -> worker: your id
    LOAD = "load"  # coordinator -> worker: fetch these files, build this stage
    LOADED = "loaded"  # worker -> coordinator: stage ready (or failed)
    ACTIVATE = "activate"  # coordinator -> worker: switch to the prepared plan
    FORWARD = "forward"  # input of a stage: token ids or activations of one sequence
    TOKEN = "token"  # last stage -> coordinator: the sampled token
    DROP = "drop"  # free a sequence's KV cache
    PING = "ping"
    PONG = "pong"
    PROBE = "probe"  # coordinator -> worker: time these unit ranges / links
    PROBED = "probed"
    KV_EXPORT = "kv_export"  # coordinator -> worker: send this sequence's KV to a peer
    KV = "kv"  # worker -> worker: KV tensors of a sequence
    EMULATE = "emulate"  # coordinator -> worker: change emulated slowdown (tests, benchmarks)
    NOTICE = "notice"  # coordinator -> worker: what it is preparing for that worker (a status line; no reply)
    DRAFT_LOAD = "draft_load"  # coordinator -> drafter worker: fetch and build the draft model, time its steps
    DRAFT_READY = "draft_ready"  # drafter worker -> coordinator: the draft model is built (or not), its step time
    DRAFT = "draft"  # coordinator -> drafter worker: draft k tokens after these ids
    DRAFTED = "drafted"  # drafter worker -> coordinator: the drafts (and their distributions)
    ERROR = "error"
    BYE = "bye"


@dataclass
class Message:
    type: MessageType
    fields: dict = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, key):
        return self.fields[key]

    def get(self, key, default=None):
        return self.fields.get(key, default)


def encode(msg: Message) -> bytes:
    specs, blobs = [], []
    for name, arr in msg.tensors.items():
        arr = np.ascontiguousarray(arr)
        specs.append([name, arr.dtype.name, list(arr.shape)])
        blobs.append(arr.tobytes())
    header = msgpack.packb({**msg.fields, "type": msg.type.value, "v": PROTOCOL_VERSION, "tensors": specs}, use_bin_type=True)
    return b"".join([struct.pack("<I", len(header)), header, *blobs])


def decode(frame: bytes, expect_version: int = PROTOCOL_VERSION) -> Message:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("expected a binary frame, got text")
    if len(frame) < 4:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than its length prefix")
    (n,) = struct.unpack_from("<I", frame)
    if n > MAX_HEADER_BYTES or 4 + n > len(frame):
        raise ProtocolError(f"header length {n} does not fit a frame of {len(frame)} bytes")
    try:
        header = msgpack.unpackb(bytes(frame[4:4 + n]), raw=False)
    except Exception as exc:
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.pop("v", None)
    if version != expect_version:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {expect_version})")
    try:
        mtype = MessageType(header.pop("type", None))
    except ValueError:
        raise ProtocolError(f"unknown message type {header.get('type')!r}") from None
    specs = header.pop("tensors", [])
    tensors: dict[str, np.ndarray] = {}
    offset = 4 + n
    for spec in specs if isinstance(specs, list) else [None]:
        if not (isinstance(spec, list) and len(spec) == 3 and spec[1] in ALLOWED_DTYPES and isinstance(spec[2], list)):
            raise ProtocolError(f"bad tensor description {spec!r}")
        name, dtype, shape = spec
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ProtocolError(f"tensor {name}: bad shape {shape}")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if offset + size > len(frame):
            raise ProtocolError(f"tensor {name} needs {size} bytes, frame has {len(frame) - offset} left (truncated)")
        tensors[name] = np.frombuffer(frame, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=offset).reshape(shape)
        offset += size
    if offset != len(frame):
        raise ProtocolError(f"{len(frame) - offset} unexpected bytes after the tensors")
    return Message(mtype, header, tensors)


def error_frame(message: str, **fields) -> bytes:
    return encode(Message(MessageType.ERROR, {"message": message, **fields}))
