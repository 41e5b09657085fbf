"""When the trainer lends its GPUs and takes them back: the forecast on hand-computed cases."""

from __future__ import annotations

import pytest

from services.policy.lend_policy import LendPolicy


def _every_ten_seconds(policy: LendPolicy, groups: int) -> None:
    for i in range(1, groups + 1):
        policy.completed(10.0 * i)


def test_the_forecast_comes_from_the_rate_of_recent_completions_anchored_at_the_last() -> None:
    p = LendPolicy(switch_s=5.0, mode="predictive")
    assert p.rate() is None and p.eta(0.0, 0, 8) is None
    _every_ten_seconds(p, 4)  # completions at 10, 20, 30, 40: 0.1 groups/s
    assert p.rate() == pytest.approx(0.1)
    assert p.eta(40.0, 4, 8) == pytest.approx(40.0)
    assert p.eta(45.0, 4, 8) == pytest.approx(35.0)
    assert p.eta(70.0, 4, 8) == pytest.approx(30.0), "the next completion overdue: due now, no sooner"
    assert p.eta(40.0, 8, 8) == 0.0
    # groups the trainer hears of late (it was training) count at the time they completed
    p.completed(35.0)
    assert p._times == [10.0, 20.0, 30.0, 35.0, 40.0] and p.rate() == pytest.approx(4 / 30)
    for t in range(50, 130, 10):  # only the latest `window` (8) completions count
        p.completed(float(t))
    assert p._times == [float(t) for t in range(50, 130, 10)] and p.rate() == pytest.approx(0.1)


def test_lending_pays_only_if_the_batch_is_further_off_than_both_switches_and_one_of_serving() -> None:
    p = LendPolicy(switch_s=5.0, mode="predictive")
    assert p.should_lend(0.0, 0, 8), "nothing known yet: nothing to train either"
    _every_ten_seconds(p, 4)
    assert p.should_lend(40.0, 4, 8)  # 40 s off >= 3 switches (15 s)
    assert p.should_lend(40.0, 7, 8) is False  # 10 s off
    assert p.should_lend(40.0, 8, 8) is False  # a batch is complete
    slow = LendPolicy(switch_s=20.0, mode="predictive")
    _every_ten_seconds(slow, 4)
    assert slow.should_lend(40.0, 4, 8) is False  # 40 s off < 60
    always = LendPolicy(switch_s=5.0, mode="always")
    _every_ten_seconds(always, 4)
    assert always.should_lend(40.0, 7, 8) and not always.should_lend(40.0, 8, 8)


def test_the_gpus_come_back_one_switch_before_the_forecast_batch() -> None:
    p = LendPolicy(switch_s=5.0, mode="predictive")
    _every_ten_seconds(p, 7)  # the last at 70 s, the 8th due at 80 s
    assert p.reclaim_at(70.0, 7, 8) == pytest.approx(75.0)
    assert not p.should_reclaim(74.9, 7, 8) and p.should_reclaim(75.0, 7, 8)
    assert p.reclaim_at(70.0, 8, 8) == 70.0, "complete: now"
    # two groups off: the forecast would say 85 s, after the next completion is due (80 s): wait
    # for that completion instead of trusting a forecast that far
    assert p.reclaim_at(70.0, 6, 8) is None
    always = LendPolicy(switch_s=5.0, mode="always")
    _every_ten_seconds(always, 7)
    assert always.reclaim_at(75.0, 7, 8) is None and always.reclaim_at(75.0, 8, 8) == 75.0
    assert LendPolicy(switch_s=5.0, mode="predictive").reclaim_at(0.0, 7, 8) is None, (
        "no forecast: at the batch"
    )


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="predictive, always"):
        LendPolicy(switch_s=1.0, mode="sometimes")


def test_early_reclaims_stop_where_the_lent_share_of_a_late_forecast_outweighs_the_switch() -> None:
    """Taking the GPUs back a switch early hides that switch from the step, and costs rollout the
    lent share of its GPUs until the batch really completes (a switch plus the usual lateness)."""
    p = LendPolicy(switch_s=5.0, mode="predictive", lent_share=0.5)
    assert p.lateness() == 0.0 and p.early_pays(), "nothing known: 5 s > 0.5 x 5 s"
    _every_ten_seconds(p, 7)
    assert p.reclaim_at(70.0, 7, 8) == pytest.approx(75.0)  # forecast: complete at 80 s
    p.completed(100.0)  # the batch's last group came 20 s after its forecast
    p.batch_complete()
    assert p.lateness() == pytest.approx(20.0)
    assert not p.early_pays(), "5 s hidden < 0.5 x (5 + 20) s of rollout lost"
    for t in (110.0, 120.0, 130.0, 140.0, 150.0, 160.0, 170.0):
        p.completed(t)
    assert p.reclaim_at(170.0, 7, 8) is None, "the GPUs come back when the batch is complete"
    assert p.reclaim_at(170.0, 8, 8) == 170.0
    small = LendPolicy(switch_s=5.0, mode="predictive", lent_share=0.1)
    _every_ten_seconds(small, 7)
    small.reclaim_at(70.0, 7, 8)
    small.completed(100.0)
    small.batch_complete()
    # a batch completed with no forecast made since (the GPUs were not lent) teaches nothing
    small.batch_complete()
    assert small.lateness() == pytest.approx(20.0)
    assert small.early_pays(), "5 s > 0.1 x 25 s"
    assert small.reclaim_at(100.0, 7, 8) is not None  # the batch forecast at 100 + 90/7 s
    small.completed(105.0)  # early: counts as on time
    small.batch_complete()
    assert small.lateness() == pytest.approx(10.0)
