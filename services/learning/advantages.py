"""Group-relative advantages (GRPO), in plain Python: the trainer's shell uses them to filter groups
without importing torch."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def informative(rewards: Sequence[float]) -> bool:
    """A group whose rewards are not all equal: the only kind with a non-zero advantage."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""grpo: (r - mean) / (std + eps) (DeepSeekMath); dr_grpo: r - mean, no std scaling (Dr. GRPO,
arXiv 2503.20783: the std favours groups of near-equal rewards); rloo: r minus the mean of the
*other* samples of the group, n / (n - 1) · (r - mean) (RLOO, arXiv 2402.14740)."""


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6, estimator: str = "grpo"
) -> list[float]:
    """Each sample's advantage within its group, by `estimator` (ESTIMATORS); a group of equal
    rewards carries no signal (0 under every estimator), nor does a group of one under rloo.

    The std is the population std of the group (divides by n), as the group is the whole sample.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; one of {', '.join(ESTIMATORS)}")
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
        if not informative(rs):
            continue
        for i, r in zip(idx, rs, strict=True):
            if estimator == "grpo":
                out[i] = (r - mean) / (std + eps)
            elif estimator == "dr_grpo":
                out[i] = r - mean
            else:
                out[i] = len(rs) / (len(rs) - 1) * (r - mean)
    return out
