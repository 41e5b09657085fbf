"""How often a drafter's tokens are accepted, from the one published measurement that separates
a response's own history from its GRPO siblings'.

Seer (arXiv 2511.14617 v3, §2.3 Table 2) drafted rollouts of 20 prompt groups from a response's
own history plus the responses of `n` siblings of its group and measured the mean accepted length
per verify step, bonus token included (single draft path, maximum draft length 8, §4.1):
1.70 with n = 0, 2.04 with 1, 2.32 with 5 and 2.53 with 15. We interpolate linearly in log(1 + n)
and turn the length into a per-token acceptance at draft length 8 (Leviathan et al., arXiv
2211.17192, Eq. 1), which the engine's speculation policy can then price at any draft length.

The drafters differ only in which siblings they can read when a turn starts:
- `ngram` (vLLM's prompt lookup): none, the sequence's own context (n = 0).
- `suffix` (vLLM's suffix decoding, arXiv 2411.04975): responses this engine process generated,
  so only the siblings whose same turn finished on this engine.
- `group` (Libra; Seer's grouped drafting): every sibling whose same turn has finished, wherever
  it ran, since the scheduler that owns the group ships them with the turn.

Counting only finished turns is conservative for `group` (Seer's draft server also reads
siblings still decoding); the curve's height is what the result is most sensitive to, so
`scale` stretches every accepted length above 1 (0.5 halves the extra tokens per step).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from services.policy.speculation import acceptance_for

DRAFTERS = ("none", "ngram", "suffix", "group")
SEER_TABLE2 = ((0, 1.70), (1, 2.04), (5, 2.32), (15, 2.53))
"""(sibling responses referenced, mean accepted tokens per verify step): Seer v3 Table 2."""
SEER_DRAFT = 8
"""Seer's maximum draft length (§4.1), at which Table 2's lengths are read."""


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    scale: float = 1.0
    """Multiplier on every accepted length above one token (sensitivity)."""

    def __post_init__(self) -> None:
        if self.scale < 0:
            raise ValueError(f"acceptance scale must be >= 0, got {self.scale}")

    def tokens_per_step(self, siblings: int) -> float:
        """Mean accepted tokens per verify step at draft length 8 with `siblings` references."""
        xs = [math.log1p(n) for n, _ in SEER_TABLE2]
        ys = [t for _, t in SEER_TABLE2]
        x = math.log1p(max(0, siblings))
        i = min(len(xs) - 1, max(1, bisect.bisect_left(xs, x)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        y = y1 if x >= xs[-1] else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return min(SEER_DRAFT + 1.0, 1.0 + self.scale * (y - 1.0))

    def acceptance(self, siblings: int) -> float:
        """Per-token acceptance of a drafter reading `siblings` sibling responses."""
        key = (self.scale, siblings)
        a = _CACHE.get(key)
        if a is None:
            a = _CACHE[key] = round(acceptance_for(self.tokens_per_step(siblings), SEER_DRAFT), 3)
        return a


_CACHE: dict[tuple[float, int], float] = {}
