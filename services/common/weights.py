"""Weight blobs on the wire: a safetensors serialisation, its sha256, and fixed-size chunks."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any


def pack_state_dict(state_dict: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})


def unpack_state_dict(blob: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(blob)


def read_header(blob: bytes) -> dict[str, Any]:
    """The tensor names and shapes of a safetensors blob, checked without torch (an emulated engine
    validates what it is pushed but keeps no tensors); ValueError when it is not safetensors."""
    import json
    import struct

    if len(blob) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > len(blob) - 8:
        raise ValueError("header length past the end of the blob")
    try:
        header = json.loads(blob[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a mapping")
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def checksum(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def chunks(blob: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(blob), size):
        yield blob[i : i + size]
