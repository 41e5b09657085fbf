"""The weight-push wire format `tensors-v1`: a header naming the tensors, then records a receiver
checks and applies one at a time, so it never holds more than one record beyond its own weights.

A record is one `WeightChunk` message: a dense slice (elements offset .. offset+count of a
flattened tensor, raw little-endian bytes in the wire dtype) or a sparse one (the new values of the
elements it lists; indices as uint16 gaps from `offset`, or absolute int32/int64). Each carries the
crc32 of its bytes, checked before it is applied; the header carries the sha256 of the whole state
after the push (`state_checksum`), which the receiver recomputes from what it holds.

This module is torch-free (an emulated engine checks records without torch); the torch side of
encoding is in `services/trainer/weight_push.py`, of applying in `services/rollout_engine/weight_sync.py`.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from services.common.contracts import ws

FORMAT = "tensors-v1"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Wire dtypes and their element sizes."""
INDEX_BYTES = (2, 4, 8)
"""2: uint16 gaps from the record's offset (first gap from the offset itself); 4, 8: absolute."""


class RecordError(ValueError):
    """A record that does not fit its header; `code` is the PushAck code it earns."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def numel(spec: ws.TensorSpec) -> int:
    return math.prod(int(d) for d in spec.shape)


def record_crc(indices: bytes, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(indices)) & 0xFFFFFFFF


def check_specs(specs: Sequence[ws.TensorSpec]) -> None:
    """Raises RecordError('malformed') for a manifest a receiver cannot use."""
    if not specs:
        raise RecordError("malformed", "the header names no tensors")
    seen: set[str] = set()
    for s in specs:
        if not s.name or s.name in seen:
            raise RecordError("malformed", f"tensor name {s.name!r} is empty or repeated")
        seen.add(s.name)
        if s.dtype not in ITEMSIZE:
            raise RecordError("malformed", f"{s.name}: unsupported wire dtype {s.dtype!r}")
        if any(d < 0 for d in s.shape):
            raise RecordError("malformed", f"{s.name}: negative dimension in {list(s.shape)}")


def check_record(chunk: ws.WeightChunk, specs: Sequence[ws.TensorSpec]) -> ws.TensorSpec:
    """The tensor a record writes, once its framing and crc32 are right; RecordError otherwise.
    Sparse indices are range-checked by the receiver that decodes them."""
    if chunk.HasField("header"):
        raise RecordError("malformed", f"a second header at record {chunk.index}")
    if not 0 <= chunk.tensor < len(specs):
        raise RecordError("malformed", f"record {chunk.index}: tensor {chunk.tensor} is not in the header")
    spec = specs[chunk.tensor]
    n, size = numel(spec), ITEMSIZE[spec.dtype]
    if chunk.count <= 0 or len(chunk.data) != chunk.count * size:
        raise RecordError(
            "malformed",
            f"record {chunk.index}: {len(chunk.data)} bytes for {chunk.count} {spec.dtype} values",
        )
    if chunk.indices:
        if chunk.index_bytes not in INDEX_BYTES or len(chunk.indices) != chunk.count * chunk.index_bytes:
            raise RecordError(
                "malformed", f"record {chunk.index}: indices do not match count and index_bytes"
            )
        if chunk.count > n or not 0 <= chunk.offset < max(n, 1):
            raise RecordError("malformed", f"record {chunk.index}: sparse record outside {spec.name}")
    elif chunk.offset < 0 or chunk.offset + chunk.count > n:
        raise RecordError("malformed", f"record {chunk.index}: elements past the end of {spec.name}")
    if record_crc(chunk.indices, chunk.data) != chunk.crc32:
        raise RecordError("checksum_mismatch", f"record {chunk.index}: crc32 differs")
    return spec


def record_indices(indices: bytes, index_bytes: int, offset: int) -> Any:
    """A sparse record's flat element indices as an int64 tensor: 2-byte records carry the gaps
    from `offset` (uint16, cumulated), 4- and 8-byte ones the indices themselves. The caller checks
    them against its tensor's size."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer on read-only bytes
        if index_bytes == 2:
            gaps = torch.frombuffer(indices, dtype=torch.int16).to(torch.int64) & 0xFFFF
            return offset + torch.cumsum(gaps, 0)
        width = torch.int32 if index_bytes == 4 else torch.int64
        return torch.frombuffer(indices, dtype=width).to(torch.int64)


def state_checksum(buffers: Iterable[Any]) -> str:
    """sha256 over the tensors' raw bytes in order (anything exposing the buffer protocol)."""
    h = hashlib.sha256()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


def payload_bytes(chunk: ws.WeightChunk) -> int:
    return len(chunk.data) + len(chunk.indices)


def subtree(node: ws.RelayNode) -> list[str]:
    """A relay node's address and every address below it."""
    return [node.addr, *(a for c in node.children for a in subtree(c))]


def torch_dtype(name: str) -> Any:
    """The torch dtype of a wire dtype name (imports torch: receivers with tensors only)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def tensor_of(data: bytes, dtype: str) -> Any:
    """A record's values as a 1-D torch tensor viewing its bytes (no copy; never written)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: it is only read
        raw = torch.frombuffer(data, dtype=torch.float32 if dtype == "float32" else torch.int16)
    return raw.view(torch_dtype(dtype))
