"""Speculative decoding in the live engine: which drafted tokens each running row verifies.

Each step the continuous batcher asks the `Speculator` for drafts. Every eligible row gets the
drafter's proposal (`drafter.SuffixDrafter`: its GRPO siblings' and earlier rollouts' responses to
the same prompt, else its own context), and the speculation policy (`speculation.SpeculationPolicy`,
the object the simulator runs too) cuts them to the width that maximises the engine's emitted
tokens per second, priced by the step times this engine measured (`StepTimes`) and the acceptance
its drafts have had, per source (`Acceptance`). Pure: no clock, no torch; the engine feeds it what
it measured.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.runconfig import SpeculativeConfig
from services.generation.drafter import SuffixDrafter
from services.policy.speculation import SpeculationPolicy

SOURCES = ("group", "prompt", "self")
LANES = SOURCES + tuple(f"{s}-short" for s in SOURCES)
"""Acceptance is estimated per lane: a source, and whether its match was shorter than the
drafter's `key_len` (a backed-off draft, usually accepted less often)."""


class StepTimes:
    """A least-squares line through the engine's recent step times against the query tokens they
    verified (one per row, plus its drafted tokens): through the median time of each size, so a
    stalled step (another process on the cores, a first run of a new shape) does not tilt it. Until
    two different sizes were measured the step is taken to cost the same at any size
    (memory-bound decoding: drafts are free)."""

    def __init__(self, window: int = 256):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def add(self, query_tokens: int, seconds: float) -> None:
        if query_tokens > 0 and seconds > 0:
            self.samples.append((query_tokens, seconds))
            self._fit = None

    def line(self) -> tuple[float, float]:
        """(seconds at zero query tokens, seconds per query token); the slope is never negative."""
        if self._fit is None:
            by_size: dict[int, list[float]] = {}
            for q, t in self.samples:
                by_size.setdefault(q, []).append(t)
            xs = sorted(by_size)
            ys = [statistics.median(by_size[q]) for q in xs]
            n = len(xs)
            if n == 0:
                self._fit = (1.0, 0.0)
            else:
                mx, my = sum(xs) / n, sum(ys) / n
                var = sum((x - mx) ** 2 for x in xs)
                slope = (
                    max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var)
                    if var
                    else 0.0
                )
                self._fit = (max(1e-9, my - slope * mx), slope)
        return self._fit

    def __call__(self, query_tokens: int) -> float:
        base, slope = self.line()
        return base + slope * query_tokens


class RealisedRates:
    """What drafting actually gave. The policy prices drafts by a fitted step time and estimated
    acceptance; this measures each step that verified drafts against plain steps of the same
    number of rows: its gain is the tokens per second it emitted over what a plain step of that
    many rows emits (the median of recent ones). Where the recent gains at a batch size have a
    median below 1 (costs the fit misses: padding, sampling the drafted positions, the cache holes
    rejected drafts leave), drafting at that size is held off, but for every `explore_every`-th
    step, which keeps the evidence fresh. Gains are pooled by powers of two (1, 2, 3-4, 5-8, ...):
    as a batch drains its row count changes every few steps; each gain is still against plain
    steps of its own row count, so pooling does not favour either side."""

    def __init__(self, window: int = 32, min_samples: int = 8, explore_every: int = 32, min_plain: int = 3):
        self.window, self.min_samples, self.explore_every = window, min_samples, explore_every
        self.min_plain = min_plain
        self.plain: dict[int, deque[float]] = {}
        """rows -> recent plain step times."""
        self.drafted: dict[int, deque[tuple[int, int, float]]] = {}
        """pooled size -> recent drafting steps (rows, emitted, seconds)."""
        self._held: dict[int, int] = {}
        self._plain_medians: dict[int, float] | None = None
        """rows -> the median of its recent plain step times (None: to compute again)."""

    @staticmethod
    def size(rows: int) -> int:
        """The pooled batch size `rows` counts under: the next power of two."""
        return 1 << max(0, rows - 1).bit_length()

    def add(self, rows: int, drafted: bool, emitted: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        if drafted:
            self.drafted.setdefault(self.size(rows), deque(maxlen=self.window)).append(
                (rows, emitted, seconds)
            )
        else:
            self.plain.setdefault(rows, deque(maxlen=self.window)).append(seconds)
            self._plain_medians = None

    def gains(self, rows: int) -> list[float]:
        """The gains of the recent drafting steps pooled with `rows` whose row count has plain
        steps to compare with."""
        if self._plain_medians is None:  # asked every step; plain steps change it less often
            self._plain_medians = {
                n: statistics.median(times) for n, times in self.plain.items() if len(times) >= self.min_plain
            }
        plain = self._plain_medians
        return [
            emitted * plain[n] / (n * seconds)
            for n, emitted, seconds in self.drafted.get(self.size(rows), ())
            if n in plain
        ]

    def pays(self, rows: int) -> bool:
        """Whether drafting steps at this batch size emitted at least as many tokens per second as
        plain ones (True until `min_samples` of them could be compared)."""
        gains = self.gains(rows)
        return len(gains) < self.min_samples or statistics.median(gains) >= 1.0

    def allows(self, rows: int) -> bool:
        """Whether the next step of `rows` rows may verify drafts."""
        size = self.size(rows)
        if self.pays(rows):
            self._held.pop(size, None)
            return True
        n = self._held[size] = self._held.get(size, 0) + 1
        return n % self.explore_every == 0


@dataclass
class Acceptance:
    """Per-token acceptance of one draft source, estimated from what the verifier did: a row that
    verified k drafted tokens and accepted a of them saw a acceptances and, if a < k, one rejection
    (the maximum-likelihood estimate of a geometric run), with a prior of one of each and older
    evidence decaying so the estimate follows the policy as it changes."""

    accepted: float = 1.0
    rejected: float = 1.0
    decay: float = 0.995

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if accepted < drafted else 0)

    @property
    def rate(self) -> float:
        return round(self.accepted / (self.accepted + self.rejected), 2)


