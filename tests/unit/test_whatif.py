"""The live planner simulates its candidate re-fits on the workload the job has shown, within a
time budget, and the simulation picks; the analytical model picks only where the budget cannot
simulate the current layout and one alternative."""

from __future__ import annotations

import random
import statistics

import pytest

from services.common.contracts import ev
from services.common.runconfig import RunConfig
from services.planner.refit import LiveReplanner
from services.policy.search import WorkloadStats
from services.simulation.observed import ObservedWorkload

RNG = random.Random(0)
LENGTHS = [int(RNG.gauss(2000, 300)) for _ in range(180)] + [int(RNG.gauss(30000, 3000)) for _ in range(20)]
STATS = ev.WorkloadStats(
    trajectory_output_tokens=LENGTHS, tool_s_per_turn=5.0, prompt_tokens=2000, turns_per_trajectory_mean=6
)
REPLICAS = {"short": 2, "long": 2}


def _cfg(limit: int, **what_if: float) -> RunConfig:
    rollout = {
        "engines": 4,
        "backend": "emulated",
        "max_batch": 16,
        "buckets": [{"name": "short", "max_output_tokens": limit}, {"name": "long", "tensor_parallel": 2}],
    }
    return RunConfig.model_validate(
        {
            "rollout": rollout,
            "training": {"groups_per_step": 16, "max_staleness": 1},
            "task": {"max_context_tokens": 40960},
            "planner": {"interval_s": 10.0, "cooldown_s": 0.0, "min_samples": 100, "what_if": what_if},
        }
    )


def _buckets(limit: int) -> list[ev.BucketSpec]:
    return [
        ev.BucketSpec(name="short", tensor_parallel=1, max_output_tokens=limit),
        ev.BucketSpec(name="long", tensor_parallel=2),
    ]


def _decide(cfg: RunConfig, limit: int, clock=None):
    r = LiveReplanner(cfg) if clock is None else LiveReplanner(cfg, clock=clock)
    r.observe_workload(0.0, STATS)
    return r, r.decide(10.0, _buckets(limit), REPLICAS)


def test_the_planner_applies_the_candidate_that_simulates_fastest_not_the_analytical_best():
    # Every trajectory in the short bucket (threshold 40k): the analytical model's best threshold
    # keeps nearly all of them there, the simulation finds a split of the 2k/30k cohorts faster.
    analytical = _decide(_cfg(40000, budget_s=0.0), 40000)[1]
    assert analytical is not None and analytical.what_if is None
    r, simulated = _decide(_cfg(40000, budget_s=30.0, candidates=4), 40000)
    assert simulated is not None
    what_if = r.last_what_if
    assert what_if is not None and what_if.complete and what_if.skipped == 0
    rec = simulated.what_if
    assert rec is not None and rec["scored_by"] == "simulation"
    assert [c["label"] for c in rec["candidates"]][0] == "current"  # type: ignore[index]
    assert len(what_if.scored) == 5  # the current layout and four threshold choices
    best = what_if.best()
    assert simulated.limits == [b.max_tokens for b in best.buckets]
    assert simulated.limits != analytical.limits
    # the simulated gain, in step time, is what justified it
    assert simulated.gain == pytest.approx(1 - what_if.scored[0].trajectories_per_s / best.trajectories_per_s)
    assert simulated.gain > 0.03


def test_the_planner_keeps_a_layout_that_no_candidate_beats_in_simulation():
    # At threshold 500 the analytical model wants to move it (test_replan.py); simulated, no
    # candidate is 3 % faster than the current thresholds, so nothing is published.
    analytical = _decide(_cfg(500, budget_s=0.0), 500)[1]
    assert analytical is not None
    r, simulated = _decide(_cfg(500, budget_s=30.0), 500)
    assert r.last_what_if is not None and r.last_what_if.complete
    rates = [s.trajectories_per_s for s in r.last_what_if.scored]
    assert max(rates[1:]) < rates[0] * 1.03
    assert simulated is None
    assert r.policy.last_replan == 10.0  # evaluating starts the cooldown either way


def test_a_budget_that_fits_one_simulation_falls_back_to_the_analytical_model():
    ticks = iter(range(0, 10_000, 5))  # every reading of the clock is 5 s later

    def clock() -> float:
        return float(next(ticks))

    analytical = _decide(_cfg(500, budget_s=0.0), 500)[1]
    r, decision = _decide(_cfg(500, budget_s=2.0, candidates=3), 500, clock)
    assert r.last_what_if is not None and len(r.last_what_if.scored) == 1
    assert r.last_what_if.skipped == 3
    assert decision is not None and analytical is not None
    assert decision.limits == analytical.limits
    assert decision.what_if is not None and decision.what_if["scored_by"] == "analytical"
    assert decision.what_if["skipped"] == 3


def test_an_observed_workload_draws_the_measured_lengths_turns_and_context():
    stats = WorkloadStats(
        64, LENGTHS, mean_turns=6.0, mean_tool_s=5.0, prompt_tokens=2000, context_per_output=1.5
    )
    wl = ObservedWorkload(stats, group_size=4, prompts_per_step=16, max_context=1 << 20)
    specs = [s for g in range(300) for s in wl.group_for(7, g, 0, f"p{g}")]
    assert {s.output_tokens for s in specs} <= set(LENGTHS)
    assert statistics.mean(len(s.turns) for s in specs) == pytest.approx(6.0, rel=0.1)
    assert all(s.prompt_tokens == 2000 for s in specs)
    ratio = statistics.mean(
        (s.context_tokens - s.prompt_tokens) / s.output_tokens for s in specs if len(s.turns) > 1
    )
    assert ratio == pytest.approx(1.5, rel=0.05)
    tool = [t.tool.latency_s for s in specs for t in s.turns if t.tool]
    assert statistics.mean(tool) == pytest.approx(5.0, rel=0.1)
    assert wl.group_for(7, 3, 0, "p3") == wl.group_for(7, 3, 0, "p3")  # common random numbers
    short = wl.with_overrides(max_context=4096)
    assert all(s.context_tokens < 4096 for g in range(50) for s in short.group_for(7, g, 0, "p"))
    with pytest.raises(ValueError, match="at least one"):
        ObservedWorkload(WorkloadStats(1, [], 1.0, 0.0, 10.0), 1, 1)
    with pytest.raises(ValueError, match="takes no"):
        wl.with_overrides(tools={})


def test_a_candidate_the_simulator_cannot_run_is_recorded_and_never_chosen(monkeypatch):
    from services.simulation import whatif

    real = whatif.simulate_layout
    calls = []

    def flaky(cfg, cm, workload, plans, steps, seed):
        calls.append(plans)
        if len(calls) == 2:
            raise RuntimeError("simulation stalled")
        return real(cfg, cm, workload, plans, steps, seed)

    monkeypatch.setattr(whatif, "simulate_layout", flaky)
    r, decision = _decide(_cfg(40000, budget_s=30.0, candidates=2), 40000)
    assert r.last_what_if is not None and r.last_what_if.complete
    failed = r.last_what_if.scored[1]
    assert failed.trajectories_per_s == 0.0 and failed.error == "RuntimeError: simulation stalled"
    assert decision is not None and decision.what_if is not None
    assert decision.what_if["candidates"][1]["error"] == failed.error  # type: ignore[index]
    assert decision.limits != [b.max_tokens for b in failed.buckets]
