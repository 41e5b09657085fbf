"""Data-parallel gradients for a training step: how a hybrid worker adds its share.

A step's micro-batches are dealt out over the replicas of a process group (torch.distributed:
gloo on CPU, NCCL on GPU, a group of its own): each replica runs forward and backward on its share
with the step's global token count as the loss denominator, then the gradients are summed over the
group. The sum is the single-process step's gradient up to floating-point reduction order, so the
step's result does not depend on how many replicas helped. Only the trainer (rank 0) clips and
steps; a hybrid replica holds the same weights (it is an engine at the current version) and
contributes gradients only, so it needs no optimizer state to join.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def share(batches: Sequence[T], rank: int, world: int) -> list[T]:
    """The micro-batches replica `rank` of `world` computes: dealt round-robin in the order the
    step made them (sorted by length, so every replica gets a similar mix of short and long)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    return list(batches[rank::world])


def all_reduce_gradients(model: torch.nn.Module, group: Any = None) -> None:
    """Sums every parameter's gradient over the group, in place, as one flat buffer. A parameter
    without a gradient on this replica (its share touched nothing that reaches it) counts as zero,
    so every replica sends a buffer of the same layout."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        chunk = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n
