"""One version's weights as the trainer pushes them: flat CPU copies in the wire dtype (`tensors-v1`,
services/common/weights.py), taken by the learner and encoded by the trainer's weight pusher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.common.contracts import ws
from services.common.weights import ITEMSIZE, state_checksum, torch_dtype

_NAMES = {torch_dtype(k): k for k in ITEMSIZE}


def raw_bytes(t: torch.Tensor) -> Any:
    """A tensor's bytes as a numpy view (no copy)."""
    return t.view(torch.uint8).numpy()


@dataclass(frozen=True)
class Snapshot:
    """One version's weights as pushed: flat contiguous CPU copies in the wire dtype, tied
    parameters once (under their first name; receivers keep their own tie, as `save_pretrained`)."""

    version: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    tensors: list[torch.Tensor]
    dtype: str
    checksum: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors) * ITEMSIZE[self.dtype]

    def specs(self) -> list[ws.TensorSpec]:
        return [
            ws.TensorSpec(name=n, dtype=self.dtype, shape=s)
            for n, s in zip(self.names, self.shapes, strict=True)
        ]


def snapshot(state_dict: dict[str, torch.Tensor], version: int, dtype: str | None = None) -> Snapshot:
    """Copies the weights for the wire; `dtype` None keeps the training dtype."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    names, shapes, tensors = [], [], []
    wire: torch.dtype | None = torch_dtype(dtype) if dtype else None
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        target = wire or t.dtype
        if target not in _NAMES:
            raise ValueError(f"{name}: {t.dtype} cannot go on the wire; set training.push_dtype")
        names.append(name)
        shapes.append(tuple(t.shape))
        tensors.append(t.detach().to(device="cpu", dtype=target, copy=True).reshape(-1))
    name = _NAMES[tensors[0].dtype] if tensors else "float32"
    if any(_NAMES[t.dtype] != name for t in tensors):
        raise ValueError("mixed parameter dtypes: set training.push_dtype to push one")
    digest = state_checksum(raw_bytes(t) for t in tensors)
    return Snapshot(version, names, shapes, tensors, name, digest)
