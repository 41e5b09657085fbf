"""Group-relative advantages (GRPO), in plain Python: the trainer's shell uses them to filter groups
without importing torch."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def informative(rewards: Sequence[float]) -> bool:
    """A group whose rewards are not all equal: the only kind with a non-zero advantage."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """(reward - group mean) / (group std + eps) per group; a group of equal rewards carries no signal.

    The std is the population std of the group (divides by n), as the group is the whole sample.
    """
    if len(rewards) != len(groups):
        raise ValueError("rewards and groups must have the same length")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        rs = [float(rewards[i]) for i in idx]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for i, r in zip(idx, rs, strict=True):
            out[i] = (r - mean) / (std + eps) if informative(rs) else 0.0
    return out
