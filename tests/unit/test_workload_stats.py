"""The scheduler's workload window: quantiles over what happened in the last `window_s` only."""

from __future__ import annotations

import pytest

from services.scheduler.workload import LENGTH_SAMPLE, WorkloadWindow, quantiles


def test_nearest_rank_quantiles() -> None:
    q = quantiles(range(1, 101))
    assert (q.count, q.p50, q.p90, q.p99, q.max) == (100, 50, 90, 99, 100)
    assert quantiles([7]).p99 == 7 and quantiles([]).count == 0


def test_window_forgets_what_is_older_than_it() -> None:
    w = WorkloadWindow(window_s=10.0)
    w.turn(0.0, new_tokens=1000, context_tokens=5000)  # falls out of the window
    for i in range(10):
        w.turn(5.0 + i * 0.1, new_tokens=10 + i, context_tokens=100)
    w.launched("a")
    w.launched("b")
    w.trajectory(6.0, turns=3, latency_s=2.5, output_tokens=300, prompt_tokens=50, trajectory_id="a")
    w.trajectory(7.0, turns=5, latency_s=4.0, output_tokens=900, prompt_tokens=70, trajectory_id="b")
    w.tool_return(6.0, "ok", 1.0)
    w.tool_return(6.5, "error", 2.0)
    w.tool_return(6.6, "ok", 3.0)
    s = w.stats(12.0, {"short": 3}, trained_version=4)
    assert s.new_tokens_per_turn.count == 10 and s.new_tokens_per_turn.max == 19
    assert s.context_tokens_per_turn.p99 == 100
    assert (s.turns_per_trajectory.p50, s.turns_per_trajectory.max) == (3, 5)
    assert s.trajectory_latency_s.max == 4.0
    assert dict(s.tool_returns_by_status) == {"ok": 2, "error": 1}
    assert dict(s.queued_turns_by_bucket) == {"short": 3}
    assert s.trajectories_per_s == pytest.approx(0.2) and s.trained_version == 4
    assert list(s.trajectory_output_tokens) == [300, 900]
    assert (s.tool_s_per_turn, s.prompt_tokens, s.turns_per_trajectory_mean) == (2.0, 60.0, 4.0)
    assert w.stats(30.0, {}, 4).new_tokens_per_turn.count == 0


def test_length_sample_is_the_last_launched_with_the_running_ones_so_far() -> None:
    w = WorkloadWindow(window_s=10.0)
    for tid in ("a", "b", "c"):
        w.launched(tid)
    w.turn(1.0, 100, 150, "a")
    w.turn(1.0, 200, 250, "b")
    w.turn(2.0, 100, 400, "b")
    w.turn(2.0, 50, 400, "evaluation")  # not launched here: counted per turn, not in the sample
    w.trajectory(3.0, 1, 2.0, output_tokens=100, trajectory_id="a")
    w.trajectory(3.0, 1, 2.0, output_tokens=700, trajectory_id="before-a-restart")
    s = w.stats(4.0, {}, 0)
    assert list(s.trajectory_output_tokens) == [100]
    assert list(s.running_output_tokens) == [300, 0]  # b so far, c not started
    for i in range(LENGTH_SAMPLE):
        w.launched(f"new-{i}")
    s = w.stats(5.0, {}, 0)  # a, b and c were launched longest ago: out of the sample
    assert len(s.running_output_tokens) == LENGTH_SAMPLE and not s.trajectory_output_tokens
