"""GPU-time accounting: every GPU-second lands in exactly one category."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.simulation.engine import Engine

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


def book_engine(ledger: Ledger, e: Engine, restart: bool = False) -> None:
    """An engine's GPU-seconds so far, at its TP, into the ledger (busy, weight sync, idle while
    open); with `restart` its counters start again from zero (its TP may change next)."""
    busy = min(e.busy_s, e.opened_s)
    sync = min(e.sync_s, busy)
    ledger.add("rollout_sync", sync * e.tp)
    ledger.add("rollout_busy", (busy - sync) * e.tp)
    ledger.add("rollout_idle", (e.opened_s - busy) * e.tp)
    if restart:
        e.busy_s = e.sync_s = e.opened_s = 0.0