@dataclass(frozen=True)
class Row:
    """A running row the engine may draft for."""

    slot: int
    prompt_id: str
    group_id: str
    context: Sequence[int]
    """Its prompt and every token it generated so far (the last one not yet verified)."""
    room: int
    """Tokens it may still emit; a step emits at most its drafted tokens and one more."""


@dataclass
class SpecCounters:
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    by_source: dict[str, list[int]] = field(default_factory=lambda: {s: [0, 0] for s in SOURCES})
    """source -> [drafted, accepted]."""
    held_steps: int = 0
    """Steps on which what drafting realised held it off (`RealisedRates`)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted drafted tokens per verified draft."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    def values(self) -> dict[str, float]:
        """For the engine's metrics sample."""
        return {
            "spec_drafted": float(self.drafted),
            "spec_accepted": float(self.accepted),
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted": self.mean_accepted,
            "spec_held_steps": float(self.held_steps),
        }


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, drafter: SuffixDrafter | None = None):
        if cfg.method == "off":
            raise ValueError("speculative decoding is off")
        self.cfg = cfg
        self.policy = SpeculationPolicy(mode=cfg.policy, draft_tokens=cfg.num_tokens)
        self.drafter = drafter or SuffixDrafter()
        self.times = StepTimes()
        self.realised = RealisedRates()
        self.acceptance = {lane: Acceptance() for lane in LANES}
        self.counters = SpecCounters()
        self._lanes: dict[int, str] = {}

    def drafts(self, rows: Sequence[Row]) -> dict[int, list[int]]:
        """Each row's drafted tokens for the next step (rows without any are left out). The hf
        backend pads every row to the longest draft, so one width is chosen for the whole step
        (`SpeculationPolicy.padded_width`) and each draft cut to it."""
        self._lanes.clear()
        if self.policy.mode == "adaptive" and not self.realised.allows(len(rows)):
            self.counters.held_steps += 1
            return {}
        found: list[tuple[Row, list[int], str]] = []
        for row in rows:
            k = min(self.cfg.num_tokens, row.room - 1)
            if k <= 0:
                continue
            prompt = row.prompt_id if self.cfg.method == "suffix" else ""
            d = self.drafter.draft(prompt, row.group_id, row.context, k)
            if d.tokens:
                found.append(
                    (row, d.tokens, d.source if d.match >= self.drafter.key_len else f"{d.source}-short")
                )
        width = self.policy.padded_width(
            [(self.acceptance[lane].rate, len(tokens)) for _, tokens, lane in found],
            len(rows),
            self.times,
        )
        out: dict[int, list[int]] = {}
        for row, tokens, lane in found[: len(found) if width else 0]:
            out[row.slot] = tokens[:width]
            self._lanes[row.slot] = lane
        return out

    def verified(self, slot: int, drafted: int, emitted: int) -> None:
        """Row `slot` verified `drafted` tokens and emitted `emitted` (the accepted ones and one more)."""
        lane = self._lanes.get(slot)
        if lane is None or drafted <= 0:
            return
        accepted = max(0, min(drafted, emitted - 1))
        self.acceptance[lane].observe(drafted, accepted)
        source = lane.removesuffix("-short")
        c = self.counters
        c.verify_steps += 1
        c.drafted += drafted
        c.accepted += accepted
        c.by_source[source][0] += drafted
        c.by_source[source][1] += accepted

    def stepped(self, query_tokens: int, seconds: float, rows: int = 0, emitted: int = 0) -> None:
        """A decode or verify step without prefill took `seconds` for `query_tokens` (rows times
        the step's width: padding costs as much as a drafted token) and emitted `emitted` tokens
        for its `rows` rows (where given: what drafting realised, `RealisedRates`)."""
        self.times.add(query_tokens, seconds)
        if rows:
            self.realised.add(rows, query_tokens > rows, emitted, seconds)

    def finished(self, prompt_id: str, group_id: str, tokens: Sequence[int]) -> None:
        """A finished response, for later drafts of its prompt (`suffix` only)."""
        if self.cfg.method == "suffix" and prompt_id:
            self.drafter.add(prompt_id, group_id, tokens)


def counters(engine: object) -> SpecCounters | None:
    """An engine's speculation counters (None: it does not speculate): Libra's own speculator's
    (`hf`), or those an engine keeps from its library's statistics (`vllm`: `spec_counters`)."""
    spec = getattr(engine, "speculator", None)
    if isinstance(spec, Speculator):
        return spec.counters
    kept = getattr(engine, "spec_counters", None)
    return kept if isinstance(kept, SpecCounters) else None
