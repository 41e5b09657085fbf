"""Trajectories of random tokens for trainer tests: two groups of three, of different lengths."""

from __future__ import annotations

import random

from services.learning.data import Sample


def random_groups(seed: int, version: int = 0) -> list[Sample]:
    """Two groups of three with rewards 0, 1, 2 (every group has an advantage) and 3-6 prompt
    tokens, 2-7 generated ones each (their behaviour logprobs sampled at `version`)."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        for i in range(3):
            n_prompt, n_gen = rng.randint(3, 6), rng.randint(2, 7)
            ids = [rng.randint(5, 400) for _ in range(n_prompt + n_gen)]
            mask = [False] * n_prompt + [True] * n_gen
            lps = [0.0] * n_prompt + [rng.uniform(-6.0, -3.0) for _ in range(n_gen)]
            versions = [-1] * n_prompt + [version] * n_gen
            out.append(Sample(f"s{seed}-{g}-{i}", f"g{seed}-{g}", float(i), ids, mask, lps, None, versions))
    return out
