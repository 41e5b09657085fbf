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


def checksum(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def chunks(blob: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(blob), size):
        yield blob[i : i + size]
