"""How long the scheduler's routing decisions take: the policy's own work per decision (wall and
CPU), and from a decision's start to its turn request handed to NATS (`InFlight._dispatch`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from services.simulation.runner import percentile

T = TypeVar("T")

SAMPLES = 20_000
"""The most recent decisions each figure keeps."""


class DecisionTimes:
    def __init__(self) -> None:
        self.decision_us: deque[float] = deque(maxlen=SAMPLES)
        """Latency of the most recent routing decisions (the policy's own work, in microseconds;
        not the polls of a queue that found nothing to place)."""
        self.decision_cpu_us: deque[float] = deque(maxlen=SAMPLES)
        """...and the CPU time this thread spent in each (wall minus what other processes took
        of the core meanwhile, GC and page faults included)."""
        self.dispatch_us: deque[float] = deque(maxlen=SAMPLES)
        """From a routing decision's start to its turn request handed to NATS, in microseconds."""

    def decide(self, fn: Callable[..., T], *args: Any, poll: bool = False) -> T:
        """Runs one routing decision and records how long the policy took; a `poll` (a queue asked
        for a turn to place) counts only when it found one."""
        began, began_cpu = time.perf_counter(), time.thread_time()
        out = fn(*args)
        if not poll or out is not None:
            self.decision_us.append((time.perf_counter() - began) * 1e6)
            self.decision_cpu_us.append((time.thread_time() - began_cpu) * 1e6)
        return out

    def dispatched(self, began: float) -> None:
        """A turn request went to NATS, placed by a decision that began at `began` (`time.perf_counter`)."""
        self.dispatch_us.append((time.perf_counter() - began) * 1e6)

    def decision_quantile(self, q: float) -> float:
        return percentile(list(self.decision_us), q)

    def decision_cpu_quantile(self, q: float) -> float:
        return percentile(list(self.decision_cpu_us), q)

    def dispatch_quantile(self, q: float) -> float:
        return percentile(list(self.dispatch_us), q)
