"""The planner's what-if: candidate layouts of the live job, each simulated on the workload the job
has shown so far (`ObservedWorkload`), with the same seed, within a time budget.

The analytical model proposes (`services/policy/replan.py`); the simulation disposes where it is
affordable. Every candidate runs the job's own admission, staleness, routing and training rules
(`live.system_for`), so the comparison includes what the analytical model leaves out: queueing
behind the staleness bound, stragglers of a group, the trainer's waits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.cost_model import CostModel
from services.common.runconfig import BucketConfig, RunConfig
from services.policy.search import BucketPlan
from services.simulation.live import system_for
from services.simulation.observed import ObservedWorkload
from services.simulation.runner import run_system, steady_rate


@dataclass(frozen=True, slots=True)
class Scored:
    label: str
    buckets: list[BucketPlan]
    trajectories_per_s: float
    sim_s: float
    """Wall seconds its simulation took."""
    error: str = ""
    """Why it could not be simulated (its rate is then 0: it is never chosen)."""

    @property
    def step_s(self) -> float:
        """Simulated seconds per training step (inf: it trained nothing in the horizon)."""
        return 1.0 / self.trajectories_per_s if self.trajectories_per_s > 0 else math.inf


@dataclass(slots=True)
class WhatIf:
    """What one decision simulated: the candidates scored, in the order given (the first is the
    current layout), those the budget left out, the budget and the time it took."""

    scored: list[Scored] = field(default_factory=list)
    skipped: int = 0
    budget_s: float = 0.0
    decision_s: float = 0.0

    @property
    def complete(self) -> bool:
        """The current layout trained in the horizon and at least one alternative was simulated."""
        return len(self.scored) >= 2 and self.scored[0].trajectories_per_s > 0

    def best(self) -> Scored:
        return max(self.scored, key=lambda s: s.trajectories_per_s)

    def record(self) -> dict[str, object]:
        """For the plan history and the report."""
        return {
            "scored_by": "simulation" if self.complete else "analytical",
            "budget_s": self.budget_s,
            "decision_s": round(self.decision_s, 4),
            "candidates": [
                {"label": s.label, "trajectories_per_s": round(s.trajectories_per_s, 5)}
                | ({"error": s.error} if s.error else {})
                for s in self.scored
            ],
            "skipped": self.skipped,
        }


def router_buckets(cfg: RunConfig, plans: Sequence[BucketPlan]) -> list[BucketConfig]:
    """The job's buckets with a candidate's thresholds and TPs (the router the job would run)."""
    by_name = {b.name: b for b in cfg.rollout.buckets}
    out = []
    for p in plans:
        base = by_name.get(p.name) or BucketConfig(name=p.name)
        limit = None if math.isinf(p.max_tokens) else max(1, int(p.max_tokens))
        out.append(
            base.model_copy(update={"tensor_parallel": p.tp, "max_output_tokens": limit, "engines": None})
        )
    return out


def simulate_layout(
    cfg: RunConfig,
    cm: CostModel,
    workload: ObservedWorkload,
    plans: Sequence[BucketPlan],
    steps: int,
    seed: int,
) -> float:
    """Trajectories per second of the job over `steps` steps with the buckets `plans` (steady
    state: the first step and the drained last one left out)."""
    system = system_for(cfg, steps, buckets=list(plans), router_buckets=router_buckets(cfg, plans))
    system.replan = None  # a candidate is judged as it stands
    gpus = sum(p.gpus for p in plans) + cfg.training.emulated_gpus
    out, _ = run_system(system, workload, cm, gpus, steps, seed)
    return steady_rate(out["step_end_s"], cfg.trajectories_per_step, drained=True)


def score_candidates(
    cfg: RunConfig,
    cm: CostModel,
    workload: ObservedWorkload,
    candidates: Sequence[tuple[str, Sequence[BucketPlan]]],
    *,
    steps: int,
    seed: int,
    budget_s: float,
    clock: Callable[[], float],
) -> WhatIf:
    """Simulates the candidates in order while the budget allows: one is started only when the
    time so far plus the slowest simulation yet fits in `budget_s` (the first always starts)."""
    out = WhatIf(budget_s=budget_s)
    start = clock()
    slowest = 0.0
    for i, (label, plans) in enumerate(candidates):
        if i > 0 and clock() - start + slowest > budget_s:
            out.skipped = len(candidates) - i
            break
        t0 = clock()
        error = ""
        try:
            rate = simulate_layout(cfg, cm, workload, plans, steps, seed)
        except Exception as err:  # a candidate the simulator cannot run (say, no engine fits) loses
            rate, error = 0.0, f"{type(err).__name__}: {err}"
        took = clock() - t0
        slowest = max(slowest, took)
        out.scored.append(Scored(label, list(plans), rate, took, error))
    out.decision_s = clock() - start
    return out
