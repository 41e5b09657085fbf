"""The scheduler's control-plane figures (pure): a routing decision's latency counts the policy's
work, and a poll of a queue that found nothing is not a decision."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from services.scheduler.inflight import InFlight


def test_a_poll_that_finds_nothing_is_not_a_decision() -> None:
    inflight: Any = SimpleNamespace(decision_us=deque(), decision_cpu_us=deque())
    assert InFlight.decide(inflight, lambda: "engine-0") == "engine-0"
    assert InFlight.decide(inflight, lambda: None) is None  # a placement that queued the turn
    assert InFlight.decide(inflight, lambda: None, poll=True) is None  # nothing to hand a slot
    assert InFlight.decide(inflight, lambda x: x, "traj-1", poll=True) == "traj-1"
    assert len(inflight.decision_us) == 3 and all(us >= 0 for us in inflight.decision_us)
    assert len(inflight.decision_cpu_us) == 3 and all(us >= 0 for us in inflight.decision_cpu_us)


def test_quantiles_of_the_samples() -> None:
    inflight: Any = SimpleNamespace(decision_us=deque(float(x) for x in range(1, 101)), dispatch_us=deque())
    assert InFlight.decision_quantile(inflight, 0.5) == 51.0
    assert InFlight.decision_quantile(inflight, 0.99) == 100.0
    assert InFlight.dispatch_quantile(inflight, 0.99) == 0.0
