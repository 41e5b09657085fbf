"""The live planner's replan loop, pure: what the scheduler and the trainer report in, a decision to
re-fit the buckets' token thresholds (or not) out.

The triggers (`ReplanPolicy`) and the re-fit itself (`refit_thresholds`) are the simulator's; this
only turns the live reports into their inputs: the scheduler's `WorkloadStats` (the output lengths
of recently launched trajectories, those still running counted as censored by `length_sample`,
tool seconds per call, prompt tokens, turns, queued turns) and the trainer's `TrainMetrics` (the
step time against the time between steps, i.e. the rollout/training balance). The analytical
model ranks the candidates; with `planner.what_if` the best-ranked ones are simulated on the
observed workload and the simulation picks (`services/simulation/whatif.py`). A threshold change
moves no worker, so its reconfiguration cost is zero; the gain must still pass
`planner.min_gain`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.contracts import ev
from services.common.cost_model import CostModel
from services.common.runconfig import RunConfig
from services.policy.replan import (
    EnginePool,
    ReplanPolicy,
    ReplanSignals,
    choose_refit,
    length_sample,
    refit_layout,
    restart_s,
    threshold_candidates,
)
from services.policy.search import BucketPlan, SearchOptions, WorkloadStats
from services.simulation.observed import ObservedWorkload
from services.simulation.whatif import WhatIf, score_candidates


@dataclass(frozen=True, slots=True)
class RefitDecision:
    trigger: str
    limits: list[float]
    """New token threshold per bucket, in the plan's order (the last is inf)."""
    current_s: float
    best_s: float
    layout: list[BucketPlan] | None = None
    """With `planner.relayout`: each bucket's TP and engines too, when moving engines predicts
    `min_gain` less rollout time than the thresholds alone (None: the engines stay)."""
    what_if: dict[str, object] | None = None
    """What the decision simulated (`WhatIf.record`): None when the analytical model chose."""

    @property
    def gain(self) -> float:
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0


