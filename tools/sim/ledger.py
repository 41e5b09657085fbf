"""GPU-time accounting: every GPU-second lands in exactly one category."""

from __future__ import annotations

from collections import defaultdict

CATEGORIES = (
    "rollout_busy",
    "rollout_idle",
    "rollout_sync",
    "train_busy",
    "train_idle",
    "train_sync",
    "switch",
)


class Ledger:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, category: str, gpu_seconds: float) -> None:
        if category not in CATEGORIES:
            raise KeyError(category)
        self.totals[category] += gpu_seconds

    def total(self) -> float:
        return sum(self.totals.values())


class Meter:
    """GPUs that are in one category at a time (a trainer, a hybrid worker in transit)."""

    __slots__ = ("gpus", "ledger", "since", "state")

    def __init__(self, ledger: Ledger, gpus: int) -> None:
        self.ledger = ledger
        self.gpus = gpus
        self.state: str | None = None
        self.since = 0.0

    def set(self, state: str | None, now: float) -> None:
        if self.state is not None:
            self.ledger.add(self.state, (now - self.since) * self.gpus)
        self.state = state
        self.since = now
