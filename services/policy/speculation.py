"""How many drafted tokens each running sequence verifies per decode step (speculative decoding).

A drafted token costs one more query token in the verify forward. While decoding is memory-bound
(small batch or long contexts: the tail of a rollout) that is nearly free; when it is
compute-bound (a large batch of short contexts) it is not, and a fixed draft length slows the
engine down. The policy groups the running sequences by their drafter's per-token acceptance
(a *lane*) and picks a draft length per lane that maximises the engine's accepted tokens per
second, priced by the engine's own step-time function — the length- and load-aware budget of
DAS (arXiv 2511.13841) and TLT (arXiv 2511.16665). Pure: no clock, no I/O; the live engine and the
simulator call the same object.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MODES = ("off", "fixed", "adaptive")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits with `k` drafted tokens when each is accepted with probability
    `alpha` once the previous one was: the accepted prefix plus the target model's own token
    (Leviathan et al., arXiv 2211.17192, §3.1 Eq. 1: (1 - a^(k+1)) / (1 - a))."""
    if k <= 0 or alpha <= 0.0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_for(tokens_per_step: float, k: int) -> float:
    """The per-token acceptance that yields `tokens_per_step` at draft length `k`: how a published
    mean accepted length (measured at one draft length) becomes a model usable at any length."""
    if k <= 0 or tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True, slots=True)
class Lane:
    """Running sequences that share one drafter acceptance."""

    sequences: int
    acceptance: float


@dataclass(frozen=True, slots=True)
class SpeculationPolicy:
    """`off`: plain decoding. `fixed`: every sequence with a draft verifies `draft_tokens` (how
    vLLM's `num_speculative_tokens` works). `adaptive`: per lane, as many drafted tokens (at most
    `draft_tokens`) as raise the engine's accepted tokens per second, expressed as a threshold on
    each drafted token's chance of acceptance (the order in which drafts pay off)."""

    mode: str = "adaptive"
    draft_tokens: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {self.draft_tokens}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.draft_tokens > 0

    def threshold(self, lanes: Sequence[Lane], step_s: Callable[[int], float]) -> float:
        """The lowest chance of acceptance a drafted token may have and still be verified:
        the j-th drafted token of a sequence whose drafter accepts with probability a is verified
        when a^j >= threshold (`draft_length`). 0 drafts everything, inf nothing. `step_s(q)` is
        the engine's time for one verify step of the whole batch with q query tokens (one per
        sequence without speculation). A threshold, unlike per-lane lengths, also applies to
        sequences that join before the next decision."""
        if not self.enabled:
            return math.inf
        if self.mode == "fixed":
            return 0.0
        plain = sum(ln.sequences for ln in lanes)
        if plain <= 0:
            return 0.0
        base = step_s(plain)
        extra = sum(ln.sequences * self.draft_tokens for ln in lanes if ln.acceptance > 0.0)
        if step_s(plain + extra) <= base * (1 + 1e-9):
            return 0.0  # memory-bound: verifying more tokens costs nothing
        return _best_threshold(lanes, step_s, plain, base, self.draft_tokens)

    def draft_length(self, acceptance: float, threshold: float) -> int:
        """Drafted tokens a sequence verifies per step under `threshold`."""
        if acceptance <= 0.0 or threshold > acceptance or not self.enabled:
            return 0
        if threshold <= 0.0 or acceptance >= 1.0:
            return self.draft_tokens
        return min(self.draft_tokens, int(math.log(threshold) / math.log(acceptance) + 1e-9))

    def padded_width(
        self, drafts: Sequence[tuple[float, int]], rows: int, step_s: Callable[[int], float]
    ) -> int:
        """Drafted tokens per row for a backend that pads every row of a verify forward to the
        longest draft (each of `rows` rows then costs 1 + width query tokens): the width that
        maximises expected emitted tokens per second. `drafts` holds (acceptance, tokens found)
        for the rows with a draft; a row's draft is cut to the width. `fixed`: `draft_tokens`."""
        if not self.enabled or not drafts or rows <= 0:
            return 0
        if self.mode == "fixed":
            return self.draft_tokens
        best, best_rate = 0, rows / step_s(rows)
        for width in range(1, self.draft_tokens + 1):
            made = rows - len(drafts) + sum(expected_tokens(a, min(n, width)) for a, n in drafts)
            rate = made / step_s(rows * (1 + width))
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = width, rate
        return best

    def drafts(self, lanes: Sequence[Lane], step_s: Callable[[int], float]) -> list[int]:
        """Draft length per lane (see `threshold`)."""
        theta = self.threshold(lanes, step_s)
        return [self.draft_length(ln.acceptance, theta) for ln in lanes]


def _best_threshold(
    lanes: Sequence[Lane], step_s: Callable[[int], float], plain: int, base: float, kmax: int
) -> float:
    """Add drafted tokens in order of falling chance of acceptance (the j-th token of a lane is
    accepted with probability a^j) and keep the prefix with the most tokens per second. Tokens
    grow concavely and the step time convexly in the query tokens, so the rate is quasi-concave
    in the prefix length and a binary search finds its peak."""
    incs = _order(tuple(ln.acceptance for ln in lanes), kmax)
    query = [plain]
    made = [float(plain)]
    for p, i in incs:
        n = lanes[i].sequences
        query.append(query[-1] + n)
        made.append(made[-1] + n * p)

    def rate(m: int) -> float:
        return made[m] / (base if m == 0 else step_s(query[m]))

    lo, hi = 0, len(incs)
    while lo < hi:
        mid = (lo + hi) // 2
        if rate(mid + 1) > rate(mid) * (1 + 1e-9):
            lo = mid + 1
        else:
            hi = mid
    return incs[lo - 1][0] if lo else math.inf


_ORDERS: dict[tuple[tuple[float, ...], int], list[tuple[float, int]]] = {}


def _order(acceptances: tuple[float, ...], kmax: int) -> list[tuple[float, int]]:
    """Every (chance of acceptance, lane) of the lanes' drafted tokens, likeliest first."""
    key = (acceptances, kmax)
    incs = _ORDERS.get(key)
    if incs is None:
        incs = sorted(((p, i) for i, a in enumerate(acceptances) for p in _powers(a, kmax)), reverse=True)
        if len(_ORDERS) < 65536:
            _ORDERS[key] = incs
    return incs


_POWERS: dict[tuple[float, int], tuple[float, ...]] = {}


def _powers(alpha: float, kmax: int) -> tuple[float, ...]:
    """a, a^2, ..., a^kmax: the chance that each successive drafted token is accepted."""
    key = (alpha, kmax)
    pw = _POWERS.get(key)
    if pw is None:
        pw = tuple(alpha**j for j in range(1, kmax + 1)) if alpha > 0.0 else ()
        if len(_POWERS) < 4096:
            _POWERS[key] = pw
    return pw