class LiveReplanner:
    def __init__(self, cfg: RunConfig, clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        p = cfg.planner
        preset = p.cost_model or cfg.rollout.emulated
        self.cm: CostModel = preset.costs()
        self.enabled = p.replan and cfg.rollout.policy == "cmlfq" and len(cfg.rollout.buckets) > 1
        self.policy = ReplanPolicy(interval_s=p.interval_s, cooldown_s=p.cooldown_s, min_gain=p.min_gain)
        self.stats: ev.WorkloadStats | None = None
        self.step_s = 0.0
        self.step_interval_s = 0.0
        self._last_step_at: float | None = None
        self._started: float | None = None
        self.clock = clock
        self.last_what_if: WhatIf | None = None

    def observe_workload(self, now: float, stats: ev.WorkloadStats) -> None:
        self.stats = stats
        if self._started is None:
            self._started = now

    def observe_step(self, now: float, m: ev.TrainMetrics) -> None:
        if m.step <= 0 or m.step_s <= 0:
            return
        if self._last_step_at is not None:
            self.step_interval_s = now - self._last_step_at
        self._last_step_at = now
        self.step_s = m.step_s

    def signals(self, replicas: dict[str, int]) -> ReplanSignals:
        assert self.stats is not None
        slots = max(1, sum(replicas.values()) * self.cfg.rollout.max_batch)
        queued = sum(self.stats.queued_turns_by_bucket.values())
        ratio = self.step_interval_s / self.step_s if self.step_s > 0 and self.step_interval_s > 0 else 1.0
        return ReplanSignals(queue_pressure=queued / slots, rejected=0, rollout_train_ratio=ratio)

    def decide(
        self,
        now: float,
        buckets: Sequence[ev.BucketSpec],
        replicas: dict[str, int],
        pool: EnginePool | None = None,
    ) -> RefitDecision | None:
        """A re-fit when the policy's triggers fire (its first interval counts from the first
        stats) and the best candidate beats the current layout by `min_gain`; None otherwise.
        Candidates are the analytically best thresholds and, with `pool` (`planner.relayout`),
        the best layout of the pool's engines over the buckets. With `planner.what_if` they are
        simulated on the observed workload and the simulation picks (`whatif.py`); where the
        budget cannot simulate the current layout and one alternative, the analytical model
        does. `last_what_if` keeps what the last decision simulated, applied or not."""
        s = self.stats
        if not self.enabled or s is None or len(s.trajectory_output_tokens) < self.cfg.planner.min_samples:
            return None
        if self.policy.last_replan is None and self._started is not None:
            self.policy.last_replan = self._started  # the first re-fit waits one interval of data
        fire, trigger = self.policy.should_replan(now, self.signals(replicas))
        if not fire:
            return None
        stats = WorkloadStats(
            trajectories_per_step=self.cfg.trajectories_per_step,
            output_tokens=length_sample(s.trajectory_output_tokens, s.running_output_tokens),
            mean_turns=max(1.0, s.turns_per_trajectory_mean),
            mean_tool_s=s.tool_s_per_turn / self._time_scale(),
            prompt_tokens=s.prompt_tokens,
        )
        plans = [
            BucketPlan(b.name, b.tensor_parallel, max(1, replicas.get(b.name, 0)), _limit(b)) for b in buckets
        ]
        opts = SearchOptions(max_seqs=self.cfg.rollout.max_batch, staleness=self.cfg.training.max_staleness)
        if self.cfg.planner.what_if.budget_s > 0:
            decision = self._simulated(now, trigger, stats, plans, opts, pool)
            if self.last_what_if is not None and self.last_what_if.complete:
                return decision
        refit = choose_refit(self.cm, stats, plans, opts, self.policy, now, pool)
        if refit is None or refit.buckets is None:
            return None
        tried = (
            self.last_what_if.record()
            if self.cfg.planner.what_if.budget_s > 0 and self.last_what_if
            else None
        )
        return self._decision(trigger, plans, refit.buckets, refit.current_s, refit.best_s, tried)

    def _simulated(
        self,
        now: float,
        trigger: str,
        stats: WorkloadStats,
        plans: list[BucketPlan],
        opts: SearchOptions,
        pool: EnginePool | None,
    ) -> RefitDecision | None:
        """The candidates simulated on the observed workload, the fastest applied if it beats the
        current layout by `min_gain` and, when it moves engines, repays their restarts within the
        policy's horizon. Sets `last_what_if`; when it is not complete the caller decides
        analytically."""
        w = self.cfg.planner.what_if
        ranked = threshold_candidates(self.cm, stats, plans, opts)
        candidates: list[tuple[str, list[BucketPlan]]] = [("current", plans)]
        for _, cand in ranked:
            if len(candidates) > w.candidates:
                break
            if [b.max_tokens for b in cand] != [b.max_tokens for b in plans]:
                candidates.append((_label(cand), cand))
        if pool is not None:
            layout = refit_layout(self.cm, stats, plans, opts, pool)
            if layout.buckets is not None:
                candidates.append((f"relayout:{_label(layout.buckets)}", layout.buckets))
        workload = ObservedWorkload(
            stats,
            self.cfg.task.group_size,
            self.cfg.training.groups_per_step,
            self.cfg.task.max_context_tokens,
        )
        report = score_candidates(
            self.cfg,
            self.cm,
            workload,
            candidates,
            steps=w.steps,
            seed=0,
            budget_s=w.budget_s,
            clock=self.clock,
        )
        self.last_what_if = report
        if not report.complete:
            return None
        current, best = report.scored[0], report.best()
        restarts = restart_s(self.cm, plans, best.buckets)
        if best is current or not self.policy.accept(now, current.step_s, best.step_s, restarts):
            self.policy.last_replan = now
            return None
        return self._decision(trigger, plans, best.buckets, current.step_s, best.step_s, report.record())

    def _decision(
        self,
        trigger: str,
        plans: list[BucketPlan],
        chosen: list[BucketPlan],
        current_s: float,
        best_s: float,
        what_if: dict[str, object] | None = None,
    ) -> RefitDecision:
        moved = [(b.tp, b.replicas) for b in chosen] != [(b.tp, b.replicas) for b in plans]
        return RefitDecision(
            trigger,
            [b.max_tokens for b in chosen],
            current_s,
            best_s,
            chosen if moved else None,
            what_if,
        )

    def _time_scale(self) -> float:
        """Tool seconds are wall seconds; the cost model's are the hardware's (emulated runs)."""
        return self.cfg.rollout.emulated.time_scale if self.cfg.rollout.backend == "emulated" else 1.0


def _label(plans: Sequence[BucketPlan]) -> str:
    return ",".join(
        f"{b.name}<={'inf' if math.isinf(b.max_tokens) else int(b.max_tokens)}:{b.replicas}xTP{b.tp}"
        for b in plans
    )


def _limit(b: ev.BucketSpec) -> float:
    return float(b.max_output_tokens) if b.max_output_tokens > 0 else math.inf
