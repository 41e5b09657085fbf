"""The scheduler's control-plane figures (pure): a routing decision's latency counts the policy's
work, and a poll of a queue that found nothing is not a decision."""

from __future__ import annotations

from services.scheduler.decisions import DecisionTimes


def test_a_poll_that_finds_nothing_is_not_a_decision() -> None:
    times = DecisionTimes()
    assert times.decide(lambda: "engine-0") == "engine-0"
    assert times.decide(lambda: None) is None  # a placement that queued the turn
    assert times.decide(lambda: None, poll=True) is None  # nothing to hand a slot
    assert times.decide(lambda x: x, "traj-1", poll=True) == "traj-1"
    assert len(times.decision_us) == 3 and all(us >= 0 for us in times.decision_us)
    assert len(times.decision_cpu_us) == 3 and all(us >= 0 for us in times.decision_cpu_us)


def test_quantiles_of_the_samples() -> None:
    times = DecisionTimes()
    times.decision_us.extend(float(x) for x in range(1, 101))
    assert times.decision_quantile(0.5) == 51.0
    assert times.decision_quantile(0.99) == 100.0
    assert times.dispatch_quantile(0.99) == 0.0
